"""One loss (shared/core/losses.py): Task.loss on the whole model, the pipeline's stages chained with the last stage's
loss function, and the sequence-parallel chunks (labels shifted over the whole sequence, then cut) give the same
summed-and-divided cross-entropy on the same batch, which is also the one Transformers' own models compute."""

from __future__ import annotations

import copy

import torch

from shared.core import losses
from shared.core.models import preset_config
from shared.core.tasks import Task
from shared.techniques import ulysses as sp
from shared.techniques.pipeline_stages import Stage, split_layers, summed_loss

REL_TOL = 1e-6  # fp32, the same weights and batch; measured at most ~1e-7 (summation order)
VOCAB, B, T = 50, 4, 12


def _no_dropout(cfg):
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    return cfg


def _causal_batch() -> dict[str, torch.Tensor]:
    """Right-padded rows (as CausalCollator pads) and a target masked mid-sequence: -100 in every place it occurs."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_task_pipeline_and_sequence_parallel_give_one_causal_lm_loss():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _no_dropout(preset_config("causal-lm", "tiny", vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))
    cfg.n_layer = 3
    model = AutoModelForCausalLM.from_config(cfg)
    batch = _causal_batch()
    task = Task("causal-lm", model, "tiny", None, None, "random")
    num_items = task.count_items(batch)
    assert num_items == int((batch["labels"][:, 1:] != -100).sum()) < B * (T - 1)

    # (a) what every recipe trains with
    whole = task.loss(model, batch, num_items)

    # (b) the pipeline: 2 stages chained in one process, 2 micro-batches, each loss over the whole batch's count
    stages = [Stage(copy.deepcopy(model), r, is_first=i == 0, is_last=i == 1)
              for i, r in enumerate(split_layers(3, 2, "1,2"))]
    loss_fn = summed_loss(task.name)
    assert loss_fn is losses.causal_lm_loss  # the last stage's loss is the spine's
    pipeline = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 4)):
        mask = batch["attention_mask"][rows]
        logits = stages[1](stages[0](batch["input_ids"][rows], attention_mask=mask), attention_mask=mask)
        pipeline = pipeline + loss_fn(logits, batch["labels"][rows]) / num_items

    # (c) sequence parallel: the labels shifted over the whole sequence, then cut in 2 chunks by position; each
    # chunk's plain sum (no further shift) on the whole model's logits at its positions
    world = 2
    chunks = [sp.shard(batch, rank, world) for rank in range(world)]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits  # no mask, as sp.loss runs it
    sums = [losses.summed_cross_entropy(logits[:, c["position_ids"][0]], c["shift_labels"]) for c in chunks]
    sequence_parallel = sum(sums) / num_items
    # the first chunk sees only itself under causal attention: ulysses.loss on it alone is its share of the sum
    first = sp.loss(model, chunks[0], num_items)
    assert _rel(first.item(), sums[0].item() / num_items.item()) <= REL_TOL
    # shifted inside each chunk instead, the target across the boundary is lost: a loss this test tells apart
    inside = sum(losses.causal_lm_loss(logits[:, c["position_ids"][0]], batch["labels"][:, c["position_ids"][0]])
                 for c in chunks) / num_items
    assert _rel(inside.item(), sequence_parallel.item()) > 100 * REL_TOL

    # Transformers' own causal-LM loss (mean over the target tokens) on the same batch
    reference = model(**batch, use_cache=False).loss
    values = {"task": whole.item(), "pipeline": pipeline.item(), "sequence_parallel": sequence_parallel.item()}
    diffs = {k: _rel(v, reference.item()) for k, v in values.items()}
    spread = max(values.values()) - min(values.values())
    print(f"causal-lm loss {reference.item():.7f}; rel diff to Transformers' loss {diffs}; "
          f"max |diff| of the three paths {spread:.1e}")
    assert max(diffs.values()) <= REL_TOL
    assert spread <= REL_TOL * abs(reference.item())


def test_task_and_pipeline_give_one_classification_loss():
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = _no_dropout(preset_config("text-classification", "tiny", vocab_size=VOCAB, num_labels=3))
    cfg.num_hidden_layers = 3
    model = AutoModelForSequenceClassification.from_config(cfg)
    batch = _causal_batch()
    batch["labels"] = torch.tensor([0, 2, 1, 2])
    task = Task("text-classification", model, "tiny", None, None, "random")
    assert task.count_items(batch) == B

    whole = task.loss(model, batch)  # default count: this batch's samples
    loss_fn = summed_loss(task.name)
    assert loss_fn is losses.classification_loss
    stages = [Stage(copy.deepcopy(model), r, is_first=i == 0, is_last=i == 1)
              for i, r in enumerate(split_layers(3, 2, "2,1"))]
    mask = batch["attention_mask"]
    pipeline = loss_fn(stages[1](stages[0](batch["input_ids"], attention_mask=mask), attention_mask=mask),
                       batch["labels"]) / B
    reference = model(**batch).loss  # Transformers' own: the mean cross-entropy over samples
    print(f"classification loss {reference.item():.7f}: task {whole.item():.7f}, pipeline {pipeline.item():.7f}")
    assert _rel(whole.item(), reference.item()) <= REL_TOL
    assert _rel(pipeline.item(), reference.item()) <= REL_TOL
