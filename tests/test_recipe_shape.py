"""The shape every recipe keeps: its own visible Accelerator(...), the rule check before it, and a diff against
baseline.py that shows the technique and little else, held under a budget per recipe.

A budget is the number of lines `diff recipes/baseline.py recipes/<name>.py` adds or removes: the recipe's entry
in DIFF_BUDGET below. There is no exclude list: a new recipe fails here until it has one,
and a recipe that drifts (copies shared logic back in, or grows a second technique) fails until it is slimmed or its
budget is raised in review, with the reason.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
sys.path.insert(0, str(ROOT))

from shared.tools.catalogue import recipes_support  # noqa: E402

CATALOGUE = recipes_support()

# Each recipe's budget: the lines measured when it was last reshaped, plus about 10% (at least 4) for small edits.
# Issue 32: each budget + the lines its SUPPORT (moved in from shared/core/rules.py's catalogue) adds to the diff
# against baseline's, and the FSDP recipes' import of shared/techniques/fsdp_launch.py (whose STEPS their SUPPORT
# hands to the spine: +1 line for qlora and fsdp), and likewise deepspeed_setup's STEPS in the ZeRO recipes' SUPPORT
# (+1 line for zero, zero3_offload and qlora).
DIFF_BUDGET = {  # qlora +2: --lora_target_modules checked before PEFT (issue 37)
    "mixed_precision": 43, "gradient_accumulation": 55, "activation_checkpointing": 121, "data_parallel": 112,
    "optim_8bit": 59, "optim_low_bit": 61, "pruning": 151, "qat": 93, "ptq": 113, "model_parallel": 101,
    "pipeline_parallel": 159, "data_model_parallel": 166, "tensor_parallel": 156, "sequence_parallel": 68,
    "expert_parallel": 114, "zero": 96, "zero3_offload": 104, "fsdp": 81, "qlora": 178, "activation_offloading": 61,
    "combined": 215, "chunked_loss": 69, "optimizer_in_backward": 62, "fp8": 48,
}

# What every training recipe's Accelerator(...) passes: the behaviour a user who copies the loop must not lose
# (shared/core/launch.py). Only arguments that act: the accumulation plugin where the loop accumulates, the dynamo
# plugin where the model compiles through prepare() (the rule table's `accumulates` and `compiles`), nothing else.
VISIBLE = ("cpu=launch.cpu", "mixed_precision=launch.mixed_precision", "step_scheduler_with_optimizer=False",
           "use_seedable_sampler=True", "launch.kwargs_handlers", "log_with=launch.log_with",
           "project_dir=launch.output_dir")
ACCUMULATES = ("gradient_accumulation_plugin=GradientAccumulationPlugin(", "sync_with_dataloader=False")
COMPILES = ("dynamo_plugin=launch.dynamo_plugin",)  # --torch_compile, or an explicit "no" (never the env's)


def changed_lines(recipe: str, text: str | None = None) -> int:
    """Lines `diff recipes/baseline.py recipes/<recipe>.py` adds or removes (`text`: the recipe as given instead)."""
    base = (ROOT / "recipes" / "baseline.py").read_text().splitlines()
    other = (text if text is not None else (ROOT / "recipes" / f"{recipe}.py").read_text()).splitlines()
    return sum(1 for line in difflib.unified_diff(base, other, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def over_budget(texts: dict[str, str]) -> dict[str, tuple[int, int]]:
    """{recipe: (changed lines, budget)} of the recipe texts over their budget."""
    return {r: (n, DIFF_BUDGET[r]) for r, text in texts.items() if (n := changed_lines(r, text)) > DIFF_BUDGET[r]}


def test_every_recipe_has_a_budget_and_keeps_it():
    assert set(CATALOGUE) == set(RECIPES), "every recipe file has a catalogue entry, and only recipe files"
    assert set(DIFF_BUDGET) == set(CATALOGUE) - {"baseline"}, "every recipe but baseline needs a diff budget"
    assert all(budget > 0 for budget in DIFF_BUDGET.values()), "every recipe but baseline needs a diff budget"
    over = over_budget({r: (ROOT / "recipes" / f"{r}.py").read_text() for r in DIFF_BUDGET})
    assert not over, f"diff against baseline.py over budget (lines, budget): {over}"


def test_the_budget_catches_drift():
    """Every recipe with one small shared helper pasted back in (shared/core/launch.py's _trackers, 21 changed
    lines) goes over its budget, through the same check as above: no budget leaves room for a copied helper."""
    import inspect

    sys.path.insert(0, str(ROOT))
    from shared.core.launch import _trackers

    helper = "\n\n" + inspect.getsource(_trackers)
    texts = {r: (ROOT / "recipes" / f"{r}.py").read_text() for r in DIFF_BUDGET}
    assert not over_budget(texts)  # as they are: within budget
    drifted = over_budget({r: text + helper for r, text in texts.items()})
    assert set(drifted) == set(DIFF_BUDGET), f"budgets with room for a pasted helper: {set(DIFF_BUDGET) - set(drifted)}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_accelerator_is_built_in_the_recipe(recipe):
    source = (ROOT / "recipes" / f"{recipe}.py").read_text()
    assert source.count("Accelerator(") == 1, "one Accelerator(...), built in the recipe itself"
    call = source[source.index("Accelerator("):]
    call = call[:call.index("\n    )\n")] if "Accelerator(\n" in call else call[:call.index("\n")]
    support, trains = CATALOGUE[recipe], "meter.steps(" in source  # ptq quantizes a trained model: no loop
    wanted = {kwarg: trains for kwarg in VISIBLE}
    wanted |= {kwarg: support.accumulates for kwarg in ACCUMULATES} | {kwarg: support.compiles for kwarg in COMPILES}
    wrong = {kwarg: "missing" if want else "passed, but does nothing here" for kwarg, want in wanted.items()
             if (kwarg in call) != want}
    assert not wrong, f"{recipe}: Accelerator(...) {wrong}"
    # The rule table runs before it, and the post-construction checks right after it.
    checked = re.search(r"resolve_launch\(\s*args, RECIPE, SUPPORT\b", source)
    assert checked and checked.start() < source.index("Accelerator(") < source.index("start_run(")
    assert re.search(r"^def add_args\(", source, re.M), "the per-recipe flag hook is add_args in every recipe"
    # Under `accelerate launch` a refusal is then shown once, in the launcher's summary (shared/core/launch.py).
    assert re.search(r"^@entrypoint\b.*\ndef main\(", source, re.M), f"{recipe}: main() lacks @entrypoint"


def test_every_recipe_is_in_the_rule_table():
    assert set(CATALOGUE) == set(RECIPES)


def test_help_shows_the_chosen_tasks_flags(capsys):
    """A task's flags are its module's (add_args in shared/tasks/): --help shows the chosen task's; a run of another
    task holds them at the defaults they have there (results.json and a checkpoint's record read as before)."""
    from shared.core.args import TASK_FLAGS, TASKS, parse_args

    for task in TASKS:
        with pytest.raises(SystemExit):
            parse_args(["--task", task, "--help"])
        out = capsys.readouterr().out
        assert {f for f in TASK_FLAGS if re.search(rf"^  --{f}\b", out, re.M)} == {
            f for f, (serves, _) in TASK_FLAGS.items() if task in serves}, task
    plain = parse_args([])
    for flag, (serves, default) in TASK_FLAGS.items():
        assert getattr(plain, flag) == default == getattr(parse_args(["--task", serves[-1]]), flag), flag
    assert parse_args(["--packing", "none"]).packing == "none"  # typed for another task: parsed, the rules refuse it


@pytest.mark.parametrize("recipe", ["baseline", "qlora"])
def test_help_keeps_the_docstring_and_shows_every_default(recipe):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / f"{recipe}.py"), "--help"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    doc = [line for line in __import__("ast").get_docstring(
        __import__("ast").parse((ROOT / "recipes" / f"{recipe}.py").read_text())).splitlines() if line.strip()]
    assert all(line in out for line in doc), "the docstring's lines, as written"
    flags = re.findall(r"^  (--[a-z0-9_]+)", out, re.M)
    assert len(flags) > 30
    blocks = re.split(r"\n  (?=--)", out.split("options:", 1)[1])
    missing = [b.split()[0] for b in blocks[1:] if "default" not in b]
    assert not missing, f"flags whose default --help does not show: {missing}"
    assert not proc.stderr.strip(), f"--help printed noise: {proc.stderr[:500]}"
    print(f"{recipe} --help: {seconds:.2f} s")


