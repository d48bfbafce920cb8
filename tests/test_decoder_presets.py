"""The decoder presets (tiny-llama, tiny-moe, and tiny-qwen2, tiny-qwen3-moe, tiny-mistral as checkpoints ship) in
every recipe: the committed table (benchmarks/decoder_presets.py,
docs/results/decoder_presets.md) covers each recipe that serves a causal LM, every cell trained or refused by the rule
table in the words the table gives today; a mixture of experts' router loss is part of the loss the recipes train on."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from shared.core.models import preset_config
from shared.core.tasks import Task
from shared.tools.catalogue import recipes_support
from tests.conftest import ROOT, load_recipe, run_recipe

sys.path.insert(0, str(ROOT / "benchmarks"))
import decoder_presets  # noqa: E402  (benchmarks/ is no package)

COMMITTED = ROOT / "docs" / "results" / "decoder_presets.json"
TINY = ["--max_train_samples", 16, "--max_eval_samples", 4, "--per_device_train_batch_size", 4,
        "--per_device_eval_batch_size", 4, "--max_seq_length", 32, "--no_save_model"]


def test_every_causal_lm_recipe_trains_the_decoder_presets_or_the_rule_table_refuses_them():
    rows = json.loads(COMMITTED.read_text())["rows"]
    cells = {(r["recipe"], r["task"], r["preset"]): r for r in rows}
    # Every recipe but the ones reworked elsewhere (decoder_presets.SKIPPED) serves a causal LM.
    for recipe in set(recipes_support()) - set(decoder_presets.SKIPPED):
        for task, preset in decoder_presets.CELLS:  # the shipped-shape presets too (bf16, tied, router off, window)
            if (recipe, task, preset) != ("ptq", "text-classification", "tiny-moe"):
                assert (recipe, task, preset) in cells, f"{recipe} x {task} {preset}: not in {COMMITTED.name}"
    crashed = [f"{r['name']}: {r.get('detail')}" for r in rows if r["status"] != "trained" and r["status"] != "refused"]
    assert not crashed, crashed
    for r in rows:
        if r["status"] == "refused":  # the table still refuses that run, in the same words: the doc cannot drift
            run = r["refused_by"]["run"]
            if r["refused_by"]["via"] == "refusals":  # check() before loading: the cell's own run
                assert (run["recipe"], run["task"], run["preset"]) == (r["recipe"], r["task"], r["preset"]), r["name"]
            assert decoder_presets.refusal_of(r["refused_by"]) == r["detail"], r["name"]
            assert "Fix: " in r["detail"]
        elif r["recipe"] != "ptq":  # trained the model asked for; a mixture of experts with its router's loss
            assert r["model_type"] == decoder_presets.PRESET_OF[r["preset"]], r["name"]
            assert (r["router_aux_loss"] is not None) == (r["preset"] in decoder_presets.MOE), r["name"]
        if r["status"] == "trained":  # every cell saved its model as a user's run does, and it loaded back whole
            assert "--no_save_model" not in r["command"], r["name"]
            assert r["saved"] in ("model", "adapter", "quantized model"), r["name"]
    assert sum(r["status"] == "trained" for r in rows) >= len(rows) // 2


def test_the_router_loss_is_in_the_loss_a_recipe_trains_on(tmp_path, monkeypatch):
    """tiny-moe through recipes/baseline.py: the loss of the first step with the preset's router_aux_loss_coef
    (0.02) minus the loss of the same first step (same weights, same batch) with the coefficient 0 is exactly
    0.02 x the router's load-balancing loss the run reports."""
    trained = run_recipe("baseline", tmp_path / "a", "--task", "causal-lm", "--model_preset", "tiny-moe",
                         "--max_train_steps", 2, *TINY)
    assert trained["model_type"] == "mixtral" and trained["router_aux_loss"] > 1.0  # top-2 of 4: 2 when balanced
    from shared.tasks import decoder_presets

    monkeypatch.setitem(decoder_presets._TINY_MOE, "router_aux_loss_coef", 0.0)
    plain = run_recipe("baseline", tmp_path / "b", "--task", "causal-lm", "--model_preset", "tiny-moe",
                       "--max_train_steps", 1, *TINY)
    # One step: the aux loss it reports is the first step's, the same in both runs.
    added = trained["initial_loss"] - plain["initial_loss"]
    assert added == pytest.approx(0.02 * plain["router_aux_loss"], rel=1e-4), (added, plain["router_aux_loss"])


@pytest.mark.parametrize("loss", ["chunked", "sequence_parallel"])
def test_losses_outside_task_loss_add_the_router_loss_as_task_loss_does(loss):
    """The chunked loss and the sequence-parallel chunk's loss compute their cross-entropy themselves: on a mixture of
    experts they add Task.router_loss, giving Task.loss's value and gradients (one process: one whole chunk)."""
    from transformers import AutoModelForCausalLM

    from shared.techniques import ulysses as sp
    from shared.techniques.chunked_loss import ChunkedLoss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("causal-lm", "tiny-moe", vocab_size=97))
    ids = torch.randint(0, 97, (2, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    task = Task("causal-lm", model, "tiny-moe", None, None, "random")
    num_items = task.count_items(batch)

    def value_and_grads(fn):
        model.zero_grad(set_to_none=True)
        value = fn()
        value.backward()
        return value.item(), {n: p.grad.clone() for n, p in model.named_parameters()}

    expected, expected_grads = value_and_grads(lambda: task.loss(model, batch, num_items))
    if loss == "chunked":
        got, grads = value_and_grads(lambda: ChunkedLoss(7, 32, task=task)(model, batch, num_items))
        with pytest.raises(ValueError, match="router aux_loss"):  # without the task it would drop the router's loss
            ChunkedLoss(7, 32)(model, batch, num_items)
    else:
        got, grads = value_and_grads(lambda: sp.loss(model, sp.shard(batch, 0, 1), num_items, task))
    without_router = expected - task.model.config.router_aux_loss_coef * task.router_aux_loss.item()
    assert got == pytest.approx(expected, abs=1e-5) and abs(got - without_router) > 1e-3
    assert max((grads[n] - expected_grads[n]).abs().max().item() for n in grads) < 1e-5


def test_head_pruning_drops_whole_key_value_groups_of_grouped_query_attention():
    """tiny-llama: 4 query heads share 2 key/value heads. A pruned unit is a key/value head with its 2 query heads,
    never half a head."""
    from transformers import AutoModelForCausalLM

    pruning = load_recipe("pruning")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("causal-lm", "tiny-llama", vocab_size=97))
    targets = pruning.prunable(model, "heads")
    masks = dict(zip((name for name, _, _ in targets), pruning.head_masks(model, targets, 0.5, "layer"), strict=True))
    head_dim = 64 // 4
    for block in ("0", "1"):
        q = masks[f"{block}.self_attn.q_proj"].reshape(2, 2 * head_dim, 64)  # [kv group, its query rows, in]
        for name in ("k_proj", "v_proj"):
            kv = masks[f"{block}.self_attn.{name}"].reshape(2, head_dim, 64)
            for group in range(2):  # each group pruned whole (query and key/value rows alike) or kept whole
                assert q[group].unique().numel() == 1 and kv[group].unique().tolist() == q[group].unique().tolist()
        assert sorted(q[g].max().item() for g in range(2)) == [0.0, 1.0]  # 0.5 of 2 groups: one pruned
