"""Techniques that must not change the math: accumulation, data parallelism, resume. fp32, dropout off."""

import pytest

from tests.conftest import launch, load_params, max_param_diff, run_recipe

TOL = 1e-5  # fp32: only the order of summation differs


# causal-lm twice: packed (the default: every block holds as many target tokens as the next) and one padded line per
# sample (micro-batches hold different numbers of them, which only a normalization over the whole batch gets right).
@pytest.mark.parametrize("task", ["text-classification", "causal-lm", "causal-lm-per-line", "image-classification"])
def test_accumulation_equals_one_large_batch(task, tmp_path):
    """4 micro-batches of 4 with accumulation 4 == one batch of 16, after one optimizer step."""
    per_line = ["--packing", "none"] if task.endswith("-per-line") else []
    common = ["--task", task.removesuffix("-per-line"), *per_line, "--disable_dropout", "--max_train_steps", 1,
              "--max_grad_norm", 0]
    run_recipe("baseline", tmp_path / "big", *common, "--per_device_train_batch_size", 16)
    r = run_recipe("gradient_accumulation", tmp_path / "acc", *common, "--per_device_train_batch_size", 4,
                   "--gradient_accumulation_steps", 4)
    diff = max_param_diff(load_params(tmp_path / "big"), load_params(tmp_path / "acc"))
    print(f"{task}: accumulation 4x4 vs batch 16, max abs param diff {diff:.2e}")
    assert r["gradient_accumulation_steps"] == 4
    assert diff <= TOL


def test_per_token_normalization_matters(tmp_path):
    """The check above can fail: averaging per micro-batch instead of per token gives other parameters."""
    from tests.conftest import load_recipe

    # One line per sample, so micro-batches hold different numbers of target tokens (packed blocks all hold the
    # same number, and there the two averages agree).
    common = ["--task", "causal-lm", "--disable_dropout", "--max_train_steps", 1, "--max_grad_norm", 0,
              "--packing", "none"]
    run_recipe("baseline", tmp_path / "big", *common, "--per_device_train_batch_size", 16)
    # Four single-batch baseline steps with lr/4 would differ anyway; instead, weigh micro-batches equally:
    recipe = load_recipe("gradient_accumulation")
    original = recipe.load_task

    def per_micro_batch_mean(args, accelerator):
        task = original(args, accelerator)
        task_loss = task.loss
        task.loss = lambda model, batch, num_items=None: task_loss(model, batch)  # ignores the global count
        return task

    recipe.load_task = per_micro_batch_mean
    from tests.conftest import _reset_accelerate

    _reset_accelerate()
    recipe.main([*map(str, common), "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
                 "--report_to", "none", "--output_dir", str(tmp_path / "naive")])
    diff = max_param_diff(load_params(tmp_path / "big"), load_params(tmp_path / "naive"))
    print(f"per-micro-batch averaging vs batch 16: max abs param diff {diff:.2e}")
    assert diff > 100 * TOL


def test_ddp_equals_one_process(tmp_path):
    """2 processes x batch 8 over gloo == 1 process x batch 16; the replicas stay identical."""
    common = ["--task", "text-classification", "--disable_dropout", "--max_train_steps", 3]
    run_recipe("baseline", tmp_path / "one", *common, "--per_device_train_batch_size", 16)
    r = launch("baseline", tmp_path / "ddp", *common, "--per_device_train_batch_size", 8)
    assert (r["distributed_type"], r["num_processes"]) == ("MULTI_CPU", 2)
    assert r["param_fingerprint"][0] == r["param_fingerprint"][1], "replicas diverged"
    diff = max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "ddp"))
    print(f"DDP 2x8 vs 1x16 after 3 AdamW steps: max abs param diff {diff:.2e}")
    assert diff <= TOL


@pytest.mark.slow
def test_accumulation_under_ddp_equals_one_large_batch(tmp_path):
    """2 processes x 2 micro-batches of 4 == 1 process x 16, with the loss normalized over all target tokens."""
    # One line per sample: micro-batches with different numbers of target tokens.
    common = ["--task", "causal-lm", "--packing", "none", "--disable_dropout", "--max_train_steps", 2]
    run_recipe("baseline", tmp_path / "one", *common, "--per_device_train_batch_size", 16)
    r = launch("gradient_accumulation", tmp_path / "ddp", *common, "--per_device_train_batch_size", 4,
               "--gradient_accumulation_steps", 2)
    assert (r["distributed_type"], r["num_processes"], r["gradient_accumulation_steps"]) == ("MULTI_CPU", 2, 2)
    assert r["param_fingerprint"][0] == r["param_fingerprint"][1], "replicas diverged"
    diff = max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "ddp"))
    print(f"DDP 2 x accumulation 2 x 4 vs 1 x 16 (causal LM): max abs param diff {diff:.2e}")
    assert diff <= TOL


@pytest.mark.parametrize("recipe,accumulation", [("baseline", 1), ("gradient_accumulation", 2)])
def test_resume_is_exact(recipe, accumulation, tmp_path):
    """Stopped at step 6 and resumed == uninterrupted: dropout on, several epochs (48 samples, batches of 16)."""
    common = ["--max_train_steps", 10, "--max_train_samples", 48, "--gradient_accumulation_steps", accumulation]
    run_recipe(recipe, tmp_path / "full", *common, "--checkpointing_steps", 3)
    checkpoint = tmp_path / "full" / "checkpoints" / "step_00000006"
    assert (checkpoint / "trainer_state.json").exists()
    run_recipe(recipe, tmp_path / "resumed", *common, "--resume_from_checkpoint", checkpoint)
    diff = max_param_diff(load_params(tmp_path / "full"), load_params(tmp_path / "resumed"))
    print(f"{recipe}: resumed at step 6 of 10 vs uninterrupted: max abs param diff {diff:.2e}")
    assert diff == 0.0


def test_resume_latest_picks_newest_complete_checkpoint(tmp_path):
    run_recipe("baseline", tmp_path, "--max_train_steps", 4, "--checkpointing_steps", 2, "--no_save_model")
    (tmp_path / "checkpoints" / ".tmp_step_00000009").mkdir()  # a save that was cut off
    r = run_recipe("baseline", tmp_path, "--max_train_steps", 6, "--resume_from_checkpoint", "latest",
                   "--no_save_model")
    assert r["resumed_from_step"] == 4


@pytest.mark.slow
def test_gpu_config_runs_as_gloo_ddp_without_gpus(tmp_path):
    """multi_gpu.yaml unchanged on a CPU-only machine: real 2-process DDP over gloo, replicas in sync."""
    r = launch("baseline", tmp_path, "--max_train_steps", 3, "--no_save_model", config="multi_gpu.yaml",
               launch_args=("--num_processes", "2"))
    assert (r["distributed_type"], r["num_processes"]) == ("MULTI_CPU", 2)
    assert r["param_fingerprint"][0] == r["param_fingerprint"][1]