def test_known_noise_is_silenced_and_nothing_else():
    """Each silenced message is dropped by logger and text; a different message on the same logger still shows."""
    import io
    import logging

    from shared.core.quiet import _LOG_RECORDS, silence_known_noise

    silence_known_noise()
    silence_known_noise()  # idempotent: one filter per rule
    # A stream of its own: once an earlier test has set up torch's logging, torch's handler prints the torch.*
    # records to stderr too, and a count taken there would see them twice.
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    for name, pattern, _why in _LOG_RECORDS:
        logger = logging.getLogger(name)
        assert sum(getattr(f, "pattern", None) is not None and f.pattern.pattern == pattern
                   for f in logger.filters) == 1
        logger.addHandler(handler)
        try:
            sample = pattern.lstrip("^").replace(".*", " x ").replace("(mxfp8|cutlass_90a)", "mxfp8")
            logger.warning(sample)  # matches the rule: dropped
            logger.warning("something else went wrong in %s", name)  # must still show
        finally:
            logger.removeHandler(handler)
    err = stream.getvalue()
    assert err.count("something else went wrong") == len(_LOG_RECORDS)
    for name, pattern, _why in _LOG_RECORDS:
        assert not any(__import__("re").search(pattern, line) for line in err.splitlines()), (name, err)


