"""The optimizer and learning-rate schedule every recipe starts from, and how many steps to run."""

from __future__ import annotations

import argparse
import logging
import math

import torch
from torch.optim.lr_scheduler import LRScheduler

logger = logging.getLogger("recipes")


def optimizer_and_scheduler(args: argparse.Namespace, model: torch.nn.Module, max_steps: int,
                            optimizer_cls: type = torch.optim.AdamW) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW-style optimizer without weight decay on biases and norms, and the --lr_scheduler_type schedule."""
    from transformers import get_scheduler

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = optimizer_cls([g for g in groups if g["params"]], lr=args.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=max_steps)
    return optimizer, scheduler


def total_steps(args: argparse.Namespace, accelerator, train_dataloader, already_split: bool = False) -> int:
    """--max_train_steps, or the optimizer steps in --num_train_epochs; stored back in args.max_train_steps.

    train_dataloader: the whole training set's loader, which Accelerate will split over the processes; or, with
    already_split, what this process itself reads (the pipeline and tensor-parallel recipes' own loaders, where
    dividing again by the process count trained half an epoch, or a quarter, when epochs were asked)."""
    if not args.max_train_steps:
        per_process = math.ceil(len(train_dataloader) / (1 if already_split else accelerator.num_processes))
        args.max_train_steps = max(1, math.ceil(args.num_train_epochs * per_process / args.gradient_accumulation_steps))
        # A --max_train_steps the user passed was checked against the warmup when parsed (shared/core/args.py).
        if args.num_warmup_steps >= args.max_train_steps:
            raise SystemExit(f"--num_warmup_steps {args.num_warmup_steps} >= the run's {args.max_train_steps} steps: "
                             "the learning rate would never reach --learning_rate. Lower --num_warmup_steps, or "
                             "train longer.")
    if args.checkpointing_steps and args.checkpointing_steps > args.max_train_steps:
        logger.warning("--checkpointing_steps %d > the run's %d steps: no checkpoint will be written.",
                       args.checkpointing_steps, args.max_train_steps)
    return args.max_train_steps


def compile_each_shard_apart() -> None:
    """Turn off AOTAutograd's on-disk cache for this process, for torchao's compiled optimizer step under FSDP2.

    That cache keys a graph by a hash which, for tensor subclasses without `_stable_hash_for_caching` (FSDP2's
    DTensor parameters, torchao's quantized state), leaves out the local shard's shape. Two processes with uneven
    shards (21 and 20 rows of a 41-row tensor) then share one key: the second loads the first one's graph and
    fails inside the step (`AssertionError: expected size 21==20`, or `wrong number of dimensions`). Measured
    2026-12-01 with torch 2.13, torchao 0.18: fails with the cache warm, trains with it off. Inductor's own graph
    cache (plain tensors, full shapes in the key) still applies.
    """
    from torch._functorch import config

    config.enable_autograd_cache = False
