"""Every foundation recipe trains every task on the built-in data, and results.json keeps its contract."""

import pytest
from transformers import AutoConfig

# The results.json fields every recipe writes (shared/core/results.py).
REQUIRED_FIELDS = (
    "recipe", "task", "model", "num_processes", "mixed_precision", "distributed_type", "train_loss",
    "train_samples_per_second", "train_tokens_per_second", "peak_memory_bytes", "param_bytes", "grad_bytes",
    "optimizer_state_bytes",
)
from tests.conftest import run_recipe

RECIPES = ["baseline", "mixed_precision", "gradient_accumulation", "activation_checkpointing"]
TASKS = ["text-classification", "causal-lm", "image-classification"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_task(recipe, task, tmp_path):
    steps = ["--max_train_steps", 40]
    if recipe == "gradient_accumulation":
        steps = ["--max_train_steps", 25, "--gradient_accumulation_steps", 2]
    r = run_recipe(recipe, tmp_path, "--task", task, *steps, "--learning_rate", "3e-3",
                   "--logging_steps", 5, "--max_eval_samples", 64)
    for field in REQUIRED_FIELDS:
        assert r[field] is not None, f"results.json lacks {field}"
    assert (r["task"], r["num_processes"], r["distributed_type"]) == (task, 1, "NO")
    for field in ("peak_memory_bytes", "param_bytes", "grad_bytes", "optimizer_state_bytes"):
        assert len(r[field]) == 1 and r[field][0] > 0, field
    # AdamW keeps two fp32 moments per trainable parameter: exactly twice the fp32 parameter bytes (+ step counts).
    assert 2 * r["param_bytes"][0] <= r["optimizer_state_bytes"][0] <= 2 * r["param_bytes"][0] + 8 * 200
    assert r["grad_bytes"][0] == r["param_bytes"][0]
    assert r["train_loss"] < 0.9 * r["initial_loss"], f"loss did not fall: {r['initial_loss']} -> {r['train_loss']}"
    assert r["train_samples_per_second"] > 0 and r["train_tokens_per_second"] > r["train_samples_per_second"]
    if task == "causal-lm":
        assert r["eval_perplexity"] > 1
    else:
        assert 0 <= r["eval_accuracy"] <= 1
    fp16 = recipe == "mixed_precision"  # its default
    assert (r["compute_dtype"], r["mixed_precision"]) == (("float16", "fp16") if fp16 else ("float32", "no"))
    config = AutoConfig.from_pretrained(tmp_path)  # the saved model is a loadable HF directory in safetensors
    assert (tmp_path / "model.safetensors").exists() and config.model_type in ("bert", "gpt2", "vit")


def test_default_data_is_learnable(tmp_path):
    """The built-in data teaches something real: accuracy far above chance after a short run."""
    r = run_recipe("baseline", tmp_path, "--max_train_steps", 120, "--no_save_model")
    assert r["eval_accuracy"] >= 0.9, r["eval_accuracy"]
    r = run_recipe("baseline", tmp_path / "lm", "--task", "causal-lm", "--max_train_steps", 120, "--no_save_model",
                   "--learning_rate", "3e-3")
    assert r["eval_perplexity"] < 8, r["eval_perplexity"]  # chance is the vocabulary, about 60 words
