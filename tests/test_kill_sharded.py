"""kill -9 of a sharded run (ZeRO-3, ZeRO-2 + CPU offload, FSDP, tensor parallel) after a checkpoint, then
`latest`: no work lost.

A file of its own so that pytest's second worker can take it beside tests/test_reliability.py.
"""

import signal

import pytest

from tests.conftest import launch, load_params, max_param_diff
from tests.test_reliability import _kill_tree, _start, _wait_for_checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("recipe,config,preset", [("zero", "zero3.yaml", "tiny"),
                                                  ("zero", "zero2_offload.yaml", "tiny"),
                                                  ("fsdp", "fsdp.yaml", "tiny-moe"),  # FSDP2 of Mixtral's blocks
                                                  ("tensor_parallel", "multi_cpu.yaml", "tiny-llama")])  # its own plan
def test_sharded_run_killed_resumes_to_the_same_parameters(recipe, config, preset, tmp_path):
    """kill -9 of every process of a sharded run after a checkpoint; `latest` resumes to the uninterrupted result."""
    args = ["--task", "causal-lm", "--max_train_steps", 16, "--checkpointing_steps", 4, "--max_train_samples", 128,
            "--per_device_train_batch_size", 4, "--max_eval_samples", 16, "--disable_dropout", "--model_preset", preset]
    launch(recipe, tmp_path / "full", *args, config=config)
    proc = _start(tmp_path / "cut", *args, config=config, recipe=recipe)
    _wait_for_checkpoint(proc, tmp_path / "cut")
    _kill_tree(proc, signal.SIGKILL)
    proc.communicate(timeout=120)
    r = launch(recipe, tmp_path / "cut", *args, "--resume_from_checkpoint", "latest", config=config)
    assert r["num_processes"] == 2 and 4 <= r["resumed_from_step"] < 16, r["resumed_from_step"]
    diff = max_param_diff(load_params(tmp_path / "full"), load_params(tmp_path / "cut"))
    print(f"{recipe} [{config}] killed, resumed at step {r['resumed_from_step']}: max abs param diff {diff:.1e}")
    assert diff <= 1e-6
