"""Cutting a model into pipeline stages: which blocks each stage runs, and each family's stage forward; which
stages each process holds under a schedule, and the schedule's bubble (the share of the processes' time spent idle).

A stage keeps only its own parameters: the other stages' blocks, and the embeddings or head it does not run, are
replaced by empty modules, so parameter names stay those of the whole model (a stage saves under the model's names).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core import rules
from ..core.args import DECODER_TASKS
from ..core.attention import SLIDING, attention_features, layer_attention_types
from ..core.errors import InputError, LaunchError
from ..core.losses import summed_loss as summed_loss  # the last stage's loss_fn: the spine's own
from ..core.models import transformer_layers
from ..core.optim import kept_apart
from ..core.rules import Rule

STAGE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt")  # in each rank_NNNNN/ of a per-process save


def stage_loss(task) -> Callable:
    """The last stage's summed loss of (logits, labels): the user's Task.loss_fn, or the task's cross-entropy."""
    task.refuse_hooks(("keep_columns", "compute_metrics"), "the pipeline's last stage sees the logits and labels "
                      "alone, and scores accuracy there. Drop them, or use recipes/baseline.py")
    if getattr(task, "generate", 0):  # sft's answers need the whole model, which no stage holds
        raise InputError("--generate: the pipeline's stages each hold part of the model, and greedy answers need "
                         "the whole of it. Drop --generate, and generate from the saved model (from_pretrained).")
    if task.loss_fn is None:
        return summed_loss(task.name)
    return lambda logits, labels: task.loss_fn(logits, labels, {})


# model_type -> (modules the first stage runs before the blocks, modules the last stage runs after them)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt2": (("transformer.wte", "transformer.wpe", "transformer.drop"), ("transformer.ln_f", "lm_head")),
    "bert": (("bert.embeddings",), ("bert.pooler", "dropout", "classifier")),
    "vit": (("vit.embeddings",), ("vit.layernorm", "classifier")),
    # Llama-style decoders: every stage keeps rotary_emb (no parameters), which gives each block its position_embeddings
    "llama": (("model.embed_tokens",), ("model.norm", "lm_head")),
}
# Decoders whose base model runs as Llama's (embeddings unscaled, each block given the rotary position_embeddings and
# its layer type's mask, then the norm and the head), run by the "llama" stage forward.
LLAMA_STYLE = ("llama", "qwen2", "qwen3", "mistral")
CARRIED = ("sliding window",)  # attention_features a stage keeps (each block gets its layer type's mask)


def split_layers(num_layers: int, num_stages: int, layers_per_stage: str | None = None,
                 stages_named: str = "") -> list[range]:
    """Block indices per stage: an explicit comma-separated count per stage ("1,3"), or an even split.
    `stages_named`: what set the stage count, for a refusal ("--schedule zbv: 2 stages on each of the 2 processes")."""
    if layers_per_stage:
        try:
            counts = [int(c) for c in layers_per_stage.split(",")]
        except ValueError:
            raise LaunchError(f"--layers_per_stage {layers_per_stage!r}: pass integers, e.g. 1,3.") from None
        if len(counts) != num_stages or sum(counts) != num_layers or min(counts) < 1:
            raise LaunchError(f"--layers_per_stage {layers_per_stage!r} must give {num_stages} stages of at least one "
                              f"block each, {num_layers} blocks in all (the model has {num_layers}).")
    else:
        # shared/core/rules.py: at least a block a stage
        rules.check_built(layers=num_layers, stages=num_stages, flags={"stages": stages_named} if stages_named else {})
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(s, s + c) for s, c in zip(starts, counts, strict=True)]


def family_of(model: nn.Module) -> str:
    """The FAMILIES entry whose stage forward runs this model; refuses (shared/core/rules.py) another family, or an
    attention or head feature a stage would drop (soft caps, sinks), named as its config gives it."""
    kind = model.config.model_type
    family = "llama" if kind in LLAMA_STYLE else kind
    if family in FAMILIES and not all(_has(model, name) for ends in FAMILIES[family] for name in ends):
        kind = f"{kind} ({type(model).__name__})"  # another head than the one written here (a Llama classifier)
    dropped = tuple(f for f in attention_features(model.config, model) if f not in CARRIED)
    rules.check_built(model_type=kind, stage_families=tuple(sorted({*FAMILIES, *LLAMA_STYLE})),  # rules.py
                      stage_drops=dropped)
    return family


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


