"""Ends a run that diverged, with its training state saved and the cause and fix named.

`check(step, loss)`, called by the recipe with the loss of optimizer step `step` (after optimizer.step(), before
zero_grad), decides whether training may go on:
- fp32 / bf16: non-finite losses are counted on the device, and the count (summed over processes) is read only at
  the logging steps, every --logging_steps steps and at the last. The run stops there, on every process together.
  So no step that does not log waits on the host or on a collective: on a GPU the host keeps queueing kernels. The
  price: the state saved is that of the logging step that found the non-finite loss, up to --logging_steps - 1
  steps after the first one (its weights may already be NaN); the message names the window.
- fp16: an inf loss is an overflow that the scaler skips; what stops the run is the scale collapsing below
  MIN_LOSS_SCALE, or most of the last MOST_SKIPPED_WINDOW steps being skipped: fp16's range is too narrow. It is
  checked every step: Accelerate reads the scale on the host at every fp16 step already (to tell a skipped step).
On a stop, the training state after step N's update is saved as a checkpoint in <output_dir>/diverged_step_N
(loadable with --resume_from_checkpoint), and a TrainingError says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .checkpoint import logging_step, save_checkpoint
from .errors import TrainingError

if TYPE_CHECKING:
    from .launch import Launch

MIN_LOSS_SCALE = 1.0  # from 2**16, 17 overflows in a row
MOST_SKIPPED_WINDOW = 50


class DivergenceGuard:
    """Stops on a non-finite loss, or on an fp16 loss scale that collapsed, with the state saved."""

    def __init__(self, accelerator, launch: Launch, optimizer: object, max_steps: int, writes: object = None):
        self.accelerator, self.launch, self.optimizer, self.max_steps = accelerator, launch, optimizer, max_steps
        self.writes = writes  # --async_checkpoint: the checkpoint in flight is completed before the guard's
        self.skipped_history: list[bool] = []
        self._nonfinite = torch.zeros((), device=accelerator.device)  # this process's, since the last read
        self._since: int | None = None  # the first step of the window not read yet (a resume starts later)

    def check(self, step: int, loss) -> None:
        """After optimizer step `step` (0-based) whose loss is `loss`: raise TrainingError, the state saved, if it
        diverged."""
        done = step + 1
        if self.accelerator.mixed_precision == "fp16":
            reason = self._fp16_collapse()
        else:
            reason = self._non_finite_loss(done, loss)
        if reason:
            self._stop(done, reason)

    def _fp16_collapse(self) -> str | None:
        scaler = self.accelerator.scaler
        if scaler is None:
            return None
        self.skipped_history.append(bool(getattr(self.optimizer, "step_was_skipped", False)))
        recent = self.skipped_history[-MOST_SKIPPED_WINDOW:]
        scale = scaler.get_scale()
        if scale < MIN_LOSS_SCALE or (len(recent) == MOST_SKIPPED_WINDOW and sum(recent) > len(recent) // 2):
            return (f"fp16 loss scale collapsed to {scale:g} ({sum(recent)} of the last {len(recent)} steps skipped "
                    "for overflow): fp16's range is too narrow for this model. Use --mixed_precision bf16 (same "
                    "memory, fp32's range), or fp32")
        return None

    def _non_finite_loss(self, step: int, loss) -> str | None:
        self._nonfinite += (~torch.isfinite(loss.detach().float())).any()
        self._since = self._since or step
        # Read only at the logging steps: no sync on any other step.
        if not logging_step(self.launch, step, self.max_steps):
            return None
        count = self._nonfinite.float()
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, "sum")
        nonfinite, first = int(count.item()), self._since
        self._nonfinite.zero_()
        self._since = step + 1
        if not nonfinite:
            return None
        return (f"the loss was not finite in {nonfinite} step(s) (counted over processes) between "
                f"steps {first} and {step} (checked every --logging_steps steps). Lower --learning_rate, keep "
                "--max_grad_norm on, and check the data for bad values")

    def _stop(self, step: int, reason: str) -> None:
        acc, launch = self.accelerator, self.launch
        path = Path(launch.output_dir) / f"diverged_step_{step:08d}"
        # A checkpoint like the others (manifest, step, data position), outside checkpoints/ so `latest` never takes
        # it: loadable to inspect with --resume_from_checkpoint <path> (and, say, a lower --learning_rate).
        save_checkpoint(acc, launch, step, micro_batches=step * launch.gradient_accumulation_steps, final=path,
                        writes=self.writes)
        acc.end_training()
        raise TrainingError(f"Stopped: {reason}. The training state at step {step} is saved in {path}: "
                            f"--resume_from_checkpoint {path} loads it.")
