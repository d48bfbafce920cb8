"""Take a recipe into your own project: one self-contained folder that runs without this repository.

    python -m shared.tools.cp zero3_offload ~/myproj    # or: ... recipes/zero3_offload.py ~/myproj
    cd ~/myproj && python zero3_offload.py

DEST gets the recipe (DEST/<recipe>.py), the modules of shared/ it imports, transitively, vendored as the package
`recipe_core` (so a `shared` or `utils` package of your own is never shadowed), the launch configs its docstring
names (DEST/accelerate_configs/), requirements.txt and a README. Files of yours in DEST are never overwritten: a
README.md or requirements.txt of yours makes it write README_<recipe>.md / requirements-recipes.txt, and anything
else in the way stops it before it writes anything. A DEST/<recipe>.py that differs needs --force.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import re
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

CORE_DIR = Path(__file__).resolve().parents[1]
CORE = CORE_DIR.name  # the package name the recipes import ("shared")
TOOLS = ("tools",)  # this wing is never copied: a recipe or a module it copies that imports it is refused
COMMAND = f"python -m {CORE}.tools.cp"
ROOT = CORE_DIR.parent
RECIPES = ROOT / "recipes"
VENDORED = "recipe_core"  # a name no user project is likely to have, unlike shared/ or utils/
MANIFEST = f"{VENDORED}/COPIED_FROM.json"  # what this command wrote, so a rerun may update it (and nothing else)
OLD_PATH_CALL = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"
NEW_PATH_CALL = "sys.path.insert(0, str(Path(__file__).resolve().parent))"
NEW_PATH_COMMENT = f"  # {VENDORED}/ beside this file, from any directory"
# Launch configs named in a recipe's docstring (examples like `accelerate_configs/zero*.yaml` do not match).
CONFIG_RE = re.compile(r"accelerate_configs/[\w.\-]+\.(?:ya?ml|json)\b")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


# ---------------------------------------------------------------------------------------------------------------
# Source rewriting: edits at positions that ast and tokenize give, so strings, comments and formatting stay as they are


class _Text:
    """A source text with ast positions (1-based line, UTF-8 byte column) turned into string offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.split("\n")  # ast and tokenize count lines by "\n" ("\r\n" ends in one)
        self.starts = [0]
        for line in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)
        self.tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))

    def offset(self, lineno: int, byte_col: int) -> int:
        return self.starts[lineno - 1] + len(self.lines[lineno - 1].encode()[:byte_col].decode())

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def token_after(self, start: int, kind: int) -> tokenize.TokenInfo:
        """The first token of `kind` that starts after string offset `start`."""
        for tok in self.tokens:
            if tok.type == kind and self.starts[tok.start[0] - 1] + tok.start[1] > start:
                return tok
        raise ValueError(f"no token after offset {start}")

    def tok_offset(self, tok: tokenize.TokenInfo) -> int:
        return self.starts[tok.start[0] - 1] + tok.start[1]


def _is_core(name: str | None, core: str = CORE) -> bool:
    return name is not None and (name == core or name.startswith(core + "."))


