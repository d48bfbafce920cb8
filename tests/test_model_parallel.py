"""Model parallel in one process: blocks placed per stage, activations moved between stages by hooks. This machine
has no GPUs, so every stage sits on the CPU (the recipe says so); the split, the hooks and the bookkeeping run."""

import copy

import pytest
import torch

from shared.core.models import transformer_layers
from shared.techniques.pipeline_stages import split_layers
from tests.conftest import load_params, load_recipe, max_param_diff, run_recipe
from tests.parallel_runs import COMMON, single
from tests.test_pipeline_parallel import _model_and_batch


@pytest.mark.parametrize("task", ["causal-lm", "text-classification", "image-classification"])
def test_split_model_gives_the_unsplit_loss_and_gradients(task):
    recipe = load_recipe("model_parallel")
    model, x, kw, labels = _model_and_batch(task)
    key = "pixel_values" if task == "image-classification" else "input_ids"
    whole = copy.deepcopy(model)
    ranges = split_layers(3, 2, "2,1")
    recipe.place_stages(model, ranges, recipe.stage_devices(2))
    blocks = transformer_layers(model)
    assert all(len(b._forward_pre_hooks) == 1 for b in blocks)  # each block moves its inputs to its device
    losses = []
    for m in (whole, model):
        out = m(**{key: x}, **kw).logits
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), labels.reshape(-1))
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    grads = {n: p.grad for n, p in model.named_parameters()}
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in whole.named_parameters())
    assert diff == 0.0  # the same ops on the same device: exactly equal


def test_trains_like_the_unsplit_model(tmp_path_factory, tmp_path):
    ref_dir, ref = single(tmp_path_factory)
    r = run_recipe("model_parallel", tmp_path, *COMMON, "--per_device_train_batch_size", "16",
                   "--num_stages", "2", "--layers_per_stage", "1,1")
    assert r["num_processes"] == 1 and r["stages_on_cpu"] is True and r["stage_devices"] == ["cpu", "cpu"]
    assert r["stage_layers"] == [[0, 1], [1, 2]]
    assert sum(r["stage_param_count"]) == sum(t.numel() for t in load_params(ref_dir).values())
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-6)
    diff = max_param_diff(load_params(ref_dir), load_params(tmp_path))
    print(f"param diff: model parallel vs unsplit after 6 steps = {diff:.2e}")
    assert diff <= 1e-5  # measured 0.0 (the same ops on the same device); the bound allows for summation order


def test_trains_text_classification_with_an_uneven_split(tmp_path):
    r = run_recipe("model_parallel", tmp_path, "--task", "text-classification", "--max_train_steps", "12",
                   "--max_train_samples", "192", "--max_eval_samples", "32", "--learning_rate", "3e-3",
                   "--logging_steps", "4", "--no_save_model", "--num_stages", "2")
    assert r["train_loss"] < r["initial_loss"], r
    assert len(r["stage_param_count"]) == 2 and r["stage_param_count"][0] > r["stage_param_count"][1]  # embeddings


def test_bad_layer_split_fails_before_training(tmp_path):
    with pytest.raises(SystemExit, match="--layers_per_stage '3,3' must give 2 stages"):
        run_recipe("model_parallel", tmp_path, "--layers_per_stage", "3,3")
