"""Tied embeddings (the head's weight is the token embedding: Qwen2.5, Llama 3.2 1B/3B, Gemma) through the recipes
that shard or split the model: tensor parallel splits the one [vocab, hidden] matrix once, as the embedding and as
the head; FSDP2, ZeRO-3 and pipeline stages keep the tie through sharding, saving and resuming. Each saved model
reloads with from_pretrained as one tied weight, and the runs train what one process trains."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import launch, run_recipe
from tests.parallel_runs import COMMON
from tests.shipped_models import make_dir

STEPS = ("--max_train_steps", "4", "--max_seq_length", "32", "--max_train_samples", "128")
# fp32 AdamW at lr 3e-3 vs 1 process: the sharded sums round apart, and Adam's m/sqrt(v) magnifies that where v is
# tiny (tests/test_tensor_parallel.py measured 9.8e-6 on GPT-2 over 6 steps).
PARAM_TOL = 2e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tmp_path_factory.mktemp("shipped")


def reload(model_dir) -> tuple[dict[str, torch.Tensor], bool]:
    """The saved model's parameters as from_pretrained loads it in one process, and whether its head is tied."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, tied


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_tensor_parallel_splits_a_tied_embedding_and_head_as_one_weight(models, tmp_path):
    """Qwen2-style, tied: 2 processes by the model's own plan (the embedding split over the vocabulary, the head
    column-wise: both Shard(0) of the one weight) train what 1 process trains; the saved model reloads tied. Was
    KeyError: 'lm_head.weight' in transformers' apply_tensor_parallelism."""
    args = (*COMMON, *STEPS, "--per_device_train_batch_size", "16",
            "--model_name_or_path", make_dir(models, "qwen2-tied"))
    ref = run_recipe("baseline", tmp_path / "one", *args)
    r = launch("tensor_parallel", tmp_path / "tp", *args)
    assert r["tp_plan"]["model.embed_tokens"] == "embedding_rowwise" and r["tp_plan"]["lm_head"]
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-5)
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)
    (one, tied_one), (tp, tied_tp) = reload(tmp_path / "one"), reload(tmp_path / "tp")
    diff = max_diff(one, tp)
    print(f"tied Qwen2-style, TP 2 vs 1 process, 4 steps: loss {r['initial_loss']:.6f} / {ref['initial_loss']:.6f}, "
          f"max |param diff| {diff:.1e}")
    assert tied_one and tied_tp and diff <= 1e-5
    # the shared weight is held once, split: each process keeps half of it and of every block matrix
    counts = r["local_param_counts"]
    assert sum(c["sharded"] for c in counts) + counts[0]["replicated"] == sum(
        t.numel() for k, t in one.items() if k != "lm_head.weight")
    assert counts[0]["replicated"] == sum(t.numel() for k, t in one.items() if "norm" in k)  # norms alone whole


DEFAULT = {("fsdp", "llama-tied"), ("pipeline_parallel", "qwen2-tied")}  # the others: -m slow


@pytest.mark.parametrize("recipe, config, kind", [
    pytest.param(*c, marks=() if (c[0], c[2]) in DEFAULT else pytest.mark.slow) for c in [
        ("fsdp", "fsdp.yaml", "llama-tied"), ("zero", "zero3.yaml", "qwen2-tied"),
        ("pipeline_parallel", "pipeline.yaml", "llama-tied"), ("fsdp", "fsdp.yaml", "qwen2-tied"),
        ("zero", "zero3.yaml", "llama-tied"), ("pipeline_parallel", "pipeline.yaml", "qwen2-tied")]])
def test_sharded_recipes_keep_the_tie_through_saving_and_resuming(recipe, config, kind, models, tmp_path):
    """One launch of the recipe as a user runs it (the model saved, a checkpoint halfway): it trains what one
    process trains on the same global batch, and the model it saves reloads tied. Slow: a second launch resumes the
    halfway checkpoint to the same parameters, tied."""
    per_process = "16" if recipe == "pipeline_parallel" else "8"  # the global batch of 16 in every run
    args = (*COMMON, *STEPS, "--model_name_or_path", make_dir(models, kind), "--checkpointing_steps", "2")
    ref = run_recipe("baseline", tmp_path / "one", *args, "--per_device_train_batch_size", "16")
    r = launch(recipe, tmp_path / "run", *args, "--per_device_train_batch_size", per_process, config=config)
    assert r["num_processes"] == 2
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-5)
    # ZeRO: DeepSpeed's own AdamW step on its fp32 partitions (parameters 1.1e-5 and 2.0e-5 apart after 4 steps,
    # tied Qwen2- and Llama-style), which moves the evaluation loss by up to 9.5e-5
    zero = recipe == "zero"
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], abs=2e-4 if zero else 1e-5)
    (one, _), (run, tied) = reload(tmp_path / "one"), reload(tmp_path / "run")
    diff = max_diff(one, run)
    print(f"{recipe} [{config}] on tied {kind}: max |param diff| vs 1 process {diff:.1e}, reloaded tied: {tied}")
    assert tied and diff <= (1e-4 if zero else PARAM_TOL)
    if (recipe, kind) in DEFAULT:
        return
    step = "step_00000002"
    shutil.copytree(tmp_path / "run" / "checkpoints" / step, tmp_path / "resumed" / "checkpoints" / step)
    again = launch(recipe, tmp_path / "resumed", *args, "--per_device_train_batch_size", per_process,
                   "--resume_from_checkpoint", "latest", config=config)
    resumed, still_tied = reload(tmp_path / "resumed")
    assert again["resumed_from_step"] == 2 and still_tied and max_diff(run, resumed) <= 1e-6


@pytest.mark.slow
def test_tensor_parallel_resumes_a_tied_model_to_the_same_parameters(models, tmp_path):
    """Tensor parallel's DCP checkpoint of a tied Qwen2-style model (the one shared weight split once): a second
    launch from the halfway checkpoint ends at the same parameters as the uninterrupted run, and reloads tied."""
    args = (*COMMON, *STEPS, "--per_device_train_batch_size", "16", "--checkpointing_steps", "2",
            "--model_name_or_path", make_dir(models, "qwen2-tied"))
    run = launch("tensor_parallel", tmp_path / "tp", *args)
    step = "step_00000002"
    shutil.copytree(tmp_path / "tp" / "checkpoints" / step, tmp_path / "resumed" / "checkpoints" / step)
    again = launch("tensor_parallel", tmp_path / "resumed", *args, "--resume_from_checkpoint", "latest")
    (whole, _), (resumed, tied) = reload(tmp_path / "tp"), reload(tmp_path / "resumed")
    diff = max_diff(whole, resumed)
    print(f"TP 2 processes, tied Qwen2-style, resumed at step 2 of 4: max |param diff| {diff:.1e}, tied: {tied}")
    assert again["resumed_from_step"] == 2 and run["num_processes"] == 2
    assert tied and diff <= 1e-6
    assert again["eval_loss"] == pytest.approx(run["eval_loss"], abs=1e-6)
