"""Ulysses sequence parallelism for causal LMs: each process holds 1/N of every sequence, DeepSpeed's all-to-all
exchanges it for 1/N of the heads around attention.

Outside attention every op is per token, so a process runs the model on its own chunk of the sequence: its
activations are 1/N of one process's. Attention needs the whole sequence: DeepSpeed's `DistributedAttention` turns
this process's q, k, v ([batch, seq/N, heads, dim]) into the whole sequence for heads/N ([batch, seq, heads/N, dim])
with one all-to-all each, runs torch's own sdpa (causal) on them, and sends the output back to [batch, seq/N, heads,
dim]. The weights are replicated: their gradients are summed over the processes by DDP (accelerator.prepare).

Two things the model would otherwise get wrong on a chunk (found here: each moved the loss, see
docs/sequence_parallel.md): the labels are shifted over the whole sequence BEFORE it is split (shifted inside each
chunk, the first token of every later chunk loses its target), and each chunk gets its global position ids (from 0
in each chunk, the chunks after the first would read the wrong position embeddings).
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import rules
from ..core.attention import attention_features
from ..core.losses import IGNORE, shift_labels, summed_cross_entropy
from ..core.rules import Rule, unsplit

# attention_features the local attention keeps (each per query, key or head); others (chunked or linear-attention
# layers) are refused by name
CARRIED = ("sliding window", "attention soft-capping", "final logit soft-capping", "attention sinks")
ATTENTION = "ulysses"  # the name this module registers in Transformers' AttentionInterface ("sdpa" in it would
# make Transformers check the model's sdpa support: Gemma 2 has none, for its soft cap)


def _mask(length: int, window: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive [1, 1, s, s] mask of causal attention, within `window` tokens when set (Transformers'
    sliding_window_overlay: key > query - window)."""
    q, k = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)[None, :]
    allowed = (k <= q) & ((k > q - window) if window else True)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None,
                                                                                                                None]


class _HeadShare:
    """The attention module as its eager function sees it for this process's heads: per-head parameters (gpt-oss's
    sinks) cut to them. DeepSpeed's all-to-all gives process r the r-th contiguous block of heads."""

    def __init__(self, module: nn.Module, sinks: torch.Tensor):
        self._module, self.sinks = module, sinks

    def __getattr__(self, name: str) -> object:
        return getattr(self._module, name)


def _local_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, module: nn.Module,
                **kwargs) -> torch.Tensor:
    """Causal attention on the whole sequence for this process's heads: [b, s, h/N, d] in, [b, s, h/N, d] out.

    Plain causal: torch's sdpa. A sliding window (kwargs["sliding_window"], as Mistral, Qwen2, Gemma and gpt-oss
    pass it), a soft cap (kwargs["softcap"], Gemma 2) or sinks (module.sinks, gpt-oss): the model's own eager
    attention function, with the causal (windowed) mask of the whole gathered sequence. Each is per query, key or
    head, so on whole sequences for a share of the heads it gives what one process gives (tests/test_attention_
    variants.py); dropped, the loss moved (Gemma-3-style, 6.1413 vs 6.1454 at a sequence past the window)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # Transformers' layout, [b, h/N, s, d]
    length, window = q.shape[2], kwargs.get("sliding_window")
    window = window if window and window < length else None  # a window the sequence fits in masks nothing
    sinks = getattr(module, "sinks", None)
    if window is None and not kwargs.get("softcap") and sinks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
        return out  # sdpa_attention_forward returns [b, s, h/N, d]
    import sys

    eager = sys.modules[type(module).__module__].eager_attention_forward  # enable() refused a model without one
    if sinks is not None and sinks.shape[0] != q.shape[1]:  # training: this process's share of the heads
        share = q.shape[1]
        rank = torch.distributed.get_rank() if sinks.shape[0] == share * torch.distributed.get_world_size() else 0
        module = _HeadShare(module, sinks[rank * share:(rank + 1) * share])
        kwargs.pop("s_aux", None)
    out, _ = eager(module, q, k, v, _mask(length, window, q.dtype, q.device), **kwargs)
    return out  # eager functions return [b, s, h/N, d] too


class _Local(nn.Module):
    """DistributedAttention takes its local attention as a module."""

    def forward(self, query, key, value, module, **kwargs):
        return _local_sdpa(query, key, value, module, **kwargs)


_DIST_ATTN: list[nn.Module] = []  # the one DistributedAttention, built by enable()


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """A Transformers attention function. Training: this process's chunk, exchanged by DeepSpeed's all-to-all.
    Evaluation (model.eval()): each process runs whole sequences itself, as one process would (data-parallel eval).
    The mask is not used: a packed block (--packing concat) is plain causal, which the local attention applies to the
    whole gathered sequence (the model's own mask would be of the chunk's length), within the model's window."""
    kwargs.pop("is_causal", None)
    if not module.training:
        return _local_sdpa(*(t.transpose(1, 2) for t in (query, key, value)), module, **kwargs), None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s/N, h, d]: DeepSpeed's batch-first layout
    out = _DIST_ATTN[0](q, k, v, 0, None, module=module, **kwargs)  # batch_dim_idx 0, no rotary here
    return out, None  # [b, s/N, h, d], as Transformers' attention functions return


def _drops(model: nn.Module) -> tuple[str, ...]:
    """The model's attention features the local attention would drop: those not CARRIED, and the carried ones too when
    the model's modeling file has no eager_attention_forward to run them with."""
    import sys

    found = attention_features(model.config, model)
    drops = [f for f in found if f not in CARRIED]
    if set(found) & set(CARRIED) and not hasattr(sys.modules[type(model).__module__], "eager_attention_forward"):
        drops += [f"{f} (no eager_attention_forward in its modeling file)" for f in found if f in CARRIED]
    return tuple(drops)


