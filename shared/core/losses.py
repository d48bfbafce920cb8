"""The training losses, written once: summed over the items (target tokens or samples), so that the caller divides by
the count of the whole global batch (accumulation, data, pipeline and sequence parallel all normalise the same way).
Task.loss, the pipeline's last stage and the sequence-parallel chunks call these."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .args import DECODER_TASKS

IGNORE = -100  # a label that is no target: padding, and the last position of a causal-LM sequence


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets at each position of [batch, seq] labels, the last position none: for a sequence that is
    cut into chunks afterwards (sequence parallel), so the target across a chunk boundary is kept."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE)


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the targets that are not IGNORE; logits [..., classes] in fp32, targets [...]."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE,
                           reduction="sum")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of a whole sequence: position t's logits against label t+1."""
    logits = logits.float()  # before the slice, as the memory planner counts it (fp32 copy, then the shifted copy)
    return summed_cross_entropy(logits[:, :-1], labels[:, 1:])


def classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over samples: logits [batch, classes], labels [batch]."""
    return summed_cross_entropy(logits, labels)


def summed_loss(task_name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The task's summed loss of (logits, labels)."""
    return causal_lm_loss if task_name in DECODER_TASKS else classification_loss


def count_items(task_name: str, labels: torch.Tensor) -> torch.Tensor:
    """What the summed loss is divided by: target tokens for a causal LM, samples for classification."""
    if task_name in DECODER_TASKS:
        return (labels[:, 1:] != IGNORE).sum()
    return torch.tensor(labels.numel(), device=labels.device)