def core_imports(tree: ast.AST, core: str = CORE) -> list[ast.Import | ast.ImportFrom]:
    """Every absolute import of the core package, at any depth (inside functions too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(_is_core(a.name, core) for a in node.names):
            found.append(node)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_core(node.module, core):
            found.append(node)
    return found


def _import_edits(src: _Text, tree: ast.AST, old: str, new: str) -> list[tuple[int, int, str]]:
    edits = []
    binds_old_name = False  # `import shared.core.args` binds the name `shared`: its uses must follow the rename
    for node in core_imports(tree, old):
        if isinstance(node, ast.ImportFrom):
            # The module's first name is the first NAME token after `from` (alias has positions, module has none).
            tok = src.token_after(src.offset(node.lineno, node.col_offset), tokenize.NAME)
            assert tok.string == old, f"line {node.lineno}: expected `from {old}...`"
            edits.append((src.tok_offset(tok), src.tok_offset(tok) + len(old), new))
            continue
        for alias in node.names:
            if _is_core(alias.name, old):
                start = src.offset(alias.lineno, alias.col_offset)
                assert src.text.startswith(old, start), f"line {alias.lineno}: expected `import {old}...`"
                edits.append((start, start + len(old), new))
                binds_old_name |= alias.asname is None
    if binds_old_name:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == old:
                start, end = src.span(node)
                edits.append((start, end, new))
    return edits


def _path_line_edits(src: _Text, tree: ast.AST) -> list[tuple[int, int, str]]:
    """The `sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ...` statement, with its comment."""
    wanted = ast.dump(ast.parse(OLD_PATH_CALL).body[0])
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and ast.dump(node) == wanted:
            start, end = src.span(node)
            line_end = src.starts[node.end_lineno - 1] + len(src.lines[node.end_lineno - 1].rstrip("\r"))
            rest = src.text[end:line_end].strip()
            if not rest or rest.startswith("#"):  # the line's comment describes the old path: replace it too
                edits.append((start, line_end, NEW_PATH_CALL + NEW_PATH_COMMENT))
            else:  # more code on the line (`...; x = 1`): the call alone
                edits.append((start, end, NEW_PATH_CALL))
    return edits


def _docstring_edits(src: _Text, tree: ast.AST, recipe: str) -> list[tuple[int, int, str]]:
    """`recipes/<recipe>.py` in docstrings becomes `<recipe>.py`: the copy sits at the top of DEST."""
    pattern = re.compile(rf"(?<![\w./-])recipes/{re.escape(recipe)}\.py\b")
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            start, end = src.span(first.value)
            for m in pattern.finditer(src.text, start, end):
                edits.append((m.start(), m.end(), f"{recipe}.py"))
    return edits


def _apply(text: str, edits: list[tuple[int, int, str]]) -> str:
    edits = sorted(set(edits))
    for (_, end, _), (start, _, _) in zip(edits, edits[1:], strict=False):
        assert end <= start, "overlapping rewrites"
    for start, end, new in reversed(edits):
        text = text[:start] + new + text[end:]
    return text


def rewrite_imports(text: str, old: str = CORE, new: str = VENDORED) -> str:
    """Every absolute import of package `old` (any depth, any form) made an import of `new`."""
    src = _Text(text)
    return _check(_apply(text, _import_edits(src, ast.parse(text), old, new)), old)


def rewrite_recipe(text: str, recipe: str, old: str = CORE, new: str = VENDORED) -> str:
    """The recipe as it runs from DEST: core imports renamed, the sys.path line pointed at DEST, docstring paths."""
    src, tree = _Text(text), ast.parse(text)
    edits = _import_edits(src, tree, old, new) + _path_line_edits(src, tree) + _docstring_edits(src, tree, recipe)
    return _check(_apply(text, edits), old)


def _check(text: str, old: str) -> str:
    left = core_imports(ast.parse(text), old)  # the rewrite must leave nothing that imports the repository's core
    if left:
        raise RuntimeError(f"imports of {old!r} left after the rewrite, lines {[n.lineno for n in left]}")
    return text


# ---------------------------------------------------------------------------------------------------------------
# What to copy


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.py") if not p.name.startswith("_"))


def resolve_recipe(spec: str) -> Path:
    """A recipe name (`zero3_offload`) or the path of a recipe file."""
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise SystemExit(f"{spec}: no such file. Recipes: {', '.join(recipe_names())}")
        return path.resolve()
    path = RECIPES / f"{spec}.py"
    if not path.is_file():
        raise SystemExit(f"No recipe named {spec!r}. Recipes available: {', '.join(recipe_names())}")
    return path


def _module_file(parts: tuple[str, ...]) -> Path | None:
    base = CORE_DIR.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if parts and base.with_name(base.name + ".py").is_file():
        return base.with_name(base.name + ".py")
    return None


def _imported_modules(tree: ast.AST, package: tuple[str, ...] | None, where: str) -> set[tuple[str, ...]]:
    """Core modules (as name parts below the core) that a module imports; `package` is its package, None for a
    file outside the core (a recipe), whose relative imports are not the core's."""
    targets: set[tuple[str, ...]] = set()

    def add(base: tuple[str, ...], names: list[str]) -> None:
        if _module_file(base) is None:
            raise SystemExit(f"{where} imports {'.'.join((CORE, *base))}, which is not in {CORE_DIR}")
        targets.add(base)
        # `from . import data, models`: names that are submodules are modules to copy, others are attributes.
        targets.update(base + (n,) for n in names if _module_file(base + (n,)) is not None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_core(alias.name):
                    add(tuple(alias.name.split(".")[1:]), [])
        elif isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level == 0 and _is_core(node.module):
                add(tuple(node.module.split(".")[1:]), names)
            elif node.level > 0 and package is not None:
                if node.level - 1 > len(package):
                    raise SystemExit(f"{where}: `from {'.' * node.level}{node.module or ''} import` leaves {CORE}/")
                base = package[: len(package) - (node.level - 1)]
                add(base + tuple(node.module.split(".") if node.module else ()), names)
    return targets


def core_closure(recipe_tree: ast.AST, where: str = "the recipe") -> dict[tuple[str, ...], Path]:
    """The core modules a recipe needs: those it imports, what they import (relative imports, imports inside
    functions), their packages' __init__.py, and the core's own __init__.py (importing any module runs it)."""
    todo = {()} | _imported_modules(recipe_tree, None, where)
    found: dict[tuple[str, ...], Path] = {}
    while todo:
        parts = todo.pop()
        if parts in found:
            continue
        path = _module_file(parts)
        if parts[: len(TOOLS)] == TOOLS:
            raise SystemExit(f"{where} reaches {'.'.join((CORE, *parts))}: the tools are never copied, and no "
                             "recipe or core module may import them.")
        found[parts] = path
        package = parts if path.name == "__init__.py" else parts[:-1]
        todo |= {parts[:i] for i in range(len(parts))}  # parent packages
        todo |= _imported_modules(ast.parse(path.read_bytes()), package, str(path.relative_to(ROOT)))
    return found


def _config_references(path: Path, root: Path) -> list[Path]:
    """Config files a launch config names (e.g. `deepspeed_config_file:`), resolved as accelerate does, from where
    it is launched (the repo root), or else beside the config; only files of the repository."""
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            import yaml  # PyYAML: an Accelerate dependency

            data = yaml.safe_load(path.read_text())
    except Exception:  # a config that does not parse is copied as it is; it references nothing we can know
        return []
    values, refs = [data], []
    while values:
        v = values.pop()
        if isinstance(v, dict):
            values.extend(v.values())
        elif isinstance(v, list):
            values.extend(v)
        elif isinstance(v, str) and Path(v).suffix in CONFIG_SUFFIXES and not Path(v).is_absolute():
            for candidate in ((root / v).resolve(), (path.parent / v).resolve()):
                if candidate.is_file() and candidate.is_relative_to(root.resolve()) and candidate != path:
                    refs.append(candidate)
                    break
    return refs


def launch_configs(docstring: str, root: Path = ROOT) -> tuple[list[Path], list[str]]:
    """The configs a docstring names and the config files they reference, transitively; and the names not found."""
    found: list[Path] = []
    missing: list[str] = []
    todo: list[Path] = []
    for name in dict.fromkeys(CONFIG_RE.findall(docstring)):
        if (root / name).is_file():
            todo.append((root / name).resolve())
        else:
            missing.append(name)
    while todo:
        path = todo.pop(0)
        if path not in found:
            found.append(path)
            todo.extend(_config_references(path, root))
    return found, missing


# ---------------------------------------------------------------------------------------------------------------
# Writing DEST


@dataclass
class Copy:
    """What a copy writes: DEST-relative path -> (bytes, where it came from)."""

    recipe: str
    dest: Path
    files: dict[str, tuple[bytes, str]] = field(default_factory=dict)
    configs: list[str] = field(default_factory=list)  # DEST-relative launch configs (yaml) for the run commands
    missing_configs: list[str] = field(default_factory=list)
    rewritten_core: list[str] = field(default_factory=list)  # core modules whose absolute self-imports were renamed
    written: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def readme(self) -> str:
        return next(r for r in self.files if r.startswith("README"))

    @property
    def requirements(self) -> str:
        return next(r for r in self.files if r.startswith("requirements"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(dest: Path) -> dict[str, dict]:
    try:
        return json.loads((dest / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return {}


def _ours(dest: Path, rel: str, manifest: dict[str, dict], recipe: str | None = None) -> bool:
    """Written by this command and unedited since (for a README: written for this recipe)."""
    entry = manifest.get(rel)
    return (entry is not None and (recipe is None or entry.get("recipe") == recipe)
            and (dest / rel).is_file() and _sha((dest / rel).read_bytes()) == entry.get("sha256"))


def _readme(c: Copy, doc: str, core_files: list[str]) -> bytes:
    # What the recipe is: the docstring's first paragraph (its first line can stop mid-sentence).
    first = " ".join(doc.strip().split("\n\n")[0].split()) if doc.strip() else c.recipe
    run = [f"python {c.recipe}.py                     # 1 process (a recipe that needs more says so and stops)"]
    run += [f"accelerate launch --config_file {cfg} {c.recipe}.py" for cfg in c.configs]
    run += [f"python {c.recipe}.py --help              # every flag"]
    rows = [f"| `{c.recipe}.py` | `{c.files[c.recipe + '.py'][1]}`, its imports of `{CORE}` renamed `{VENDORED}` |",
            f"| `{VENDORED}/` | `{CORE}/`, {'unchanged' if not c.rewritten_core else 'imports renamed'}: "
            f"{', '.join(f'`{f}`' for f in core_files)} (the modules this recipe imports, and theirs) |"]
    rows += [f"| `{rel}` | `{src}` |" for rel, (_, src) in c.files.items()
             if rel.startswith("accelerate_configs/") or rel == c.requirements]
    text = f"""# {c.recipe}

{first}

Copied from the efficient-training recipes (`{COMMAND} {c.recipe} DEST`). It needs only the pip packages
below, not the repository; `{VENDORED}/` is the recipes' core, vendored under a name of its own.

```bash
pip install -r {c.requirements}
{chr(10).join(run)}
```

Run `accelerate launch` from this folder (the config paths are relative to it); `python {c.recipe}.py` also runs
from any other directory.

| file | from |
|---|---|
{chr(10).join(rows)}
"""
    return text.encode()


def plan_copy(recipe_path: Path, dest: Path) -> Copy:
    """Everything to write, decided before anything is written."""
    recipe = recipe_path.stem
    text = recipe_path.read_bytes().decode()
    tree = ast.parse(text)
    c = Copy(recipe, dest)
    origin = str(recipe_path.relative_to(ROOT)) if recipe_path.is_relative_to(ROOT) else str(recipe_path)
    c.files[f"{recipe}.py"] = (rewrite_recipe(text, recipe).encode(), origin)

    core_files = []
    for _, path in sorted(core_closure(tree, origin).items()):
        rel = path.relative_to(CORE_DIR).as_posix()
        data = path.read_bytes()
        if core_imports(ast.parse(data)):  # an absolute `shared.` import inside the core would leave DEST
            data = rewrite_imports(data.decode()).encode()
            c.rewritten_core.append(rel)
        c.files[f"{VENDORED}/{rel}"] = (data, f"{CORE}/{rel}")
        core_files.append(rel)

    doc = ast.get_docstring(tree, clean=False) or ""
    configs, c.missing_configs = launch_configs(doc)
    for path in configs:
        rel = path.relative_to(ROOT).as_posix()  # the same place under DEST: the paths stay valid
        c.files[rel] = (path.read_bytes(), rel)
        if path.suffix in (".yaml", ".yml") and rel in CONFIG_RE.findall(doc):
            c.configs.append(rel)

    manifest = _manifest(dest)
    requirements = (ROOT / "requirements.txt").read_bytes()
    req = "requirements.txt"
    if (dest / req).exists() and (dest / req).read_bytes() != requirements and not _ours(dest, req, manifest):
        req = "requirements-recipes.txt"  # the user's own requirements.txt stays theirs
    c.files[req] = (requirements, "requirements.txt")
    readme = "README.md"
    if (dest / readme).exists() and not _ours(dest, readme, manifest, recipe):
        readme = f"README_{recipe}.md"
    c.files[readme] = (_readme(c, doc, core_files), f"written by {COMMAND}")
    return c


def write_copy(c: Copy, force: bool = False) -> Copy:
    """Write the plan; refuse, before writing anything, to overwrite a file that is not this command's own."""
    dest, manifest = c.dest, _manifest(c.dest)
    if dest.exists() and not dest.is_dir():
        raise SystemExit(f"{dest} exists and is not a folder.")
    theirs, recipe_file = [], f"{c.recipe}.py"
    for rel, (data, _) in c.files.items():
        path = dest / rel
        if not path.exists() and not path.is_symlink():
            continue
        if not path.is_file() or path.is_symlink():
            theirs.append(rel)
        elif path.read_bytes() == data:
            continue
        elif rel == recipe_file:
            if not force:
                raise SystemExit(f"{path} exists and differs from the copy of {c.files[rel][1]} (your edits?). "
                                 "Pass --force to overwrite it, or choose another DEST.")
        elif not (_ours(dest, rel, manifest) or (force and rel in manifest)):
            theirs.append(rel)
    if theirs:
        raise SystemExit(f"Nothing written: these files in {dest} are not ones this command wrote (or were edited "
                         f"since), and would be overwritten: {', '.join(theirs)}. Move them, or choose another DEST.")

    for rel, (data, origin) in c.files.items():
        path = dest / rel
        if path.is_file() and path.read_bytes() == data:
            c.unchanged.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            c.written.append(rel)
        manifest[rel] = {"from": origin, "sha256": _sha(data), "recipe": c.recipe}
    (dest / MANIFEST).write_text(json.dumps({"files": manifest}, indent=2) + "\n")
    return c


def copy_recipe(recipe: str, dest: str | Path, force: bool = False) -> Copy:
    recipe_path = resolve_recipe(recipe)
    dest = Path(dest).expanduser().resolve()
    # Into the repository's root or its recipes/, shared/ or configs, the copy would overwrite the originals.
    if dest == ROOT or any(dest.is_relative_to(d) for d in (CORE_DIR, RECIPES, ROOT / "accelerate_configs")):
        raise SystemExit(f"DEST {dest} is the repository's own; choose a folder of your project.")
    return write_copy(plan_copy(recipe_path, dest), force)


def summary(c: Copy) -> str:
    core = sorted(r.removeprefix(f"{VENDORED}/") for r in c.files if r.startswith(f"{VENDORED}/"))
    lines = [f"Copied {c.recipe} to {c.dest} ({len(c.written)} files written, {len(c.unchanged)} unchanged):",
             f"  {c.recipe}.py", f"  {VENDORED}/: {' '.join(core)}"]
    configs = [r.removeprefix("accelerate_configs/") for r in c.files if r.startswith("accelerate_configs/")]
    if configs:
        lines.append(f"  accelerate_configs/: {' '.join(configs)}")
    lines.append(f"  {c.requirements}, {c.readme}")
    if c.missing_configs:
        lines.append(f"  (named in the docstring, not in this checkout: {', '.join(c.missing_configs)})")
    lines += ["Run it:", f"  cd {c.dest} && pip install -r {c.requirements}", f"  python {c.recipe}.py"]
    lines += [f"  accelerate launch --config_file {cfg} {c.recipe}.py" for cfg in c.configs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help=f"A recipe name ({', '.join(recipe_names()[:3])}, ...) or a recipe file.")
    p.add_argument("dest", help="The folder to write (created if missing).")
    p.add_argument("--force", action="store_true",
                   help="Overwrite DEST/<recipe>.py, and files this command wrote before even if edited since.")
    args = p.parse_args(argv)
    print(summary(copy_recipe(args.recipe, args.dest, args.force)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
