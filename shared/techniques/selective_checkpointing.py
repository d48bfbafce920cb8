"""Selective (op-level) activation checkpointing: inside a checkpointed block the outputs of the matmuls and of
attention (most of the FLOPs) are kept from forward, and only the cheap, memory-bound ops (norms, activations,
dropout, residual adds, reshapes) are recomputed in backward, with torch's create_selective_checkpoint_contexts.
Used by recipes/activation_checkpointing.py (its own blocks) and recipes/combined.py (through HF's switch)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten
SAVED_OPS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
             aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
             aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default}


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(policy: str) -> dict:
    """torch.utils.checkpoint's keyword arguments for a policy: full keeps a block's input only; selective also the
    outputs SAVED_OPS names. Non-reentrant: keyword arguments, inputs without grad, and nesting all work."""
    selective = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_matmuls)}
    return {"use_reentrant": False, **(selective if policy == "selective" else {})}
