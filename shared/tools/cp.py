"""Take a recipe into your own project: the recipe and its task module, to change as your own.

    python -m shared.tools.cp zero3_offload ~/myproj    # or: ... recipes/zero3_offload.py ~/myproj
    cd ~/myproj && python zero3_offload.py

As torchtune's `tune cp` copies a recipe and leaves torchtune installed, DEST gets what you change: the recipe
(DEST/<recipe>.py) and the module of its task (DEST/recipe_core/tasks/: the model, the data, the loss, the metrics).
The rest of the core (flags, launch checks, the rule table, checkpoints, results, the techniques) is imported from
`accelerate_recipes`, this checkout's shared/ installed by its requirements.txt (`-e .`), never edited in a copy.
`--vendor` copies that core too, as the package `recipe_core`: a folder that runs without this checkout installed
(about 4,000 more lines; a `shared` or `utils` package of your own is never shadowed either way).

DEST also gets the launch configs the recipe's docstring names (and accelerate_configs/multi_cpu.yaml, the CPU-only
form, for a recipe that runs in several processes), a requirements.txt of the packages those files import (pinned as
the recipes' requirements.txt pins them) and a README that says what each launch line starts, and which to use on a
CPU-only machine and on a GPU machine. Your own columns and loss: docs/adapting_a_copy.md.

A second recipe copied into the same DEST adds what it needs (requirements.txt gets its packages, its README is
README_<recipe>.md); both copies are linked, or both --vendor. No edit of yours is ever lost: a README.md or
requirements.txt of yours makes it write README_<recipe>.md / requirements-recipes.txt; a file this command wrote that
you edited since stays as it is (and is what runs), the fresh copy written beside it as FILE.new; --force takes the
fresh copy and keeps yours as FILE.orig. Any other file of yours in the way stops it before it writes anything.
"""

from __future__ import annotations

import argparse
import ast
import functools
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
INSTALLED = "accelerate_recipes"  # shared/ as pyproject.toml installs it: what a linked copy imports
LINKED_TOP = (f'"""This copy\'s own modules (written by {COMMAND}): tasks/ holds the model, the data, the loss and '
              f'the metrics.\nThe rest of the core is imported from the installed {INSTALLED}."""\n').encode()
MANIFEST = f"{VENDORED}/COPIED_FROM.json"  # what this command wrote, so a rerun may update it (and nothing else)
OLD_PATH_CALL = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))"
NEW_PATH_CALL = "sys.path.insert(0, str(Path(__file__).resolve().parent))"
NEW_PATH_COMMENT = f"  # {VENDORED}/ beside this file, from any directory"
# Launch configs named in a recipe's docstring (examples like `accelerate_configs/zero*.yaml` do not match).
CONFIG_RE = re.compile(r"accelerate_configs/[\w.\-]+\.(?:ya?ml|json)\b")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")
TASKS = ("text-classification", "causal-lm", "image-classification", "sft")  # shared/tasks/, one module each


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


@functools.lru_cache(maxsize=512)
def _parse(data: bytes) -> ast.Module:
    """A file's tree, parsed once however many recipes copy it (nothing here changes a tree)."""
    return ast.parse(data)


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
    """`old` -> `new` in every absolute import of `old`; in a linked copy (`new` is INSTALLED) `old.tasks` goes to
    VENDORED instead: the copy's own task modules."""
    def target(module: str) -> str:
        return VENDORED if new == INSTALLED and _is_core(module, f"{old}.tasks") else new

    edits = []
    binds_old_name = False  # `import shared.core.args` binds the name `shared`: its uses must follow the rename
    for node in core_imports(tree, old):
        if isinstance(node, ast.ImportFrom):
            # The module's first name is the first NAME token after `from` (alias has positions, module has none).
            tok = src.token_after(src.offset(node.lineno, node.col_offset), tokenize.NAME)
            assert tok.string == old, f"line {node.lineno}: expected `from {old}...`"
            edits.append((src.tok_offset(tok), src.tok_offset(tok) + len(old), target(node.module)))
            continue
        for alias in node.names:
            if _is_core(alias.name, old):
                start = src.offset(alias.lineno, alias.col_offset)
                assert src.text.startswith(old, start), f"line {alias.lineno}: expected `import {old}...`"
                assert alias.asname or target(alias.name) == new, f"line {alias.lineno}: `import {alias.name}`"
                edits.append((start, start + len(old), target(alias.name)))
                binds_old_name |= alias.asname is None
    if binds_old_name:
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id == old:
                start, end = src.span(node)
                edits.append((start, end, new))
    return edits