@pytest.mark.slow
def test_a_4bit_run_prints_none_of_the_known_noise(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "qlora.py"), "--max_train_steps", "1",
                           "--report_to", "none", "--no_save_model", "--output_dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    for noise in ("Setting accelerator to CPU", "_C_mxfp8", "Detected no triton", "is an Enum subclass",
                  "gemm_4bit_forward", "fan_in_fan_out is set to False"):
        assert noise not in out, noise


def test_core_imports_run_one_way():
    """shared/'s modules import each other without a cycle (function-level imports included), in layers: core imports
    only core, a technique only core and techniques, and nothing on the training path imports shared/tools; none
    imports a recipe, a test or a benchmark."""
    import ast
    import graphlib

    paths = {".".join(p.relative_to(ROOT / "shared").with_suffix("").parts): p
             for p in (ROOT / "shared").rglob("*.py") if p.name != "__init__.py"}  # "core.launch": its path
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        package = module.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])
                targets |= {base} | {f"{base}.{a.name}".lstrip(".") for a in node.names}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("recipes", "tests", "benchmarks") for n in names), path.name
                targets |= {n.removeprefix("shared.") for n in names if n.startswith("shared.")}
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared."):
                    targets |= {f"{node.module.removeprefix('shared.')}.{a.name}" for a in node.names}
        graph[module] = {t for t in targets if t in paths and t != module}
    # The scan sees the imports it must (else every assertion below holds vacuously).
    assert len(graph) >= 20 and "core.rules" in graph["core.launch"], graph.get("core.launch")
    assert "core.rules" in graph["techniques.tensor_parallel"] and "core.plan" not in graph, graph
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError on a cycle
    layer = {"core": {"core"}, "tasks": {"core", "tasks"}, "techniques": {"core", "techniques"},
             "tools": {"core", "tasks", "techniques", "tools"}}
    crossing = {m: sorted(d for d in deps if d.split(".")[0] not in layer[m.split(".")[0]])
                for m, deps in graph.items()}
    assert not {m: d for m, d in crossing.items() if d}, "an import against the layers (core < tasks < tools)"
