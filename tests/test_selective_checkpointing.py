"""Per-layer (--checkpoint_every K) and op-level (--checkpointing_policy selective) activation checkpointing: the
gradients equal those without checkpointing for every K, the bytes kept for backward fall as more blocks are
checkpointed, selective keeps more than full and less than none, and the planner predicts each setting's bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.core.models import AUTO_CLASSES, preset_config, transformer_layers
from shared.techniques.probes import forward_kept_bytes
from shared.tools import plan
from tests.conftest import load_recipe, run_recipe

LAYERS, BATCH, SEQ = 4, 4, 32
RECIPE = load_recipe("activation_checkpointing")


def _model_and_batch(task: str, layers: int | None = LAYERS):
    """A tiny fp32 model of the family (`layers` blocks; None: the preset's), dropout off, and one batch."""
    cfg = preset_config(task, "tiny", vocab_size=1000)
    if layers:
        cfg.update({"n_layer": layers} if task == "causal-lm" else {"num_hidden_layers": layers})
    for key, value in cfg.to_dict().items():  # fp32, dropout off: equal gradients up to rounding
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    model = AUTO_CLASSES[task].from_config(cfg).train()
    if task == "image-classification":
        inputs = {"pixel_values": torch.randn(BATCH, 3, cfg.image_size, cfg.image_size)}
        labels = torch.randint(0, 2, (BATCH,))
    else:
        ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids if task == "causal-lm" else torch.randint(0, 2, (BATCH,))
        if task == "causal-lm":
            inputs["use_cache"] = False  # as shared/core/tasks.py does in training
    return cfg, model, inputs, labels


def _step(model, task, inputs, labels) -> tuple[int, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with forward_kept_bytes(model, inputs) as kept:
        logits = model(**inputs).logits
        if task == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    loss.backward()
    return kept["bytes"], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("task", ["causal-lm", "text-classification", "image-classification"])
def test_every_k_and_selective_keep_gradients_and_order_the_bytes(task):
    cfg, model, inputs, labels = _model_and_batch(task)
    none_bytes, reference = _step(model, task, inputs, labels)
    spec = plan.model_spec(cfg, task, "test")
    seq = None if task == "image-classification" else SEQ
    predicted_none = plan.activation_bytes(spec, BATCH, seq, "fp32", False, kernels="cpu").saved
    kept = {}
    for every, policy in [*((k, "full") for k in range(LAYERS, 0, -1)), (1, "selective"), (2, "selective")]:
        RECIPE.enable_checkpointing(model, "torch", every, policy)
        wrapped = sum(isinstance(b, RECIPE.CheckpointedBlock) for b in transformer_layers(model))
        assert wrapped == LAYERS // every
        kept[every, policy], grads = _step(model, task, inputs, labels)
        RECIPE.disable_checkpointing(model, "torch")
        diff = max((a - b).abs().max().item() for a, b in zip(reference, grads, strict=True))
        assert diff <= 1e-6, f"{policy} every {every}: gradients differ by {diff}"
        # The planner's per-block model: the bytes a setting saves against none, as measured, within 1%.
        predicted = plan.activation_bytes(spec, BATCH, seq, "fp32", True, kernels="cpu", checkpoint_every=every,
                                          selective=policy == "selective").saved
        assert predicted_none - predicted == pytest.approx(none_bytes - kept[every, policy], rel=0.01)
    assert not any(isinstance(b, RECIPE.CheckpointedBlock) for b in transformer_layers(model)), "unwrapped again"
    full = [kept[k, "full"] for k in range(LAYERS, 0, -1)]  # 1, 1, 2, 4 blocks checkpointed
    print(f"{task}: none {none_bytes:,} B; full K={LAYERS}..1 {full}; selective {kept[1, 'selective']:,} B")
    assert none_bytes > full[0] and all(a >= b for a, b in zip(full, full[1:], strict=False)), "fewer bytes"
    assert full[1] > full[2] > full[3]  # strictly wherever the number of checkpointed blocks grows
    assert kept[1, "full"] < kept[1, "selective"] < kept[2, "selective"] < none_bytes


def test_least_recompute_picks_the_cheapest_setting_that_fits():
    config, task, _ = plan.load_config(None, "base", "causal-lm", None, None)
    spec = plan.model_spec(config, task, "base", disable_dropout=True)
    options = plan.recompute_options(spec, 8, 512, "bf16")
    assert [o.recompute for o in options] == sorted(o.recompute for o in options)
    assert options[0].every == 0 and options[-1] == plan.Recompute(1, False, options[-1].activations, 1.0)
    assert any(o.selective for o in options)
    # every = 12 checkpoints only the last block, recomputed while all others still hold theirs: no lower peak, so
    # it is no option; each option recomputes more than the one before only to save memory
    assert all(o.every != spec.layers for o in options) and options[1].every == spec.layers // 2
    assert all(b.activations < a.activations for a, b in zip(options, options[1:], strict=False))
    assert plan.least_recompute(spec, 8, 512, options[0].activations, "bf16").every == 0
    assert plan.least_recompute(spec, 8, 512, options[-1].activations - 1, "bf16") is None
    for o in options[1:]:
        chosen = plan.least_recompute(spec, 8, 512, o.activations, "bf16")
        # the least recompute whose activations fit: never more recompute than o, and every cheaper one is too big
        assert chosen.recompute <= o.recompute
        assert all(p.activations > o.activations for p in options if p.recompute < chosen.recompute)
    assert plan.Recompute(3, True, 0.0, 0.3).flags == ("--checkpoint_every", "3", "--checkpointing_policy",
                                                       "selective")


def test_recipe_reports_the_setting_and_refuses_hf_with_it(tmp_path):
    r = run_recipe("activation_checkpointing", tmp_path, "--task", "causal-lm", "--checkpoint_every", 2,
                   "--checkpointing_policy", "selective", "--max_train_steps", 2, "--no_save_model")
    assert (r["checkpointing_impl"], r["checkpoint_every"], r["checkpointing_policy"]) == ("torch", 2, "selective")
    assert r["max_abs_grad_diff_vs_no_checkpointing"] <= 1e-6
    assert r["forward_kept_bytes_with_checkpointing"] < r["forward_kept_bytes_without_checkpointing"]
    with pytest.raises(SystemExit, match="need --checkpointing_impl torch"):
        run_recipe("activation_checkpointing", tmp_path / "hf", "--checkpointing_impl", "hf",
                   "--checkpointing_policy", "selective", "--max_train_steps", 1)
    with pytest.raises(SystemExit, match="Pass --checkpoint_every 2 or less"):
        run_recipe("activation_checkpointing", tmp_path / "k3", "--checkpoint_every", 3, "--max_train_steps", 1)