def _outward_edits(src: _Text, tree: ast.AST, package: tuple[str, ...], kept: str) -> list[tuple[int, int, str]]:
    """A linked copy's task module: a relative import that leaves `kept` (`from ..core import data`) made an import
    of the installed core (`from accelerate_recipes.core import data`); one within it stays relative."""
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.level > 0):
            continue
        base = package[: len(package) - (node.level - 1)] + tuple(node.module.split(".") if node.module else ())
        if base[:1] == (kept,):
            continue
        start = src.offset(node.lineno, node.col_offset)
        first = src.token_after(start, tokenize.OP)  # the dots after `from`
        last = src.token_after(start + 4, tokenize.NAME)  # the next NAME: the module's first part, or `import`
        while last.string != "import":
            last = src.token_after(src.tok_offset(last), tokenize.NAME)
        end = src.tok_offset(last)
        edits.append((src.tok_offset(first), end, ".".join((INSTALLED, *base)) + " "))
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


def rewrite_task_module(text: str, package: tuple[str, ...]) -> str:
    """A task module as a linked copy carries it: what it imports from outside tasks/ comes from the installed core."""
    src, tree = _Text(text), ast.parse(text)
    edits = _import_edits(src, tree, CORE, INSTALLED) + _outward_edits(src, tree, package, "tasks")
    return _check(_apply(text, edits), CORE)


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


@functools.lru_cache(maxsize=512)
def _core_modules_of(data: bytes, package: tuple[str, ...], where: str) -> frozenset[tuple[str, ...]]:
    return frozenset(_imported_modules(_parse(data), package, where))  # once per core file, not once per recipe


@functools.lru_cache(maxsize=512)
def _imports_core(data: bytes) -> bool:
    return bool(core_imports(_parse(data)))


