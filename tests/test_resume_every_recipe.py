"""Every recipe that checkpoints resumes to the run it continues, generated from the recipe catalogue
(shared/core/rules.py RECIPES) so that a new recipe cannot be left out: a 4-step run that checkpoints at step 2, and
a fresh process that resumes that checkpoint, end on the same parameters.

The resumed process starts from the files alone, as after a kill -9. The recipes whose runs are killed for real,
mid-step and mid-save (KILLED), are left to those tests; one recipe cannot run here, and says why (NOT_HERE)."""

from __future__ import annotations

import shutil

import pytest

from shared.core.rules import RECIPES as CATALOGUE
from tests.conftest import ROOT, launch, run_recipe

CHECKPOINTS = sorted(r for r in CATALOGUE if "maybe_save_checkpoint(" in (ROOT / "recipes" / f"{r}.py").read_text())
KILLED = {"baseline": "test_reliability.py (1 process and DDP)", "zero": "test_kill_sharded.py (ZeRO-3, ZeRO-2 + "
          "offload)", "fsdp": "test_kill_sharded.py", "tensor_parallel": "test_kill_sharded.py",
          "qlora": "test_kill_quantized.py (4-bit)", "combined": "test_kill_quantized.py (4-bit LoRA)",
          # Its checkpoints are DeepSpeed's, as recipes/zero.py's under zero2_offload.yaml: that run is killed there.
          "zero3_offload": "test_kill_sharded.py (recipes/zero.py, zero2_offload.yaml)"}
NOT_HERE = {"fp8": "it needs a GPU with FP8 (compute capability 8.9+); on this CPU machine it is refused"}
RESUMED = [r for r in CHECKPOINTS if r not in KILLED]
# How each recipe is launched when one plain process cannot run it (its catalogue row says why).
LAUNCHED = {"pipeline_parallel": ("pipeline.yaml", ()), "data_model_parallel": ("data_model_parallel.yaml", ()),
            "sequence_parallel": ("multi_cpu.yaml", ())}
FLAGS = {"sequence_parallel": ["--max_seq_length", 64]}
ARGS = ["--task", "causal-lm", "--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64,
        "--per_device_train_batch_size", 4, "--max_eval_samples", 8, "--disable_dropout", "--no_save_model"]


def test_the_list_follows_the_catalogue():
    assert set(CHECKPOINTS) == set(CATALOGUE) - {"ptq"}, "ptq alone has no loop to checkpoint"
    assert set(KILLED) <= set(CHECKPOINTS) and set(RESUMED) | set(KILLED) == set(CHECKPOINTS)
    needs_launch = {r for r, s in CATALOGUE.items() if s.min_processes > 1 or "none" not in s.shardings}
    assert set(LAUNCHED) == needs_launch & set(RESUMED)


def _run(recipe: str, output_dir, *args) -> dict:
    if recipe in LAUNCHED:
        config, launch_args = LAUNCHED[recipe]
        return launch(recipe, output_dir, *args, config=config, launch_args=launch_args)
    return run_recipe(recipe, output_dir, *args)


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r in LAUNCHED else r
                                    for r in RESUMED])
def test_a_checkpoint_resumes_to_the_run_it_continues(recipe, tmp_path):
    if recipe in NOT_HERE:
        pytest.skip(NOT_HERE[recipe])
    args = [*ARGS, *FLAGS.get(recipe, [])]
    whole = _run(recipe, tmp_path / "whole", *args)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_00000002",
                    tmp_path / "resumed" / "checkpoints" / "step_00000002")
    resumed = _run(recipe, tmp_path / "resumed", *args, "--resume_from_checkpoint", "latest")
    assert (whole["resumed_from_step"], resumed["resumed_from_step"]) == (0, 2)
    a, b = whole["param_fingerprint"], resumed["param_fingerprint"]
    print(f"{recipe}: resumed at step 2 of 4, parameter fingerprints {a} / {b}")
    # In one process, thread-pool sums may round apart (the exactness tests hold 0.0 in launched runs).
    assert len(a) == len(b) and all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in zip(a, b, strict=True))
