"""The optimizer and learning-rate schedule every recipe starts from, and how many steps to run."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LRScheduler

from .errors import LaunchError

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")


def optimizer_and_scheduler(launch: Launch, model: torch.nn.Module, max_steps: int,
                            optimizer_cls: type = torch.optim.AdamW) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW-style optimizer without weight decay on biases and norms, and the --lr_scheduler_type schedule, at the
    launch's learning rate (--learning_rate, or the default for a pretrained or a random model)."""
    from transformers import get_scheduler

    args = launch.args

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = optimizer_cls([g for g in groups if g["params"]], lr=launch.learning_rate)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=max_steps)
    return optimizer, scheduler


def total_steps(launch: Launch, accelerator, train_dataloader, already_split: bool = False) -> int:
    """--max_train_steps, or the optimizer steps in --num_train_epochs: the recipe holds it (`max_steps`) and passes it
    to what needs the last step (resume, the meter, the guard, the preemption check, maybe_save_checkpoint).

    train_dataloader: the whole training set's loader, which Accelerate will split over the processes; or, with
    already_split, what this process itself reads (the pipeline and tensor-parallel recipes' own loaders, where
    dividing again by the process count trained half an epoch, or a quarter, when epochs were asked)."""
    args = launch.args
    steps = args.max_train_steps
    if not steps:
        per_process = math.ceil(len(train_dataloader) / (1 if already_split else accelerator.num_processes))
        steps = max(1, math.ceil(args.num_train_epochs * per_process / launch.gradient_accumulation_steps))
        # A --max_train_steps the user passed was checked against the warmup when parsed (shared/core/args.py).
        if args.num_warmup_steps >= steps:
            raise LaunchError(f"--num_warmup_steps {args.num_warmup_steps} >= the run's {steps} steps: "
                              "the learning rate would never reach --learning_rate. Lower --num_warmup_steps, or "
                              "train longer.")
    if args.checkpointing_steps and args.checkpointing_steps > steps:
        logger.warning("--checkpointing_steps %d > the run's %d steps: no checkpoint will be written.",
                       args.checkpointing_steps, steps)
    return steps
