"""What the training data holds, for results.json: samples, target tokens per epoch, the padding batches carry."""

from __future__ import annotations

import numpy as np


def padding_fraction(lengths: list[int], batch_size: int, seed: int, block: int | None = None) -> float:
    """Share of pad positions in an epoch of batches of `batch_size` samples of `lengths` real tokens.

    block: every sample is padded to this length (packed blocks). Otherwise a batch is padded to its longest sample
    (DataCollatorWithPadding, tokenizer.pad); the batches are then drawn from one seeded shuffle, as training draws
    them: the figure is that shuffle's, and another one's differs a little.
    """
    n = np.asarray(lengths, dtype=np.int64)
    if n.size == 0:
        return 0.0
    if block is not None:
        return float(1.0 - n.sum() / (n.size * block))
    order = np.random.default_rng(seed).permutation(n.size)
    padded = sum(int(chunk.max()) * chunk.size for chunk in np.array_split(n[order], range(batch_size, n.size,
                                                                                           batch_size)))
    return float(1.0 - n.sum() / padded)


def text_stats(real_tokens: list[int], targets: list[int] | None, batch_size: int, seed: int,
               block: int | None = None) -> dict[str, float | int]:
    """train_examples, train_target_tokens (the whole training set: all processes together, one epoch) and
    padding_fraction. `targets` None: the targets are samples (classification), not tokens."""
    stats: dict[str, float | int] = {"train_examples": len(real_tokens)}
    if targets is not None:
        stats["train_target_tokens"] = int(sum(targets))
    stats["padding_fraction"] = round(padding_fraction(real_tokens, batch_size, seed, block), 6)
    return stats
