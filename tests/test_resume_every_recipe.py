"""Every recipe that checkpoints resumes to the run it continues, held against the recipe catalogue
(shared/tools/catalogue.py recipes_support) so that a new recipe cannot be left out: it is resumed here, or named
with the test that resumes it elsewhere (launched, several processes, most of them killed by kill -9 first), or with
why it cannot run on this machine.

Here: a 4-step run that checkpoints at step 2, and a fresh run that resumes that checkpoint from its files alone (as
after a kill -9), end on the same parameters."""

from __future__ import annotations

import shutil

import pytest

from shared.tools.catalogue import recipes_support
from tests.conftest import ROOT, launch, run_recipe

CATALOGUE = recipes_support()

CHECKPOINTS = sorted(r for r in CATALOGUE if "maybe_save_checkpoint(" in (ROOT / "recipes" / f"{r}.py").read_text())
ELSEWHERE = {  # recipe -> (test file, test function) that resumes it, exactly
    "baseline": ("test_reliability.py", "test_interrupted_run_resumes_to_the_same_parameters"),  # kill -9, DDP too
    "gradient_accumulation": ("test_exactness.py", "test_resume_is_exact"),
    "optimizer_in_backward": ("test_optimizer_in_backward.py", "test_resume_is_exact"),
    "zero": ("test_kill_sharded.py", "test_sharded_run_killed_resumes_to_the_same_parameters"),  # ZeRO-3, ZeRO-2+off
    "fsdp": ("test_kill_sharded.py", "test_sharded_run_killed_resumes_to_the_same_parameters"),
    "tensor_parallel": ("test_kill_sharded.py", "test_sharded_run_killed_resumes_to_the_same_parameters"),
    "pipeline_parallel": ("test_pipeline_parallel.py", "test_pipeline_killed_resumes_to_the_same_parameters"),
    "data_model_parallel": ("test_data_model_parallel.py", "test_resumes_every_stage_of_every_replica_exactly"),
    "sequence_parallel": ("test_sequence_parallel.py", "test_gpt2_trains_like_one_process_on_the_whole_sequence"),
    "expert_parallel": ("test_expert_parallel.py", "test_two_processes_train_like_one_each_holding_half_the_experts"),
    "qlora": ("test_kill_quantized.py", "test_a_4bit_run_killed_resumes_its_adapters_exactly"),
    "combined": ("test_kill_quantized.py", "test_a_4bit_run_killed_resumes_its_adapters_exactly"),
}
NOT_HERE = {"fp8": "it needs a GPU with FP8 (compute capability 8.9+); on this CPU machine it is refused"}
RESUMED = [r for r in CHECKPOINTS if r not in ELSEWHERE and r not in NOT_HERE]
# Launched (one process, no config: `accelerate launch recipes/zero3_offload.py`): DeepSpeed keeps process-wide
# state that a second run in this process trips on.
LAUNCHED = {"zero3_offload"}
ARGS = ["--task", "causal-lm", "--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64,
        "--per_device_train_batch_size", 4, "--max_eval_samples", 8, "--disable_dropout", "--no_save_model"]


def test_every_recipe_that_checkpoints_is_resumed_by_a_test():
    assert set(CHECKPOINTS) == set(CATALOGUE) - {"ptq"}, "ptq alone has no loop to checkpoint"
    assert set(ELSEWHERE) | set(NOT_HERE) <= set(CHECKPOINTS)
    for recipe, (file, test) in ELSEWHERE.items():  # the test, its decorators included, resumes that recipe
        source = (ROOT / "tests" / file).read_text()
        at = source.index(f"def {test}(")
        test_source = source[source.rfind("\n\n\n", 0, at):source.find("\n\n\n", at)]
        assert f'"{recipe}"' in test_source and "resume_from_checkpoint" in test_source, (recipe, file, test)


def _run(recipe: str, output_dir, *args) -> dict:
    if recipe in LAUNCHED:
        return launch(recipe, output_dir, *args, config=None, launch_args=("--num_processes", "1"))
    return run_recipe(recipe, output_dir, *args)


@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r in LAUNCHED else r for r in RESUMED])
def test_a_checkpoint_resumes_to_the_run_it_continues(recipe, tmp_path):
    whole = _run(recipe, tmp_path / "whole", *ARGS)
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_00000002",
                    tmp_path / "resumed" / "checkpoints" / "step_00000002")
    resumed = _run(recipe, tmp_path / "resumed", *ARGS, "--resume_from_checkpoint", "latest")
    assert (whole["resumed_from_step"], resumed["resumed_from_step"]) == (0, 2)
    a, b = whole["param_fingerprint"], resumed["param_fingerprint"]
    print(f"{recipe}: resumed at step 2 of 4, parameter fingerprints {a} / {b}")
    # In one process, thread-pool sums may round apart (the exactness tests hold 0.0 in launched runs).
    assert len(a) == len(b) and all(abs(x - y) <= 1e-6 * max(1.0, abs(x)) for x, y in zip(a, b, strict=True))
