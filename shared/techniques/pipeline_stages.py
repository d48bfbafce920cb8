"""Cutting a model into pipeline stages: which blocks each stage runs, and each family's stage forward.

A stage keeps only its own parameters: the other stages' blocks, and the embeddings or head it does not run, are
replaced by empty modules, so parameter names stay those of the whole model (a stage saves under the model's names).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core import rules
from ..core.checkpoint import STAGE_FILES
from ..core.losses import summed_loss as summed_loss  # the last stage's loss_fn: the spine's own
from ..core.models import transformer_layers

# model_type -> (modules the first stage runs before the blocks, modules the last stage runs after them)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt2": (("transformer.wte", "transformer.wpe", "transformer.drop"), ("transformer.ln_f", "lm_head")),
    "bert": (("bert.embeddings",), ("bert.pooler", "dropout", "classifier")),
    "vit": (("vit.embeddings",), ("vit.layernorm", "classifier")),
}


def split_layers(num_layers: int, num_stages: int, layers_per_stage: str | None = None) -> list[range]:
    """Block indices per stage: an explicit comma-separated count per stage ("1,3"), or an even split."""
    if layers_per_stage:
        try:
            counts = [int(c) for c in layers_per_stage.split(",")]
        except ValueError:
            raise SystemExit(f"--layers_per_stage {layers_per_stage!r}: pass integers, e.g. 1,3.") from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise SystemExit(f"--layers_per_stage {layers_per_stage!r} must give {num_stages} stages of at least one "
                             f"block each, {num_layers} blocks in all (the model has {num_layers}).")
    else:
        rules.check_built(layers=num_layers, stages=num_stages)  # shared/core/rules.py: at least a block a stage
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts, strict=True)]


def family_of(model: nn.Module) -> str:
    kind = model.config.model_type
    rules.check_built(model_type=kind, stage_families=tuple(FAMILIES))  # shared/core/rules.py
    return kind


class Stage(nn.Module):
    """One pipeline stage of a GPT-2, BERT or ViT model: [embeddings] + its blocks + [final norm and head]."""

    def __init__(self, model: nn.Module, layers: range, is_first: bool, is_last: bool):
        super().__init__()
        self.kind = family_of(model)
        self.layers, self.is_first, self.is_last = layers, is_first, is_last
        first_modules, last_modules = FAMILIES[self.kind]
        blocks = transformer_layers(model)
        for i in range(len(blocks)):
            if i not in layers:
                blocks[i] = nn.Identity()
        for name in (() if is_first else first_modules) + (() if is_last else last_modules):
            model.set_submodule(name, nn.Identity())
        self.model = model
        self.blocks = blocks

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        m, cfg = self.model, self.model.config
        if self.kind == "gpt2":
            from transformers.masking_utils import create_causal_mask

            t = m.transformer
            pos = torch.arange(attention_mask.shape[1], device=attention_mask.device).unsqueeze(0)
            h = t.drop(t.wte(x) + t.wpe(pos)) if self.is_first else x
            mask = create_causal_mask(config=cfg, inputs_embeds=h, attention_mask=attention_mask, cache=None,
                                      position_ids=pos)
            for i in self.layers:
                h = self.blocks[i](h, None, mask, None, use_cache=False, position_ids=pos)
            return m.lm_head(t.ln_f(h)) if self.is_last else h
        if self.kind == "bert":
            b = m.bert
            h = b.embeddings(input_ids=x) if self.is_first else x
            mask, _ = b._create_attention_masks(attention_mask=attention_mask, encoder_attention_mask=None,
                                                embedding_output=h, encoder_hidden_states=None, cache=None)
            for i in self.layers:
                h = self.blocks[i](h, mask, None)
            return m.classifier(m.dropout(b.pooler(h))) if self.is_last else h
        v = m.vit
        h = v.embeddings(x) if self.is_first else x
        for i in self.layers:
            h = self.blocks[i](h)
        return m.classifier(v.layernorm(h)[:, 0, :]) if self.is_last else h


def tied_weight(stage: Stage) -> nn.Parameter | None:
    """GPT-2 ties lm_head to the token embedding: the first and last stages each hold a copy of that one weight."""
    if stage.kind != "gpt2" or not stage.model.config.tie_word_embeddings or stage.is_first == stage.is_last:
        return None
    return stage.model.transformer.wte.weight if stage.is_first else stage.model.lm_head.weight


def stage_inputs(batch: dict) -> tuple[torch.Tensor, dict]:
    """What the first stage takes as its input, and what every stage takes beside it (the padding mask)."""
    x = batch["pixel_values"] if "pixel_values" in batch else batch["input_ids"]
    return x, ({"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {})


def pad_to_length(collate: Callable | None, length: int, pad_id: int) -> Callable:
    """A collate function whose text batches are padded to `length`: pipeline stages send fixed-shape tensors."""
    from torch.utils.data import default_collate

    fill = {"input_ids": pad_id, "attention_mask": 0, "token_type_ids": 0, "labels": -100}

    def fn(features: list) -> dict:
        batch = (collate or default_collate)(features)
        for key, value in fill.items():
            t = batch.get(key)
            if t is not None and t.ndim == 2 and t.shape[1] < length:
                batch[key] = F.pad(t, (0, length - t.shape[1]), value=value)
        return batch

    return fn


def clip_global_grad_norm(stage: Stage, max_norm: float, group=None, skip: torch.Tensor | None = None) -> float:
    """torch's clip_grad_norm_ over the whole model, whose stages sit in the processes of `group`: each stage sums
    its squares and the sum is all-reduced. A tied copy (`skip`) counts once. Returns the norm before clipping;
    max_norm 0 only measures it."""
    import torch.distributed as dist

    grads = [p.grad for p in stage.parameters() if p.grad is not None and p is not skip]
    sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(sq, group=group)
    if max_norm:
        coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for p in stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return sq.sqrt().item()


@torch.no_grad()
def evaluate(task, schedule, stage: Stage, eval_dataloader, item_count: dict, last_rank: int, pp_group=None,
             dp_group=None) -> dict[str, float]:
    """Forward-only through the pipeline; the last stage scores (summed over replicas with dp_group) and sends the
    figures to every stage. Accuracy, or token-weighted loss and perplexity for a causal LM."""
    import math

    import torch.distributed as dist

    stage.eval()
    device = next(stage.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    item_count["n"] = 1.0  # summed losses
    for batch in eval_dataloader:
        x, mask = stage_inputs(batch)
        if stage.is_first:
            schedule.eval(x, **mask)
        elif stage.is_last:
            losses: list[torch.Tensor] = []
            logits = schedule.eval(**mask, target=batch["labels"], losses=losses)
            if task.name == "causal-lm":
                score, count = torch.stack(losses).sum().item(), task.count_items(batch).item()
            else:
                score, count = (logits.argmax(-1) == batch["labels"]).sum().item(), batch["labels"].numel()
            total += torch.tensor([score, count], dtype=torch.float64, device=device)
        else:
            schedule.eval(**mask)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    dist.broadcast(total, src=last_rank, group=pp_group)
    stage.train()
    mean = (total[0] / total[1].clamp(min=1)).item()
    if task.name == "causal-lm":
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0))}
    return {"eval_accuracy": mean}


def save_stage_shards(accelerator, output_dir: str, task, stage: Stage, stage_index: int, num_stages: int,
                      tied: torch.Tensor | None, write: bool = True) -> None:
    """Each stage writes its parameters as one shard of a Hugging Face sharded checkpoint (model-0000k-of-0000n +
    index): from_pretrained loads the whole model, and no process ever gathers it. `write`: this process's
    replica is the one that saves. A collective: every process calls it."""
    import json
    from pathlib import Path

    from accelerate.utils import gather_object
    from safetensors.torch import save_file

    out = Path(output_dir)
    entry = None
    if write:
        out.mkdir(parents=True, exist_ok=True)
        shard = f"model-{stage_index + 1:05d}-of-{num_stages:05d}.safetensors"
        state = {k: v.detach().cpu().contiguous() for k, v in stage.model.state_dict().items()
                 if not (tied is not None and stage.is_last and v.data_ptr() == tied.data_ptr())}  # tied: once
        save_file(state, str(out / shard), metadata={"format": "pt"})
        entry = (shard, sorted(state))
    entries = [e for e in gather_object([entry]) if e is not None]
    if accelerator.is_main_process:
        weight_map = {name: shard for shard, names in entries for name in names}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        task.model.config.save_pretrained(output_dir)
        task.save_preprocessing(output_dir)
    accelerator.wait_for_everyone()


def checkpoint_per_process(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make save_state/load_state save and restore this process's own model, optimizer and scheduler.

    For models that are not prepared, whose parameters differ per process (a pipeline stage): Accelerate's
    register_for_checkpointing saves from the main process only, so every other stage would be lost. These hooks run
    on every process inside save_state/load_state and use <checkpoint>/rank_<process index>/. Accelerate still saves
    and restores each process's RNG states, and save_checkpoint's manifest covers the rank directories.
    """
    from safetensors.torch import load_model, save_model

    def save_hook(_models: list, _weights: list, output_dir: str) -> None:
        own = Path(output_dir) / f"rank_{accelerator.process_index:05d}"
        own.mkdir(parents=True, exist_ok=True)
        save_model(model, str(own / STAGE_FILES[0]))  # safetensors: drops a tensor's second name if shared
        torch.save(optimizer.state_dict(), own / STAGE_FILES[1])
        torch.save(scheduler.state_dict(), own / STAGE_FILES[2])

    def load_hook(_models: list, input_dir: str) -> None:
        saved = len(list(Path(input_dir).glob("rank_*")))
        own = Path(input_dir) / f"rank_{accelerator.process_index:05d}"
        if saved != accelerator.num_processes or not own.is_dir():
            raise SystemExit(f"{input_dir} holds the state of {saved} processes (one rank_* directory each), and "
                             f"this run has {accelerator.num_processes}: each process resumes its own pipeline stage. "
                             f"Resume with --num_processes {saved} and the same --pipeline_stages/--layers_per_stage "
                             "as the run that saved it.")
        device = accelerator.device
        location = "cpu" if device.type == "cpu" else str(device)  # safetensors refuses "cpu:0"
        try:
            load_model(model, str(own / STAGE_FILES[0]), strict=True, device=location)
        except RuntimeError as err:  # the same process count, another cut of the model
            found = " ".join(str(err).split()[5:])  # after "Error(s) in loading state_dict for Stage:"
            raise SystemExit(f"{own} holds another stage than this process's ({found[:200]} ...). Resume with the "
                             "same --pipeline_stages/--layers_per_stage as the run that saved it.") from None
        optimizer.load_state_dict(torch.load(own / STAGE_FILES[1], weights_only=True, map_location=location))
        scheduler.load_state_dict(torch.load(own / STAGE_FILES[2], weights_only=True, map_location=location))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
