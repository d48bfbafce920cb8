"""`python -m shared.tools.cp RECIPE DEST`: the copied folder runs outside the repository, on its own core
(recipe_core), beside a user's own `shared`/`utils` packages, and holds only the core modules the recipe needs."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shared.tools.cp import VENDORED, copy_recipe, launch_configs, recipe_names
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("--max_train_steps", "2", "--report_to", "none", "--max_train_samples", "64", "--max_eval_samples", "16",
         "--max_seq_length", "32", "--no_save_model")
NEW_PATH_LINE = ("sys.path.insert(0, str(Path(__file__).resolve().parent))"
                 "  # recipe_core/ beside this file, from any directory")


def _env() -> dict[str, str]:
    # Nothing points at the repository: no PYTHONPATH, and every command runs with cwd=DEST.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _outside(tmp_path: Path) -> Path:
    dest = tmp_path / "myproj"
    assert not dest.resolve().is_relative_to(ROOT.resolve()), f"{dest} is inside the repository"
    return dest


def _cp(*args: str) -> subprocess.CompletedProcess:
    """The command as the README gives it, from the repository root."""
    return subprocess.run([sys.executable, "-m", "shared.tools.cp", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def _assert_not_the_repo(text: str) -> None:
    # The venv may live inside a checkout (/work/main/.venv, used from a worktree): its paths are the installed
    # packages, not the repository's code; that checkout must not appear otherwise either.
    venv = Path(sys.prefix).resolve()
    checkouts = {str(ROOT), str(ROOT.resolve())} | ({str(venv.parent)} if (venv.parent / "shared").is_dir() else set())
    for prefix in {sys.prefix, str(venv)}:
        text = text.replace(prefix, "<venv>")
    assert not [c for c in checkouts if c in text], f"the run mentions the repository ({checkouts})"
    assert not re.search(r"[/\\](shared|recipes)[/\\]\w+\.py", text), "the run mentions a shared/ or recipes/ file"


def _core_imports(tree: ast.AST, core: str = "shared") -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == core for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == core:
            lines.append(node.lineno)
    return lines


def _closure(recipe: str) -> set[str]:
    """The core files a recipe imports, transitively: written here independently of shared/tools/cp.py (the core is one
    flat package: `shared.X`, `from . import X`, `from .X import y`, at any depth)."""
    todo, found = [ROOT / "recipes" / f"{recipe}.py"], {"__init__.py"}
    while todo:
        for node in ast.walk(ast.parse(todo.pop().read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[1] for a in node.names if a.name.startswith("shared.")]
            elif isinstance(node, ast.ImportFrom) and (node.level == 1 or node.module in ("shared",)
                                                       or (node.module or "").startswith("shared.")):
                module = node.module.removeprefix("shared").lstrip(".") if node.module else ""
                names = [module] if module else [a.name for a in node.names]
            for n in names:
                if (ROOT / "shared" / f"{n}.py").is_file() and f"{n}.py" not in found:
                    found.add(f"{n}.py")
                    todo.append(ROOT / "shared" / f"{n}.py")
    return found


def _imported_from(dest: Path, module: str) -> dict[str, str]:
    """Where each recipe_core / shared / utils module came from when `module` (the copied recipe) is imported."""
    code = (f"import json, sys; import {module}; print(json.dumps({{n: getattr(m, '__file__', None) for n, m in "
            "sys.modules.items() if n.split('.')[0] in ('recipe_core', 'shared', 'utils')}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=dest, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_not_the_repo(proc.stdout + proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(dest: Path, recipe: str, *extra: str, config: str | None = None) -> dict:
    cmd = [sys.executable]
    if config:
        cmd += ["-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
                "--main_process_port", str(free_port())]
    cmd += [f"{recipe}.py", *SMALL, *extra, "--output_dir", "out"]
    proc = subprocess.run(cmd, cwd=dest, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    _assert_not_the_repo(proc.stdout + proc.stderr)
    return json.loads((dest / "out" / "results.json").read_text())


def _check_copy(dest: Path, recipe: str, readme: str = "README.md") -> None:
    text = (dest / f"{recipe}.py").read_text()
    tree = ast.parse(text)
    assert _core_imports(tree) == [] and _core_imports(tree, VENDORED), "imports not renamed to recipe_core"
    assert NEW_PATH_LINE in text.splitlines() and "parents[1]" not in text
    assert f"recipes/{recipe}.py" not in (ast.get_docstring(tree) or "")
    for path in (dest / VENDORED).glob("*.py"):
        assert _core_imports(ast.parse(path.read_text())) == [], path
    assert {p.name for p in (dest / VENDORED).glob("*.py")} == _closure(recipe)
    named = set(re.findall(r"accelerate_configs/[\w.\-]+\.(?:yaml|json)", ast.get_docstring(tree) or ""))
    assert {f"accelerate_configs/{p.name}" for p in (dest / "accelerate_configs").glob("*")} >= named
    notes = (dest / readme).read_text()
    assert f"python {recipe}.py" in notes
    for cfg in (dest / "accelerate_configs").glob("*.yaml"):
        assert f"accelerate launch --config_file accelerate_configs/{cfg.name} {recipe}.py" in notes


def _check_results(r: dict, recipe: str, processes: int) -> None:
    assert r["recipe"] == recipe and r["num_processes"] == processes
    assert math.isfinite(r["train_loss"])


# (recipe, launch config or None for `python <recipe>.py`, processes, extra flags)
RUNS = [
    ("baseline", None, 1, ()),
    ("zero3_offload", None, 1, ()),  # the recipe's own settings, 1 process
    pytest.param("zero3_offload", "zero3_offload.yaml", 2, (), marks=pytest.mark.slow),  # its copied config
    ("qlora", None, 1, ()),
    ("optim_low_bit", None, 1, ("--optim", "adamw_bnb_8bit")),  # no compiled step: torchao's would add ~30 s here
    ("fp8", None, 1, ("--max_seq_length", "16", "--max_eval_samples", "8")),  # CPU torch._scaled_mm is slow
    pytest.param("fsdp", "fsdp.yaml", 2, (), marks=pytest.mark.slow),  # FSDP refuses 1 process
    pytest.param("pipeline_parallel", "pipeline.yaml", 2, ("--per_device_train_batch_size", "8",
                                                           "--n_microbatches", "4"), marks=pytest.mark.slow),
    pytest.param("tensor_parallel", "multi_cpu.yaml", 2, (), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("recipe, config, processes, extra", RUNS)
def test_copied_recipe_runs_outside_the_repository(tmp_path, recipe, config, processes, extra):
    dest = _outside(tmp_path)
    proc = _cp(recipe, str(dest))
    assert proc.returncode == 0, proc.stderr
    assert f"python {recipe}.py" in proc.stdout  # the summary names the run command
    _check_copy(dest, recipe)
    assert (dest / "requirements.txt").read_bytes() == (ROOT / "requirements.txt").read_bytes()

    loaded = _imported_from(dest, recipe)
    assert loaded and all(Path(f).is_relative_to(dest / VENDORED) for f in loaded.values()), loaded
    assert "shared" not in loaded
    _check_results(_run(dest, recipe, *extra, config=config), recipe, processes)


def test_users_own_shared_and_utils_stay_untouched_and_unused(tmp_path):
    dest = _outside(tmp_path)
    mine = {  # a project that already has the names a recipe could collide with, here and one folder up
        dest / "shared" / "__init__.py": b"USER = True\n",
        dest / "utils" / "__init__.py": b"USER = True\n",
        dest / "README.md": b"# my project\n",
        dest / "requirements.txt": b"numpy\n",
        dest.parent / "shared" / "__init__.py": b"USER = True\n",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    proc = _cp("baseline", str(dest))
    assert proc.returncode == 0, proc.stderr
    _check_copy(dest, "baseline", readme="README_baseline.md")
    assert (dest / "requirements-recipes.txt").read_bytes() == (ROOT / "requirements.txt").read_bytes()
    assert "pip install -r requirements-recipes.txt" in (dest / "README_baseline.md").read_text()

    loaded = _imported_from(dest, "baseline")
    assert "shared" not in loaded and "utils" not in loaded, loaded
    assert all(Path(f).is_relative_to(dest / VENDORED) for f in loaded.values()), loaded
    _check_results(_run(dest, "baseline"), "baseline", 1)
    assert {path: path.read_bytes() for path in mine} == mine


def test_baseline_gets_only_the_core_modules_it_imports(tmp_path):
    c = copy_recipe("baseline", _outside(tmp_path))
    copied = {p.name for p in (c.dest / VENDORED).glob("*.py")}
    assert copied == _closure("baseline")
    # Pipeline, quantization and DeepSpeed are other recipes' business (the rule table, compat.py, is everyone's).
    assert not copied & {"pipeline_stages.py", "quant.py", "deepspeed_setup.py", "cp.py"}
    assert copied < {p.name for p in (ROOT / "shared").glob("*.py")}


def test_every_recipe_copies_with_no_import_of_shared_left(tmp_path):
    for recipe in recipe_names():
        dest = tmp_path / recipe
        copy_recipe(recipe, dest)
        _check_copy(dest, recipe)
        compile((dest / f"{recipe}.py").read_text(), f"{recipe}.py", "exec")


def test_every_import_form_is_rewritten_and_runs(tmp_path):
    # A recipe added later may import the core in any of these ways, at module level or inside functions.
    recipe = tmp_path / "src" / "weird.py"
    recipe.parent.mkdir()
    recipe.write_text('''"""Weird: `python recipes/weird.py`; recipes/weirdo.py stays."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory
