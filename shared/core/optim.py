"""The optimizer and learning-rate schedule every recipe starts from, and how many steps to run."""

from __future__ import annotations

import functools
import logging
import math
import weakref
from typing import TYPE_CHECKING

import torch
from torch.optim.lr_scheduler import LRScheduler

from .errors import LaunchError

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
# For results.json (stepped_schedule): the schedules built from --lr_scheduler_type, the schedulers stepped unprepared
_FROM_FLAGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEPT_APART: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # accelerator -> [scheduler]


def optimizer_and_scheduler(launch: Launch, model: torch.nn.Module, max_steps: int,
                            optimizer_cls: type = torch.optim.AdamW) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW-style optimizer without weight decay on biases and norms, and the --lr_scheduler_type schedule, at the
    launch's learning rate (--learning_rate, or the default for a pretrained or a random model)."""
    args = launch.args

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = optimizer_cls([g for g in groups if g["params"]], lr=launch.learning_rate)
    return optimizer, flag_schedule(args, optimizer, max_steps)


def flag_schedule(args, optimizer: torch.optim.Optimizer, max_steps: int) -> LRScheduler:
    """The --lr_scheduler_type schedule (transformers' get_scheduler), known as such to results.json."""
    from transformers import get_scheduler

    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=max_steps)
    _FROM_FLAGS[scheduler] = _flag(args)
    return scheduler


def _flag(args) -> str:
    return f"--lr_scheduler_type {args.lr_scheduler_type}"


def kept_apart(accelerator, scheduler: object) -> None:
    """A scheduler the recipe steps without accelerator.prepare (a pipeline stage's, tensor parallel's)."""
    _KEPT_APART.setdefault(accelerator, []).append(scheduler)


def stepped_schedule(accelerator, args) -> dict | list:
    """What results.json says of the learning-rate schedule: the scheduler objects the loop stepped (those prepared,
    else those kept apart), not the flag. `stepped`: the class, a LambdaLR's function (functools.partial and
    Accelerate's wrapper unwrapped: transformers' schedules are LambdaLRs); `from`: --lr_scheduler_type X only for
    the schedule built from it (flag_schedule), the DeepSpeed JSON's block, or the recipe's own; the last rate set."""
    from .accelerate_compat import prepared_schedulers

    flag, stepped = _flag(args), prepared_schedulers(accelerator) or _KEPT_APART.get(accelerator, [])
    inner = [getattr(w, "scheduler", w) for w in stepped]  # Accelerate's AcceleratedScheduler holds the stepped one
    if not inner:
        return {"stepped": None, "from": "unknown: the recipe prepared no scheduler"}
    records = []
    for s in inner:
        source = _FROM_FLAGS.get(s) or ("the DeepSpeed JSON's scheduler block" if type(s).__module__.startswith(
            "deepspeed.") else "the recipe's own scheduler")
        lrs = sorted({float(g["lr"]) for g in getattr(getattr(s, "optimizer", None), "param_groups", ())})
        records.append({"stepped": _schedule_name(s), "from": source, "final_lr": lrs[0] if len(lrs) == 1 else lrs,
                        **({} if source == flag else {"flag_not_applied": flag})})
    return records[0] if len(records) == 1 else records


def _schedule_name(scheduler: object) -> str:
    """LambdaLR(_get_cosine_schedule_with_warmup_lr_lambda), CosineAnnealingLR, SequentialLR(LinearLR, ...)."""
    parts = []
    for fn in getattr(scheduler, "lr_lambdas", None) or ():
        while isinstance(fn, functools.partial):
            fn = fn.func
        parts.append(getattr(fn, "__name__", type(fn).__name__))
    parts += [_schedule_name(s) for s in getattr(scheduler, "_schedulers", None) or ()]  # SequentialLR, Chained...
    inside = ", ".join(dict.fromkeys(parts))
    return f"{type(scheduler).__name__}({inside})" if inside else type(scheduler).__name__


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