class Stage(nn.Module):
    """One pipeline stage of a GPT-2, Llama, BERT or ViT model: [embeddings] + its blocks + [final norm and head]."""

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
        if self.kind == "llama":
            from transformers.masking_utils import create_causal_mask

            d = m.model
            h = d.embed_tokens(x) if self.is_first else x
            from transformers.masking_utils import create_sliding_window_causal_mask

            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            types = layer_attention_types(cfg)  # a sliding window (Mistral, Qwen2's) in its layers' masks
            masks = {kind: (create_sliding_window_causal_mask if kind == SLIDING else create_causal_mask)(
                config=cfg, inputs_embeds=h, attention_mask=attention_mask, cache=None, position_ids=pos)
                for kind in {types[i] for i in self.layers}}
            rotary = d.rotary_emb(h, position_ids=pos)  # (cos, sin): recomputed per stage, as cheap as sending it
            for i in self.layers:
                h = self.blocks[i](h, attention_mask=masks[types[i]], position_embeddings=rotary, position_ids=pos)
            return m.lm_head(d.norm(h)) if self.is_last else h
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


TIED = {"gpt2": ("transformer.wte", "lm_head"), "llama": ("model.embed_tokens", "lm_head")}  # embedding, head


def tied_weight(stage: Stage) -> nn.Parameter | None:
    """GPT-2 (and a Llama with tie_word_embeddings) ties lm_head to the token embedding: the first and last stages
    each hold a copy of that one weight."""
    if stage.kind not in TIED or not stage.model.config.tie_word_embeddings or stage.is_first == stage.is_last:
        return None
    return stage.model.get_submodule(TIED[stage.kind][0 if stage.is_first else 1]).weight


class Stages(nn.ModuleList):
    """The stages one process holds under a multi-stage schedule (2: interleaved or V-shaped), as one module for the
    optimizer, the checkpoint, the meter and evaluation. `indices`: their places in the pipeline."""

    def __init__(self, stages: Sequence[Stage], indices: Sequence[int]):
        super().__init__(stages)
        self.indices = list(indices)

    @property
    def is_first(self) -> bool:  # it holds the embeddings: it takes the batch's inputs
        return any(s.is_first for s in self)

    @property
    def is_last(self) -> bool:  # it holds the head: it takes the labels and computes the loss
        return any(s.is_last for s in self)


def stage_list(stage: Stage | Stages) -> list[Stage]:
    return list(stage) if isinstance(stage, Stages) else [stage]


VIRTUAL_STAGES = 2  # stages a process holds under a multi-stage schedule (ZBV and DualPipeV take exactly 2)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")  # the pipeline runs down the processes and back up


def stages_per_process(schedule_cls: type) -> int:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return 1 if issubclass(schedule_cls, PipelineScheduleSingle) else VIRTUAL_STAGES


def build_stages(model: nn.Module, owners: Mapping[int, Sequence[int]], rank: int, layers_per_stage: str | None = None,
                 flag: str = "") -> tuple[Stage | Stages, list[range]]:
    """This process's stages of `model` (owners: process_stages), and every stage's blocks (split_layers; `flag`
    names what set the stage count, for a refusal): one Stage, or Stages, each from its own copy of the model (the
    last takes the model itself)."""
    mine, num_stages = owners[rank], sum(map(len, owners.values()))
    named = f"{flag}: {len(mine)} stages on each of the {len(owners)} processes" if flag and len(mine) > 1 else ""
    layers = split_layers(len(transformer_layers(model)), num_stages, layers_per_stage, named)
    built = [Stage(model if k == len(mine) - 1 else copy.deepcopy(model), layers[i], is_first=i == 0,
                   is_last=i == num_stages - 1) for k, i in enumerate(mine)]
    return (built[0] if len(built) == 1 else Stages(built, mine)), layers


