"""Selective (op-level) activation checkpointing: inside a checkpointed block the outputs of the matmuls and of
attention (most of the FLOPs) are kept from forward, and only the cheap, memory-bound ops (norms, activations,
dropout, residual adds, reshapes) are recomputed in backward, with torch's create_selective_checkpoint_contexts.
Used by recipes/activation_checkpointing.py (its own blocks) and recipes/combined.py (through HF's switch)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..core import rules
from ..core.rules import Rule

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


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.checkpoint_policy == "selective" and r.checkpointing is False,
         lambda r: "--checkpointing_policy selective chooses what checkpointing keeps, and --gradient_checkpointing "
                   "is off",
         lambda r: "add --gradient_checkpointing, or drop --checkpointing_policy"),
    # Activation checkpointing (recipes/activation_checkpointing.py): HF's switch wraps every block whole.
    Rule(lambda r: r.checkpoint_impl == "hf" and (r.checkpoint_every > 1 or r.checkpoint_policy == "selective"),
         lambda r: "--checkpointing_impl hf checkpoints every block whole: --checkpoint_every > 1 and "
                   "--checkpointing_policy selective need --checkpointing_impl torch",
         lambda r: "pass --checkpointing_impl torch (or leave it unset)"),
    Rule(lambda r: r.layers > 0 and r.checkpoint_every > r.layers,
         lambda r: f"--checkpoint_every {r.checkpoint_every} checkpoints no block: the model has {r.layers}",
         lambda r: f"pass --checkpoint_every {r.layers} or less", built=True),
)
rules.register(*RULES, fields=dict(
    checkpoint_impl="", checkpoint_every=0, checkpoint_policy="", checkpointing=None, layers=0))