def enable(model: nn.Module, world: int) -> None:
    """Swap the model's attention for the sequence-parallel one over all `world` processes (after the process group
    exists). Refuses a model whose heads do not split over them."""
    import deepspeed.comm as ds_dist
    from deepspeed.sequence.layer import DistributedAttention
    from transformers import AttentionInterface

    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    rules.check_built(heads=cfg.num_attention_heads, kv_heads=kv_heads, sp_degree=world,  # shared/core/rules.py
                      sp_drops=_drops(model))
    ds_dist.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    _DIST_ATTN[:] = [DistributedAttention(_Local(), torch.distributed.group.WORLD, scatter_idx=2, gather_idx=1)]
    AttentionInterface.register(ATTENTION, ulysses_attention)
    model.set_attn_implementation(ATTENTION)


def shard(batch: dict, rank: int, world: int) -> dict:
    """This process's chunk of a whole batch: input ids, their global position ids, and the labels shifted over the
    whole sequence first (the target of position t is token t+1, also across the chunk boundary; the last position
    has none). No attention mask: a packed block has no padding."""
    ids, labels = batch["input_ids"], batch["labels"]
    length = ids.shape[1]
    shifted = shift_labels(labels)
    positions = torch.arange(length, device=ids.device).expand_as(ids)
    part = slice(rank * length // world, (rank + 1) * length // world)
    return {"input_ids": ids[:, part], "position_ids": positions[:, part], "shift_labels": shifted[:, part]}


def loss(model: nn.Module, chunk: dict, num_items: torch.Tensor | float, task: object | None = None) -> torch.Tensor:
    """This chunk's summed cross-entropy against its already shifted labels, divided by `num_items` (the global
    batch's target tokens over the process count: DDP's mean over processes then gives sum / global count).

    A mixture of experts adds its router's load-balancing loss through `task` (Task.router_loss), computed on this
    chunk's tokens and weighted by the chunk's share of the targets: DDP's mean then averages the chunks' losses, as
    data parallel averages each process's batch's."""
    if task is not None:
        task.refuse_hooks(("keep_columns", "loss_fn", "count_fn"), "sequence parallel computes the loss over each "
                          "process's chunk of the sequence, its labels shifted before the cut. Write your loss over "
                          "chunks in sp.loss, or use recipes/baseline.py")
    out = model(input_ids=chunk["input_ids"], position_ids=chunk["position_ids"], use_cache=False)
    total = summed_cross_entropy(out.logits, chunk["shift_labels"]) / num_items  # shifted already: no shift here
    if getattr(out, "aux_loss", None) is None:
        return total
    if task is None:  # the router's load-balancing loss would silently not train
        raise ValueError("The model returns a router aux_loss (a mixture of experts): pass sp.loss(..., task=task)")
    return total + task.router_loss(out, (chunk["shift_labels"] != IGNORE).sum(), num_items)


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # Sequence parallel (recipes/sequence_parallel.py): each process runs its chunk of every causal-LM sequence.
    Rule(lambda r: r.support.splits_sequence and r.task not in ("", "causal-lm"),
         lambda r: f"--task {r.task}: recipes/{r.recipe}.py splits concatenated causal-LM blocks (its attention is "
                   "causal over the gathered sequence, its loss next-token)" + (
                       "; sft's whole conversations need a per-document mask (packed) or padding (one per row), "
                       "which its chunks do not exchange" if r.task == "sft" else ""),
         lambda r: "pass --task causal-lm, or use recipes/data_parallel.py for this task"),
    Rule(lambda r: r.support.splits_sequence and r.seq_len and r.seq_len % r.num_processes,
         lambda r: f"--max_seq_length {r.seq_len} does not split into {r.num_processes} equal chunks (one per "
                   "process)",
         lambda r: f"pass a multiple of {r.num_processes}, e.g. --max_seq_length "
                   f"{max(r.num_processes, r.seq_len - r.seq_len % r.num_processes)}"),
    Rule(lambda r: r.support.splits_sequence and r.task == "causal-lm" and r.packing != "concat",
         lambda r: f"--packing {r.packing}: recipes/{r.recipe}.py attends causally over whole packed blocks, and "
                   + ("per-document masks are not exchanged between the chunks" if r.packing == "per_document" else
                      "padded samples of varying length do not split into equal chunks"),
         lambda r: "use --packing concat (the default)"),
    Rule(lambda r: bool(r.sp_drops),
         lambda r: f"The model's {', '.join(r.sp_drops)}: sequence parallel attends causally over the gathered "
                   "sequence (within a sliding window, soft cap and sinks where the model has them), and would run "
                   "these layers as plain attention",
         lambda r: "use recipes/fsdp.py or recipes/baseline.py for this model", built=True),
    Rule(lambda r: r.sp_degree > 0 and bool(unsplit(r, r.sp_degree, heads=r.heads, kv_heads=r.kv_heads)),
         lambda r: f"The model's {r.heads} attention heads ({r.kv_heads} key/value heads) do not split over "
                   f"{r.sp_degree} processes: Ulysses gives each process heads/N of them",
         lambda r: "launch a divisor of the head count (--num_processes), or pick a model whose heads it divides",
         built=True),
)
rules.register(*RULES, fields=dict(seq_len=0, sp_degree=0, heads=0, kv_heads=0, sp_drops=()))