def schedule_order(schedule_cls: type, processes: int, n_microbatches: int) -> dict[int, list]:
    """Each process's actions under the schedule (its pipeline_order), made by torch's own schedule builder, which
    needs no process group. torch's ValueError for a micro-batch count the schedule cannot run."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    return dict(enumerate(get_schedule_ops(schedule_cls, processes, n_microbatches, stages_per_process(schedule_cls))))


def process_stages(schedule_cls: type, run: rules.Run) -> dict[int, list[int]]:
    """Process -> the pipeline stages it holds, read from the schedule's own action lists: one each, or 2 of 2P,
    interleaved r and r + P, V-shaped r and 2P - 1 - r (process 0 holds both ends). A micro-batch count the schedule
    cannot run is refused by the rule table (shared/core/rules.py), with the nearest counts it runs, before anything
    loads. `run`: the launch's rules.Run (its processes, --n_microbatches, flags)."""

    def runs(n: int) -> bool:
        try:
            return bool(schedule_order(schedule_cls, run.num_processes, n))
        except ValueError:
            return False

    try:
        order = schedule_order(schedule_cls, run.num_processes, run.microbatches)
    except ValueError as err:
        below = next((n for n in range(run.microbatches - 1, 0, -1) if runs(n)), None)
        above = next((n for n in range(run.microbatches + 1, run.microbatches + 8 * run.num_processes) if runs(n)),
                     None)
        rules.check(replace(run, schedule_refuses=str(err).rstrip("."),
                            schedule_takes=tuple(n for n in (below, above) if n is not None)))
        raise  # the table refuses it above
    return {rank: sorted({op.stage_index for a in filter(None, actions) for op in a.sub_actions or (a,)})
            for rank, actions in order.items()}


def bubble_fraction(order: Mapping[int, Sequence], stage_blocks: Sequence[int]) -> float:
    """The share of the processes' time a schedule leaves idle, from its action lists (torch's pipeline_order:
    process -> actions). Each process runs its computations in its list's order, each as soon as the process is free
    and its inputs exist: a stage's forward of a micro-batch after the stage before's, its backward after its own
    forward and the next stage's backward, a weight backward (W) after its input backward (I). A forward takes as
    long as the stage has blocks, I and W as long again, a whole backward (B) twice that; communication is free."""
    from collections import Counter, deque

    from torch.distributed.pipelining.schedules import _ComputationType as C

    kinds = {C.FORWARD: ("F", 1), C.BACKWARD_INPUT: ("B", 1), C.FULL_BACKWARD: ("B", 2), C.BACKWARD_WEIGHT: ("W", 1)}
    last, seen, queues = len(stage_blocks) - 1, Counter(), {}
    for rank, actions in order.items():
        ops = []
        for action in filter(None, actions):
            for op in action.sub_actions or (action,):  # DualPipeV's overlapped F+B: both, one after the other
                if op.computation_type in kinds:  # not the sends, receives and gradient reductions
                    kind, cost = kinds[op.computation_type]
                    # The k-th of a stage's forwards is micro-batch k: torch 2.13's Schedule1F1B order numbers its last
                    # stage's forwards from 1 (1F1 .. 1F4 for 4 micro-batches), though it runs them from 0.
                    ops.append((op.stage_index, kind, seen[op.stage_index, kind], cost * stage_blocks[op.stage_index]))
                    seen[op.stage_index, kind] += 1
        queues[rank] = deque(ops)
    done: dict[tuple[int, str, int], float] = {}
    clock, busy = dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0)
    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                stage, kind, mb, cost = queue[0]
                needs = {"F": [(stage - 1, "F", mb)] if stage else [],
                         "B": [(stage, "F", mb)] + ([(stage + 1, "B", mb)] if stage < last else []),
                         "W": [(stage, "B", mb)]}[kind]
                if any(d not in done for d in needs):
                    break
                clock[rank] = done[stage, kind, mb] = max([clock[rank], *(done[d] for d in needs)]) + cost
                busy[rank] += cost
                queue.popleft()
                progressed = True
        if not progressed:
            raise ValueError(f"the schedule's actions wait on each other: {dict((r, q[0]) for r, q in queues.items())}")
    return 1.0 - sum(busy.values()) / (len(clock) * max(clock.values()))


def bubble_report(schedule, layers: Sequence[range], processes: int, n_microbatches: int) -> dict[str, float | None]:
    """The run's bubble (bubble_fraction of its schedule's pipeline_order, the stages cut at `layers`) and 1F1B's
    on the same processes and micro-batches, the same blocks cut evenly into a stage a process (None: 1F1B cannot
    run that many micro-batches)."""
    from torch.distributed.pipelining import Schedule1F1B

    ours = bubble_fraction(schedule.pipeline_order, list(map(len, layers)))
    report: dict[str, float | None] = {"bubble_fraction": ours, "bubble_fraction_1f1b": None}
    try:
        order = schedule_order(Schedule1F1B, processes, n_microbatches)
    except ValueError:
        return report
    even = split_layers(sum(map(len, layers)), processes)
    return {**report, "bubble_fraction_1f1b": bubble_fraction(order, list(map(len, even)))}