import shared.core.args
import shared.core.results as res, json
from shared.core import data, models as mo
from shared.core.optim import (
    total_steps,  # shared.core.optim in a comment stays
)

TEXT = "from shared.core.args import parse_args"  # so does a string


def main():
    from shared.core.checkpoint import resume
    import shared.core.meter
    mods = [shared.core.args, res, data, mo, sys.modules[total_steps.__module__], sys.modules[resume.__module__],
            shared.core.meter]
    print(json.dumps([m.__file__ for m in mods]))


if __name__ == "__main__":
    main()
''')
    dest = _outside(tmp_path)
    c = copy_recipe(str(recipe), dest)
    text = (dest / "weird.py").read_text()
    assert _core_imports(ast.parse(text)) == [] and NEW_PATH_LINE in text
    assert '"""Weird: `python weird.py`; recipes/weirdo.py stays."""' in text
    assert "# shared.core.optim in a comment stays" in text and '"from shared.core.args import parse_args"' in text
    assert "recipe_core.args, res" in text and "            recipe_core.meter]" in text
    assert {"args.py", "results.py", "data.py", "models.py", "optim.py", "checkpoint.py", "meter.py"} <= {
        r.removeprefix(f"{VENDORED}/") for r in c.files}
    proc = subprocess.run([sys.executable, "weird.py"], cwd=dest, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    files = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(files) == 7 and all(Path(f).is_relative_to(dest / VENDORED) for f in files), files


def test_configs_bring_the_files_they_reference(tmp_path):
    # No config of the repository references another today; a DeepSpeed JSON named by a YAML must come along.
    (tmp_path / "accelerate_configs").mkdir()
    (tmp_path / "accelerate_configs" / "ds.yaml").write_text(
        "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: accelerate_configs/ds.json\n"
        "mixed_precision: 'no'\n")
    (tmp_path / "accelerate_configs" / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    (tmp_path / "README.md").write_text("not a config\n")
    doc = "accelerate launch --config_file accelerate_configs/ds.yaml x.py  # see README.md, accelerate_configs/no.yaml"
    found, missing = launch_configs(doc, root=tmp_path)
    assert [p.name for p in found] == ["ds.yaml", "ds.json"] and missing == ["accelerate_configs/no.yaml"]


def test_unknown_recipe_lists_the_recipes(tmp_path):
    proc = _cp("zero4", str(_outside(tmp_path)))
    assert proc.returncode != 0 and "No recipe named 'zero4'" in proc.stderr
    assert "baseline" in proc.stderr and "zero3_offload" in proc.stderr
    assert not (tmp_path / "myproj").exists()


def test_never_overwrites_the_users_files(tmp_path):
    dest = _outside(tmp_path)
    copy_recipe("baseline", dest)
    copy_recipe("baseline", dest)  # a rerun is a no-op, not a refusal
    (dest / "baseline.py").write_text("# my edits\n")
    with pytest.raises(SystemExit, match="--force"):
        copy_recipe("baseline", dest)
    assert (dest / "baseline.py").read_text() == "# my edits\n"
    copy_recipe("baseline", dest, force=True)
    assert (dest / "baseline.py").read_text() != "# my edits\n"

    # A file of the user's where the copy would write stops it before anything is written, --force or not.
    other = tmp_path / "other"
    (other / "accelerate_configs").mkdir(parents=True)
    (other / "accelerate_configs" / "multi_gpu.yaml").write_text("mine: true\n")
    for force in (False, True):
        with pytest.raises(SystemExit, match="multi_gpu.yaml"):
            copy_recipe("baseline", other, force=force)
    assert sorted(p.name for p in other.rglob("*")) == ["accelerate_configs", "multi_gpu.yaml"]

    # A core module the user edited after copying is theirs now: kept unless --force.
    (dest / VENDORED / "meter.py").write_text("# tuned\n")
    with pytest.raises(SystemExit, match="meter.py"):
        copy_recipe("baseline", dest)
    copy_recipe("baseline", dest, force=True)
    assert (dest / VENDORED / "meter.py").read_bytes() == (ROOT / "shared" / "meter.py").read_bytes()