def default_task(recipe_tree: ast.AST) -> str:
    """The task a recipe trains when --task is not given: its parse_args(..., task=...) default, else args.py's."""
    for node in ast.walk(recipe_tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "parse_args":
            for kw in node.keywords:
                if kw.arg == "task" and isinstance(kw.value, ast.Constant):
                    return kw.value.value
    return "text-classification"


def core_closure(recipe_tree: ast.AST, where: str = "the recipe", tasks: tuple[str, ...] = ()
                 ) -> dict[tuple[str, ...], Path]:
    """The core modules a recipe needs: those it imports, what they import (relative imports, imports inside
    functions), their packages' __init__.py, and the core's own __init__.py (importing any module runs it); and the
    task modules of `tasks` (shared/tasks/<task>.py, which load_task imports by name at run time)."""
    todo = {()} | _imported_modules(recipe_tree, None, where) | {("tasks", t.replace("-", "_")) for t in tasks}
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
        todo |= _core_modules_of(path.read_bytes(), package, str(path.relative_to(ROOT)))
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


def _config(path: Path) -> dict:
    return _yaml(path.read_text())


@functools.lru_cache(maxsize=128)
def _yaml(text: str) -> dict:
    import yaml  # PyYAML: an Accelerate dependency

    try:
        data = yaml.safe_load(text)
    except Exception:  # a config that does not parse: nothing known about it
        return {}
    return data if isinstance(data, dict) else {}


def _processes(path: Path) -> int:
    cfg = _config(path)
    return 1 if str(cfg.get("distributed_type", "NO")) == "NO" else int(cfg.get("num_processes", 1) or 1)


def extra_configs(recipe: str, named: list[Path], root: Path = ROOT) -> list[Path]:
    """Launch configs a copy gets beyond those its docstring names: every recipe that trains in several processes
    gets multi_cpu.yaml (2 processes over gloo, the form for a CPU-only machine), and one that names no multi-GPU
    launch gets multi_gpu.yaml. Which recipes run multi-process, and with how many, is the rule table's word."""
    from .catalogue import recipes_support

    support = recipes_support().get(recipe)
    if support is None or support.max_processes == 1 or support.shardings == ("none",):
        return []  # one process only (or a recipe file of the user's, which the table does not know)
    names = {p.name for p in named}
    extra = []
    if support.min_processes <= 2 and "multi_cpu.yaml" not in names:
        extra.append(root / "accelerate_configs" / "multi_cpu.yaml")
    gpu = [p for p in named if p.suffix in (".yaml", ".yml") and _processes(p) > 1 and not _config(p).get("use_cpu")]
    if support.min_processes == 1 and not gpu:
        extra.append(root / "accelerate_configs" / "multi_gpu.yaml")
    return [p for p in extra if p.is_file()]


def launch_note(path: Path) -> str:
    """What `accelerate launch --config_file <path>` starts, for the README's comment on its line."""
    cfg, n = _config(path), _processes(path)
    if n == 1:
        return "1 process"
    kind = {"FSDP": ", FSDP2", "DEEPSPEED": ", DeepSpeed"}.get(str(cfg.get("distributed_type")), "")
    if cfg.get("use_cpu"):
        return f"{n} processes on the CPU over gloo{kind}: the line for a CPU-only machine"
    if "your GPU count" in path.read_text():
        return f"{n} processes (num_processes in the file): set it to your GPU count"
    return f"{n} processes{kind}, one per GPU (without GPUs, {n} on the CPU over gloo)"


# ---------------------------------------------------------------------------------------------------------------
# What the copy needs from pip: the packages its files import, pinned as the repository's requirements.txt pins them

# Import name -> the pip package of the repository's requirements.txt that brings it (where the names differ).
PIP_OF_IMPORT = {"PIL": "pillow", "yaml": "accelerate", "numpy": "accelerate", "huggingface_hub": "transformers",
                 "packaging": "accelerate", "safetensors": "safetensors", "tokenizers": "tokenizers",
                 "pyarrow": "datasets",  # datasets reads files with it (shared/core/data.py: parquet row counts)
                 "pydantic": "deepspeed"}  # its config models (deepspeed_setup.py validates a zero_optimization block)
NEVER_REQUIRED = ("pytest", "pytest-xdist", "ruff", "hypothesis")  # the repository's own test and lint tools
# Names whose use needs a package the file never imports: transformers imports bitsandbytes to load a model
# quantized by a BitsAndBytesConfig (qlora.py).
PACKAGE_OF_NAME = {"BitsAndBytesConfig": "bitsandbytes"}
TRACKER_PACKAGES = {"comet_ml": "comet-ml"}  # --report_to tracker -> pip name, where they differ (core/launch.py)


LIBRARY_LINE = f"-e {ROOT}"


def _pip_name(line: str) -> str:
    return re.split(r"[\s<>=!~;\[#]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pinned() -> dict[str, str]:
    """pip name -> its line in the repository's requirements.txt."""
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return {_pip_name(line): line.strip() for line in lines  # not comments, nor `-e .` (this checkout's core)
            if line.strip() and not line.lstrip().startswith(("#", "-"))}


def _optional(tree: ast.AST) -> set[int]:
    """ids of imports inside `try:` blocks that catch ImportError: the code runs without them (and says what to
    install when a run needs them, e.g. core/launch.py's DeepSpeed check)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                                      for n in ast.walk(h.type)) for h in node.handlers):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)
                      if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def _report_to_default(tree: ast.AST) -> str | None:
    """The default of an `add_argument("--report_to", default=...)` call (core/args.py: tensorboard)."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == "--report_to"):
            for kw in node.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    return None


@functools.lru_cache(maxsize=512)
def _file_needs(data: bytes) -> frozenset[str]:
    """The top-level names one file imports (not the optional ones), and the tracker its --report_to defaults to."""
    tree = _parse(data)
    optional = _optional(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
            names |= {PACKAGE_OF_NAME[a.name] for a in node.names if a.name in PACKAGE_OF_NAME}
    tracker = _report_to_default(tree)
    if tracker and tracker not in ("none", "all"):
        names |= {TRACKER_PACKAGES.get(t.strip(), t.strip()) for t in tracker.split(",") if t.strip()}
    return frozenset(names)


def needed_packages(sources: list[bytes], configs: list[Path] = ()) -> list[str]:
    """The pip names the copied files need: their imports at any depth (the core imports some libraries inside
    functions), the tracker --report_to defaults to, and DeepSpeed for a DeepSpeed launch config; not imports that
    the code guards with `except ImportError`, nor the standard library or the vendored core."""
    names: set[str] = set().union(*(_file_needs(data) for data in sources))
    for path in configs:  # accelerate imports deepspeed for a DEEPSPEED launch
        if path.suffix in (".yaml", ".yml") and str(_config(path).get("distributed_type")) == "DEEPSPEED":
            names.add("deepspeed")
    names -= set(sys.stdlib_module_names) | {CORE, VENDORED, INSTALLED, "__future__"}
    pips = {PIP_OF_IMPORT.get(n, n).lower().replace("_", "-") for n in names} - set(NEVER_REQUIRED)
    return _in_order(pips)


def _in_order(pips: set[str]) -> list[str]:
    order = list(_pinned())  # the repository file's order; anything it does not pin goes last
    return sorted(pips, key=lambda p: (order.index(p) if p in order else len(order), p))


def requirements_text(packages: list[str], recipes: list[str], vendor: bool = True) -> bytes:
    pinned = _pinned()
    head = (ROOT / "requirements.txt").read_text().splitlines()
    comment = [line for line in head[:1] if line.startswith("#")]
    lines = [*comment, f"# What {', '.join(recipes)} and {VENDORED}/ import (written by {COMMAND})."]
    lines += [pinned.get(p, f"{p}  # not pinned in the recipes' requirements.txt") for p in packages]
    if not vendor:  # editable: the copy runs the checkout's core as it is, as the recipes there do
        lines += [f"# The recipes' core, {INSTALLED}: the checkout this was copied from.", LIBRARY_LINE]
    return ("\n".join(lines) + "\n").encode()


def _requirements_of(data: bytes) -> tuple[list[str], list[str]]:
    """(packages, recipes) of a requirements file this command wrote."""
    text = data.decode(errors="replace")
    m = re.search(r"^# What (.+) and " + re.escape(VENDORED), text, re.M)
    recipes = [r.strip() for r in m.group(1).split(",")] if m else []
    return [_pip_name(line) for line in text.splitlines() if line.strip() and not line.startswith(("#", "-"))], recipes


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
    kept: dict[str, str] = field(default_factory=dict)  # edited file left as it is -> where the fresh copy went
    backups: dict[str, str] = field(default_factory=dict)  # edited file replaced (--force) -> where the edit is kept
    tasks: list[str] = field(default_factory=list)  # the task modules it carries (shared/tasks/)
    vendor: bool = False  # the whole core copied (--vendor), not imported from the installed accelerate_recipes

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


def _vendored(dest: Path) -> bool | None:
    """Whether DEST holds a --vendor copy (True), a linked one (False) or none this command wrote (None)."""
    try:
        data = json.loads((dest / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return bool(data.get("vendor", True)) if isinstance(data, dict) else None  # copies before linked ones: vendored


def _ours(dest: Path, rel: str, manifest: dict[str, dict], recipe: str | None = None) -> bool:
    """Written by this command and unedited since (for a README: written for this recipe)."""
    entry = manifest.get(rel)
    return (entry is not None and (recipe is None or entry.get("recipe") == recipe)
            and (dest / rel).is_file() and _sha((dest / rel).read_bytes()) == entry.get("sha256"))


def _readme(c: Copy, doc: str, core_files: list[str]) -> bytes:
    # What the recipe is: the docstring's first paragraph (its first line can stop mid-sentence).
    first = " ".join(doc.strip().split("\n\n")[0].split()) if doc.strip() else c.recipe
    from .catalogue import recipes_support

    known = recipes_support()
    least = known[c.recipe].min_processes if c.recipe in known else 1
    alone = (f"refused: it needs {least} or more processes (a line below)" if least > 1 else
             "1 process (a GPU if there is one, else the CPU)")
    lines = [(f"python {c.recipe}.py", alone)]
    lines += [(f"accelerate launch --config_file {cfg} {c.recipe}.py", launch_note(ROOT / c.files[cfg][1]))
              for cfg in c.configs]
    lines += [(f"python {c.recipe}.py --help", "every flag")]
    width = max(len(cmd) for cmd, _ in lines)
    run = [f"{cmd:<{width}}  # {note}" for cmd, note in lines]
    notes = []
    big = [cfg for cfg in c.configs if "your GPU count" in c.files[cfg][0].decode(errors="replace")]
    cpu = [cfg for cfg in c.configs if _config(ROOT / c.files[cfg][1]).get("use_cpu")]
    gpu = [cfg for cfg in c.configs if cfg not in cpu and _processes(ROOT / c.files[cfg][1]) > 1]
    if c.configs:
        notes.append("Each `accelerate launch` line starts the `num_processes` processes its config names, on this "
                     "machine (the comment on the line gives the number); `--num_processes N` after `launch` "
                     "overrides it.")
    elif c.recipe in known:  # the table's one-process recipes (a recipe of the user's: its docstring named none)
        notes.append("This recipe trains in one process (the recipes' rule table refuses more), so no launch config "
                     "comes with it: `python` is the whole command, on a CPU-only machine as on a GPU.")
    for cfg in big:
        n = _processes(ROOT / c.files[cfg][1])
        every = "both" if n == 2 else f"all {n}"
        notes.append(f"On a GPU machine: `{cfg}` starts {n}; set `num_processes` in it to your GPU count (or add "
                     f"`--num_processes N` after `launch`). On a machine without GPUs {every} would train on the "
                     f"CPU, slowly, each process holding the model (or its shard) in memory.")
    if gpu and not big:
        notes.append(f"On a GPU machine: one process per GPU, {' or '.join(f'`{g}`' for g in gpu)} as the comment "
                     "says; for another GPU count add `--num_processes N` after `launch`.")
    if cpu:
        notes.append(f"On a CPU-only machine, use `{cpu[0]}` ({_processes(ROOT / c.files[cpu[0]][1])} processes "
                     "over gloo; more processes than cores only slows it).")
    elif gpu:
        least = min(_processes(ROOT / c.files[g][1]) for g in gpu)
        notes.append(f"On a CPU-only machine the lines above run over gloo, with the processes they name ({least} at "
                     "the least for this recipe), each holding its part of the model in memory.")
    if c.vendor:
        rows = [f"| `{c.recipe}.py` | `{c.files[c.recipe + '.py'][1]}`, its imports of `{CORE}` renamed `{VENDORED}` |",
                f"| `{VENDORED}/` | `{CORE}/`, {'unchanged' if not c.rewritten_core else 'imports renamed'}: "
                f"{', '.join(f'`{f}`' for f in core_files)} (the modules this recipe imports, and theirs) |"]
        origin = (f"It needs only the pip packages below, not the repository; `{VENDORED}/` is the recipes' core, "
                  "vendored under a name of its own.")
    else:
        rows = [f"| `{c.recipe}.py` | `{c.files[c.recipe + '.py'][1]}`, its imports of `{CORE}` renamed `{INSTALLED}` "
                f"(the installed core) and `{VENDORED}` (its task modules) |",
                f"| `{VENDORED}/` | `{CORE}/`: {', '.join(f'`{f}`' for f in core_files)}, their imports of the core "
                f"made imports of `{INSTALLED}` |"]
        origin = (f"It imports the recipes' core as `{INSTALLED}`, installed from the checkout it was copied from "
                  f"(the last line of `{c.requirements}`; edit it if that checkout moves). `{VENDORED}/` holds what "
                  f"you change. For a folder that needs no install of the core, copy with `--vendor`.")
    rows += [f"| `{rel}` | `{src}` |" for rel, (_, src) in c.files.items() if rel.startswith("accelerate_configs/")]
    rows += [f"| `{c.requirements}` | the pinned lines of the recipes' `requirements.txt` for what the files above "
             "import |"]
    text = f"""# {c.recipe}

{first}

Copied from the efficient-training recipes (`{COMMAND} {c.recipe} DEST`). {origin}

```bash
pip install -r {c.requirements}
{chr(10).join(run)}
```

{chr(10).join("- " + n for n in notes)}

Run `accelerate launch` from this folder (the config paths are relative to it); `python {c.recipe}.py` also runs
from any other directory.

The model, the data, the loss and the metrics you change first are in the task module it carries:
{", ".join(f"`{VENDORED}/tasks/{t.replace('-', '_')}.py` (--task {t})" for t in c.tasks)}. Another task: copy again
with `{COMMAND} {c.recipe} DEST --task NAME`{' --vendor' if c.vendor else ''} (text-classification, causal-lm,
image-classification, sft).

| file | from |
|---|---|
{chr(10).join(rows)}
"""
    return text.encode()


def plan_copy(recipe_path: Path, dest: Path, tasks: list[str] | None = None, vendor: bool = False) -> Copy:
    """Everything to write, decided before anything is written. `tasks`: the task modules to carry (unset: the
    recipe's default task's; "all": every task). `vendor`: the whole core too (else it is imported, installed)."""
    recipe = recipe_path.stem
    text = recipe_path.read_bytes().decode()
    tree = ast.parse(text)
    c = Copy(recipe, dest, vendor=vendor)
    there = _vendored(dest)
    if there is not None and there != vendor:  # one core per folder: a task module cannot import both
        raise SystemExit(f"Nothing written: {dest} holds a {'--vendor' if there else 'linked'} copy, and a "
                         f"{'--vendor' if vendor else 'linked'} one would change its {VENDORED}/. Copy "
                         f"{'with' if there else 'without'} --vendor, or choose another DEST.")
    tasks = TASKS if tasks and "all" in tasks else tuple(dict.fromkeys(tasks or [default_task(tree)]))
    c.tasks = list(tasks)
    origin = str(recipe_path.relative_to(ROOT)) if recipe_path.is_relative_to(ROOT) else str(recipe_path)
    c.files[f"{recipe}.py"] = (rewrite_recipe(text, recipe, new=VENDORED if vendor else INSTALLED).encode(), origin)

    core_files, sources = [], []
    for parts, path in sorted(core_closure(tree, origin, tasks).items()):
        rel = path.relative_to(CORE_DIR).as_posix()
        data = path.read_bytes()
        sources.append(data)
        if not vendor and parts[:1] != ("tasks",):  # a linked copy imports it from the installed core
            if parts == ():
                c.files[f"{VENDORED}/__init__.py"] = (LINKED_TOP, f"written by {COMMAND}")
            continue
        if not vendor:
            package = parts if path.name == "__init__.py" else parts[:-1]
            data = rewrite_task_module(data.decode(), package).encode()
        elif _imports_core(data):  # an absolute `shared.` import inside the core would leave DEST
            data = rewrite_imports(data.decode()).encode()
            c.rewritten_core.append(rel)
        c.files[f"{VENDORED}/{rel}"] = (data, f"{CORE}/{rel}")
        core_files.append(rel)

    doc = ast.get_docstring(tree, clean=False) or ""
    configs, c.missing_configs = launch_configs(doc)
    extra = extra_configs(recipe, configs)
    for path in configs + extra:
        rel = path.relative_to(ROOT).as_posix()  # the same place under DEST: the paths stay valid
        c.files[rel] = (path.read_bytes(), rel)
        if path.suffix in (".yaml", ".yml") and (rel in CONFIG_RE.findall(doc) or path in extra):
            c.configs.append(rel)

    manifest = _manifest(dest)
    # What the files import, the installed core's included: the pins that core was tested with.
    packages = needed_packages([c.files[f"{recipe}.py"][0], *sources], configs + extra)
    recipes = [recipe]
    # A requirements file of the user's stays theirs; one this command wrote (unedited) gets what this recipe adds.
    for req in ("requirements.txt", "requirements-recipes.txt", f"requirements-{recipe}.txt"):
        if not (dest / req).exists():
            break
        if _ours(dest, req, manifest):
            had, recipes = _requirements_of((dest / req).read_bytes())
            recipes = [*dict.fromkeys([*recipes, recipe])]
            packages = _in_order(set(had) | set(packages))
            break
    c.files[req] = (requirements_text(packages, recipes, vendor), "requirements.txt")
    readme = "README.md"
    if (dest / readme).exists() and not _ours(dest, readme, manifest, recipe):
        readme = f"README_{recipe}.md"
    copied_doc = ast.get_docstring(ast.parse(c.files[f"{recipe}.py"][0].decode()), clean=False) or ""
    c.files[readme] = (_readme(c, copied_doc, core_files), f"written by {COMMAND}")  # its paths are the copy's
    return c


def _free(dest: Path, rel: str, suffix: str) -> str:
    """`rel` + suffix, or + suffix + N: a name where nothing is yet (a backup never replaces an older one)."""
    name, n = rel + suffix, 1
    while (dest / name).exists() or (dest / name).is_symlink():
        name, n = f"{rel}{suffix}{n}", n + 1
    return name


def write_copy(c: Copy, force: bool = False) -> Copy:
    """Write the plan, and never lose a file of the user's: a file this command did not write stops it before
    anything is written (--force or not); one it wrote that the user edited since (or DEST/<recipe>.py) stays as it
    is, the fresh copy written beside it as <file>.new; with --force the fresh copy replaces it and the user's
    version is kept as <file>.orig."""
    dest, manifest = c.dest, _manifest(c.dest)
    if dest.exists() and not dest.is_dir():
        raise SystemExit(f"{dest} exists and is not a folder.")
    theirs, edited = [], []
    for rel, (data, _) in c.files.items():
        path = dest / rel
        if not path.exists() and not path.is_symlink():
            continue
        if not path.is_file() or path.is_symlink():
            theirs.append(rel)
        elif path.read_bytes() == data or _ours(dest, rel, manifest):
            continue
        elif rel in manifest or rel == f"{c.recipe}.py":
            edited.append(rel)
        else:
            theirs.append(rel)
    beside = {}
    if not force:
        for rel in edited:
            new = rel + ".new"
            if (dest / new).exists() and not (_ours(dest, new, manifest) or (dest / new).read_bytes() ==
                                                c.files[rel][0]):
                theirs.append(new)
            beside[rel] = new
    if theirs:
        raise SystemExit(f"Nothing written: these files in {dest} were not written by this command (or were edited "
                         f"since), and the copy of {c.recipe} would overwrite them: {', '.join(theirs)}. Move or "
                         "rename them, or choose another DEST (--force never overwrites a file this command did not "
                         "write).")

    for rel, (data, origin) in c.files.items():
        path = dest / rel
        entry = {"from": origin, "sha256": _sha(data), "recipe": c.recipe}
        if rel in beside:  # the user's version stays in place, and in effect; the manifest still says it is edited
            c.kept[rel] = beside[rel]
            rel, path = beside[rel], dest / beside[rel]
        if path.is_file() and path.read_bytes() == data:
            c.unchanged.append(rel)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            if rel in edited:  # --force: the user's version moves aside, never lost
                c.backups[rel] = _free(dest, rel, ".orig")
                path.rename(dest / c.backups[rel])
                if _ours(dest, rel + ".new", manifest):  # an earlier run's fresh copy beside it: now in place
                    (dest / (rel + ".new")).unlink()
                    del manifest[rel + ".new"]
            path.write_bytes(data)
            c.written.append(rel)
        manifest[rel] = entry
    (dest / MANIFEST).write_text(json.dumps({"vendor": c.vendor, "files": manifest}, indent=2) + "\n")
    return c


def copy_recipe(recipe: str, dest: str | Path, force: bool = False, tasks: list[str] | None = None,
                vendor: bool = False) -> Copy:
    recipe_path = resolve_recipe(recipe)
    dest = Path(dest).expanduser().resolve()
    # Into the repository's root or its recipes/, shared/ or configs, the copy would overwrite the originals.
    if dest == ROOT or any(dest.is_relative_to(d) for d in (CORE_DIR, RECIPES, ROOT / "accelerate_configs")):
        raise SystemExit(f"DEST {dest} is the repository's own; choose a folder of your project.")
    return write_copy(plan_copy(recipe_path, dest, tasks, vendor), force)


def summary(c: Copy) -> str:
    core = sorted(r.removeprefix(f"{VENDORED}/") for r in c.files if r.startswith(f"{VENDORED}/"))
    how = "its core vendored" if c.vendor else f"the rest of the core imported from the installed {INSTALLED}"
    lines = [f"Copied {c.recipe} to {c.dest} ({len(c.written)} files written, {len(c.unchanged)} unchanged; {how}):",
             f"  {c.recipe}.py", f"  {VENDORED}/: {' '.join(core)}",
             f"  tasks: {', '.join(c.tasks)} (--task NAME adds another: {', '.join(TASKS)})"]
    configs = [r.removeprefix("accelerate_configs/") for r in c.files if r.startswith("accelerate_configs/")]
    if configs:
        lines.append(f"  accelerate_configs/: {' '.join(configs)}")
    lines.append(f"  {c.requirements}, {c.readme}")
    if c.missing_configs:
        lines.append(f"  (named in the docstring, not in this checkout: {', '.join(c.missing_configs)})")
    lines += ["Run it:", f"  cd {c.dest} && pip install -r {c.requirements}", f"  python {c.recipe}.py"]
    lines += [f"  accelerate launch --config_file {cfg} {c.recipe}.py  # {launch_note(ROOT / c.files[cfg][1])}"
              for cfg in c.configs]
    if c.kept:
        lines.append("Your edits are kept: these files stay as you left them (and are what the copy runs), the fresh "
                     "copy of each is beside it; compare them (`diff FILE FILE.new`) if the new recipe needs what "
                     "differs, or rerun with --force to take the fresh copies (your versions kept as FILE.orig):")
        lines += [f"  {rel}  (fresh copy: {new})" for rel, new in c.kept.items()]
    if c.backups:
        lines.append("--force replaced files you had edited; your versions are kept beside them:")
        lines += [f"  {rel}  (yours: {orig})" for rel, orig in c.backups.items()]
    return "\n".join(lines)


def _non_blank(data: bytes) -> int:
    return sum(1 for line in data.decode(errors="replace").splitlines() if line.strip())


def core_lines(c: Copy, part: str = "") -> int:
    """Non-blank lines of what a copy carries under recipe_core/`part` (the measure the copied-lines caps hold)."""
    return sum(_non_blank(data) for rel, (data, _) in c.files.items() if rel.startswith(f"{VENDORED}/{part}"))


def copied_lines() -> dict[str, tuple[int, int, int, int]]:
    """recipe -> non-blank lines of its copied recipe file and of recipe_core/ as `cp RECIPE DEST` writes it (the
    task module); with --vendor, of the spine (core/ and the task) and of the technique modules (docs/layout.md)."""
    import tempfile

    out = {}
    with tempfile.TemporaryDirectory() as tmp:  # an empty DEST: nothing of a user's changes the plan
        for recipe in recipe_names():
            linked = plan_copy(resolve_recipe(recipe), Path(tmp) / recipe)
            full = plan_copy(resolve_recipe(recipe), Path(tmp) / recipe, vendor=True)
            techniques = core_lines(full, "techniques/")
            out[recipe] = (_non_blank(linked.files[f"{recipe}.py"][0]), core_lines(linked),
                           core_lines(full) - techniques, techniques)
    return out


def lines_table(lines: dict[str, tuple[int, int, int, int]] | None = None) -> str:
    """docs/layout.md's table of copied lines, as markdown."""
    rows = ["| recipe | recipe | `cp` (its task module) | `cp --vendor`: spine | `--vendor`: techniques |",
            "|---|---:|---:|---:|---:|"]
    rows += [f"| `{r}` | {a} | {b} | {c} | {d} |" for r, (a, b, c, d) in (lines or copied_lines()).items()]
    return "\n".join(rows)


def fresh_tables(lines: dict[str, tuple[int, int, int, int]] | None = None) -> dict[Path, str]:
    """docs/layout.md with its copied-lines table, and README.md with its recipe table's `copy` column (recipe + task
    module, as `cp RECIPE DEST` writes them), as they should read."""
    lines = lines or copied_lines()
    layout, readme = ROOT / "docs" / "layout.md", ROOT / "README.md"
    head, rest = layout.read_text().split("<!-- copied-lines -->\n", 1)
    tail = rest.split("<!-- /copied-lines -->", 1)[1]
    rows = readme.read_text().splitlines()
    for i, row in enumerate(rows):
        m = re.match(r"\| `(\w+)` \|(.*)\| [^|]* \|$", row)
        if m and m.group(1) in lines:
            own, task = lines[m.group(1)][:2]
            rows[i] = f"| `{m.group(1)}` |{m.group(2)}| {own} + {task} |"
    return {layout: f"{head}<!-- copied-lines -->\n{lines_table(lines)}\n<!-- /copied-lines -->{tail}",
            readme: "\n".join(rows) + "\n"}


def write_tables() -> list[str]:
    """Refresh the two tables of fresh_tables; the files it changed."""
    changed = []
    for path, text in fresh_tables().items():
        if path.read_text() != text:
            path.write_text(text)
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", help=f"A recipe name ({', '.join(recipe_names()[:3])}, ...) or a recipe file.")
    p.add_argument("dest", nargs="?", help="The folder to write (created if missing).")
    p.add_argument("--lines", action="store_true", help="Print the lines each recipe's copy carries, and stop.")
    p.add_argument("--write", action="store_true", help="With --lines: refresh docs/layout.md's and README.md's.")
    p.add_argument("--task", action="append", choices=(*TASKS, "all"), default=None,
                   help="A task module to carry (repeatable; all: every one). Unset: the recipe's default task's.")
    p.add_argument("--vendor", action="store_true",
                   help=f"Copy the whole core as {VENDORED}/ (a folder that runs without this checkout installed). "
                        f"Unset: only the recipe and its task modules; the rest is imported from {INSTALLED}.")
    p.add_argument("--force", action="store_true",
                   help="Replace DEST/<recipe>.py and the files this command wrote before even if edited since; "
                        "each edited file is kept beside as FILE.orig. Without it an edited file stays as it is and "
                        "the fresh copy goes beside it as FILE.new.")
    args = p.parse_args(argv)
    if args.lines:
        print(lines_table() if not args.write else "\n".join(write_tables()) or "unchanged")
        return 0
    if not (args.recipe and args.dest):
        p.error("name a RECIPE and a DEST folder (or --lines)")
    print(summary(copy_recipe(args.recipe, args.dest, args.force, args.task, args.vendor)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