def sum_tied_grads(tied: Sequence[torch.Tensor], group=None) -> None:
    """GPT-2's lm_head is its token embedding: the first and the last stage each hold a copy, and both take the sum
    of the two gradients. One process holds both under a V-shaped schedule; else each end holds one (`group`)."""
    import torch.distributed as dist

    if len(tied) == 2:
        tied[0].grad.add_(tied[1].grad)
        tied[1].grad.copy_(tied[0].grad)
    elif tied:
        dist.all_reduce(tied[0].grad, group=group)


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


def clip_global_grad_norm(stage: Stage | Stages, max_norm: float, group=None,
                          skip: torch.Tensor | None = None) -> float:
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
def evaluate(task, schedule, stage: Stage | Stages, eval_dataloader, item_count: dict, last_rank: int, pp_group=None,
             dp_group=None) -> dict[str, float]:
    """Forward-only through the pipeline; the last stage scores (summed over replicas with dp_group) and sends the
    figures to every stage. Accuracy, or token-weighted loss and perplexity for a causal LM."""
    import math

    import torch.distributed as dist

    run = schedule.eval
    if type(schedule).__name__ in V_SHAPED:
        # torch 2.13's eval() of a V-shaped schedule still walks its backward actions, and fails where a stage would
        # hand its input gradient to the process's other stage: these take the training step, gradients dropped.
        def run(*args, **kwargs):
            with torch.enable_grad():
                return schedule.step(*args, **kwargs)

    stage.eval()
    device = next(stage.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    item_count["n"] = 1.0  # summed losses
    for batch in eval_dataloader:
        x, mask = stage_inputs(batch)
        inputs = (x,) if stage.is_first else ()  # a V-shaped schedule's process 0 holds the first and the last stage
        if stage.is_last:
            losses: list[torch.Tensor] = []
            logits = run(*inputs, **mask, target=batch["labels"], losses=losses)
            if task.name in DECODER_TASKS or task.loss_fn is not None:  # the user's loss: its mean, eval_loss
                score, count = torch.stack(losses).sum().item(), task.count_items(batch).item()
            else:
                score, count = (logits.argmax(-1) == batch["labels"]).sum().item(), batch["labels"].numel()
            total += torch.tensor([score, count], dtype=torch.float64, device=device)
        else:
            run(*inputs, **mask)
    stage.zero_grad(set_to_none=True)  # none but a V-shaped schedule's
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    dist.broadcast(total, src=last_rank, group=pp_group)
    stage.train()
    mean = (total[0] / total[1].clamp(min=1)).item()
    if task.name in DECODER_TASKS:
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0))}
    return {"eval_loss" if task.loss_fn is not None else "eval_accuracy": mean}


