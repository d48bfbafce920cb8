"""kill -9 of a run on a 4-bit base (qlora.py, combined.py --lora --load_in 4bit) after a checkpoint, then
`latest`: the adapters resume exactly. Their checkpoints hold the trainable parameters only; the quantized base is
rebuilt from its source and checked to be the same (shared/techniques/quant.py checkpoint_trainable_only)."""

import json
import signal

import pytest
from safetensors.torch import load_file

from tests.conftest import launch
from tests.test_reliability import _kill_tree, _start, _wait_for_checkpoint

ARGS = ["--task", "causal-lm", "--max_train_steps", 12, "--checkpointing_steps", 3, "--max_train_samples", 96,
        "--per_device_train_batch_size", 4, "--max_eval_samples", 16, "--disable_dropout"]
ONE = {"config": None, "launch_args": ("--num_processes", "1")}  # one thread, one process, like the cut run


@pytest.mark.slow
@pytest.mark.parametrize("recipe, flags", [("qlora", ["--load_in", "4bit"]),
                                           ("combined", ["--lora", "--load_in", "4bit"])])
def test_a_4bit_run_killed_resumes_its_adapters_exactly(recipe, flags, tmp_path):
    launch(recipe, tmp_path / "full", *ARGS, *flags, **ONE)
    proc = _start(tmp_path / "cut", *ARGS, *flags, recipe=recipe)
    _wait_for_checkpoint(proc, tmp_path / "cut")
    _kill_tree(proc, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0, "the run finished before the kill: nothing was tested"
    saved = sorted((tmp_path / "cut" / "checkpoints").glob("step_*"))[-1]
    kept = load_file(str(saved / "model.safetensors"))
    assert kept and not any("absmax" in k or "quant" in k for k in kept), sorted(kept)[:5]  # the adapters alone
    r = launch(recipe, tmp_path / "cut", *ARGS, *flags, "--resume_from_checkpoint", "latest", **ONE)
    assert 3 <= r["resumed_from_step"] < 12 and r["quantized_layers"] > 0
    adapter = "adapter/adapter_model.safetensors" if recipe == "qlora" else "adapter_model.safetensors"
    full, cut = (load_file(str(tmp_path / d / adapter)) for d in ("full", "cut"))  # what the run produces
    assert full.keys() == cut.keys()
    diff = max((full[k].float() - cut[k].float()).abs().max().item() for k in full)
    print(f"{recipe} 4-bit killed, resumed at step {r['resumed_from_step']}: max abs diff {diff:.1e}")
    assert diff == 0.0
    full_r = json.loads((tmp_path / "full" / "results.json").read_text())
    assert r["eval_loss"] == full_r["eval_loss"]  # the same model evaluated (train_loss windows differ on resume)


def test_a_resume_on_another_base_is_refused(tmp_path):
    """Adapters resumed on a base whose frozen bytes are not the ones they were trained on (a model directory
    re-saved in place, say): refused, naming it, before anything trains."""
    from tests.conftest import run_recipe

    small = ["--task", "causal-lm", "--max_train_steps", 2, "--checkpointing_steps", 2, "--max_train_samples", 64,
             "--max_eval_samples", 16, "--no_save_model"]
    run_recipe("qlora", tmp_path / "a", *small)
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert json.loads((ckpt / "frozen_base.json").read_text())["sha256"]
    (ckpt / "frozen_base.json").write_text(json.dumps({"sha256": "0" * 64}))  # as if trained on another base
    (ckpt / "manifest.json").unlink()  # rewritten below, so the checkpoint verifies and the base check is reached
    from shared.core.checkpoint import _write_manifest

    _write_manifest(ckpt)
    with pytest.raises(SystemExit, match="was not trained on this base model"):
        run_recipe("qlora", tmp_path / "b", *small, "--max_train_steps", 4, "--resume_from_checkpoint", ckpt)