def save_stage_shards(accelerator, output_dir: str, task, stage: Stage | Stages, stage_index: int | Sequence[int],
                      num_stages: int, tied: object, write: bool = True) -> None:
    """Each stage writes its parameters as one shard of a Hugging Face sharded checkpoint (model-0000k-of-0000n +
    index): from_pretrained loads the whole model, and no process ever gathers it. Stages: one shard per stage it
    holds, at the stage indices. `tied`: None, or the head is tied (the last stage leaves its copy out). `write`: this
    process's replica is the one that saves. A collective: every process calls it."""
    import json
    from pathlib import Path

    from accelerate.utils import gather_object
    from safetensors.torch import save_file

    out = Path(output_dir)
    entries = []
    indices = stage.indices if isinstance(stage, Stages) else [stage_index]
    for index, part in zip(indices if write else [], stage_list(stage), strict=False):
        out.mkdir(parents=True, exist_ok=True)
        shard = f"model-{index + 1:05d}-of-{num_stages:05d}.safetensors"
        head = tied_weight(part) if tied is not None and part.is_last else None
        state = {k: v.detach().cpu().contiguous() for k, v in part.model.state_dict().items()
                 if not (head is not None and v.data_ptr() == head.data_ptr())}  # tied: once
        save_file(state, str(out / shard), metadata={"format": "pt"})
        entries.append((shard, sorted(state)))
    entries = [e for process in gather_object([entries]) for e in process]
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

    kept_apart(accelerator, scheduler)  # the schedule results.json names, where none was prepared

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
            raise LaunchError(f"{input_dir} holds the state of {saved} processes (one rank_* directory each), and "
                              f"this run has {accelerator.num_processes}: each process resumes its own pipeline stage. "
                              f"Resume with --num_processes {saved} and the same --pipeline_stages/--layers_per_stage "
                              "as the run that saved it.")
        device = accelerator.device
        location = "cpu" if device.type == "cpu" else str(device)  # safetensors refuses "cpu:0"
        try:
            load_model(model, str(own / STAGE_FILES[0]), strict=True, device=location)
        except RuntimeError as err:  # the same process count, another cut of the model
            found = " ".join(str(err).split()[5:])  # after "Error(s) in loading state_dict for Stage:"
            raise LaunchError(f"{own} holds another stage than this process's ({found[:200]} ...). Resume with the "
                              "same --pipeline_stages/--layers_per_stage as the run that saved it.") from None
        optimizer.load_state_dict(torch.load(own / STAGE_FILES[1], weights_only=True, map_location=location))
        scheduler.load_state_dict(torch.load(own / STAGE_FILES[2], weights_only=True, map_location=location))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # Pipeline schedules (recipes/pipeline_parallel.py, data_model_parallel.py) split each batch into micro-batches.
    # A count the schedule itself cannot run (torch's schedule classes say which: recipes/pipeline_parallel.py asks).
    Rule(lambda r: r.microbatches > 0 and bool(r.batch_size % r.microbatches or r.schedule_refuses),
         lambda r: (f"--per_device_train_batch_size {r.batch_size} is not divisible by --n_microbatches "
                    f"{r.microbatches}: the schedule splits each batch into that many equal micro-batches")
         if r.batch_size % r.microbatches else (f"{r.flag('schedule')} cannot run --n_microbatches {r.microbatches} "
                                                f"on {r.num_processes} processes (torch: {r.schedule_refuses})"),
         lambda r: ("pick a batch size that is a multiple of it (e.g. --per_device_train_batch_size "
                    f"{r.microbatches * max(1, r.batch_size // r.microbatches)}), or fewer --n_microbatches")
         if r.batch_size % r.microbatches else (f"pass --n_microbatches {' or '.join(map(str, r.schedule_takes))} "
                                                "(and a --per_device_train_batch_size it divides)")),
    Rule(lambda r: r.microbatches > 0 and r.accumulation > 1,
         lambda r: f"--gradient_accumulation_steps {r.accumulation}: recipes/{r.recipe}.py's micro-batches already "
                   "accumulate (the schedule sums their gradients before each step)",
         lambda r: "drop the flag, and raise --n_microbatches and the batch size instead"),
    Rule(lambda r: r.stages_per_replica > 0 and (r.stages_per_replica < 2 or r.num_processes % r.stages_per_replica
                                                  or r.num_processes == r.stages_per_replica),
         lambda r: f"{r.num_processes} processes cannot form 2 or more replicas of "
                   f"{r.stages_per_replica} stages ({r.flag('stages_per_replica')} must be at least 2)",
         lambda r: f"launch a multiple of {r.stages_per_replica} processes (e.g. --num_processes "
                   f"{2 * max(r.stages_per_replica, 2)}), or use recipes/pipeline_parallel.py for one replica"),
    Rule(lambda r: bool(r.stage_drops),
         lambda r: f"The model's {', '.join(r.stage_drops)} (in its config or parameters): pipeline stages run the "
                   "blocks and the head themselves, with a causal mask per layer and no soft cap or sinks, so they "
                   "would train another model than the one loaded",
         lambda r: "use recipes/fsdp.py or recipes/zero.py (they run the model's own forward), or a model "
                   "without it", built=True),
    Rule(lambda r: bool(r.model_type and r.stage_families) and r.model_type not in r.stage_families,
         lambda r: f"Pipeline stages are written for {sorted(r.stage_families)} models; this one is "
                   f"{r.model_type!r}",
         lambda r: "add its embeddings and head to shared/techniques/pipeline_stages.py FAMILIES and Stage.forward",
         built=True),
    Rule(lambda r: r.stages > 0 and 0 < r.layers < r.stages,
         lambda r: f"The model has {r.layers} blocks, fewer than the {r.stages} stages"
                   + (f" ({r.flags['stages']})" if r.flags.get("stages") else ""),
         lambda r: "use fewer processes/devices or stages, or a deeper model (--model_preset base)", built=True),
    Rule(lambda r: r.devices >= 2 and r.stages > r.devices,
         lambda r: f"{r.flag('stages')} {r.stages} but only {r.devices} {r.device_kind} devices: each stage needs "
                   "its own",
         lambda r: f"pass {r.flag('stages')} {r.devices} or less", built=True),
)
rules.register(*RULES, fields=dict(
    microbatches=0, schedule_refuses="", schedule_takes=(), batch_size=0, stages_per_replica=0, model_type="",
    stage_families=(), stage_drops=(), stages=0, layers=0, devices=0, device_kind=""))
