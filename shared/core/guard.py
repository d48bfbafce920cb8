"""Ends a run that diverged, with its training state saved and the cause and fix named.

The meter measures each step; this decides whether training may go on. `check(step)`, called by the recipe right
after `meter.record(step, ...)` (after optimizer.step(), before zero_grad), looks at what the meter recorded:
- fp32 / bf16: the meter counts non-finite losses on the device, and reads the count (summed over processes) only
  at its logging steps, every --logging_steps steps and at the last. The run stops there, on every process
  together. So no step that does not log waits on the host or on a collective: on a GPU the host keeps queueing
  kernels. The price: the state saved is that of the logging step that found the non-finite loss, up to
  --logging_steps - 1 steps after the first one (its weights may already be NaN); the message names the window.
- fp16: an inf loss is an overflow that the scaler skips; what stops the run is the scale collapsing below
  MIN_LOSS_SCALE, or most of the last MOST_SKIPPED_WINDOW steps being skipped: fp16's range is too narrow. It is
  checked every step: Accelerate reads the scale on the host at every fp16 step already (to tell a skipped step).
On a stop, the training state after step N's update is saved as a checkpoint in <output_dir>/diverged_step_N
(loadable with --resume_from_checkpoint), and SystemExit says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .checkpoint import save_checkpoint

if TYPE_CHECKING:
    from .meter import Meter

MIN_LOSS_SCALE = 1.0  # from 2**16, 17 overflows in a row
MOST_SKIPPED_WINDOW = 50


class DivergenceGuard:
    """Stops on a non-finite loss, or on an fp16 loss scale that collapsed, with the state saved."""

    def __init__(self, meter: Meter):
        self.meter = meter  # the accelerator, launch and optimizer of the run, and the loss it recorded last
        self.skipped_history: list[bool] = []

    def check(self, step: int) -> None:
        """After meter.record(step, ...): raise SystemExit, the state saved, if optimizer step `step` diverged."""
        acc, done = self.meter.accelerator, step + 1
        if acc.mixed_precision == "fp16":
            reason = self._fp16_collapse()
        else:
            reason = self._non_finite_loss(done)
        if reason:
            self._stop(done, reason)

    def _fp16_collapse(self) -> str | None:
        scaler = self.meter.accelerator.scaler
        if scaler is None:
            return None
        self.skipped_history.append(bool(getattr(self.meter.optimizer, "step_was_skipped", False)))
        recent = self.skipped_history[-MOST_SKIPPED_WINDOW:]
        scale = scaler.get_scale()
        if scale < MIN_LOSS_SCALE or (len(recent) == MOST_SKIPPED_WINDOW and sum(recent) > len(recent) // 2):
            return (f"fp16 loss scale collapsed to {scale:g} ({sum(recent)} of the last {len(recent)} steps skipped "
                    "for overflow): fp16's range is too narrow for this model. Use --mixed_precision bf16 (same "
                    "memory, fp32's range), or fp32")
        return None

    def _non_finite_loss(self, step: int) -> str | None:
        meter = self.meter
        # Read only where the meter has just logged: no sync on any other step.
        if meter.logged_window is None or meter.logged_window[1] != step or not meter.nonfinite_steps:
            return None
        first, last = meter.logged_window
        return (f"the loss was not finite in {meter.nonfinite_steps} step(s) (counted over processes) between "
                f"steps {first} and {last} (checked every --logging_steps steps). Lower --learning_rate, keep "
                "--max_grad_norm on, and check the data for bad values")

    def _stop(self, step: int, reason: str) -> None:
        acc, launch = self.meter.accelerator, self.meter.launch
        path = Path(launch.output_dir) / f"diverged_step_{step:08d}"
        # A checkpoint like the others (manifest, step, data position), outside checkpoints/ so `latest` never takes
        # it: loadable to inspect with --resume_from_checkpoint <path> (and, say, a lower --learning_rate).
        save_checkpoint(acc, launch, step, micro_batches=step * launch.gradient_accumulation_steps, final=path)
        acc.end_training()
        raise SystemExit(f"Stopped: {reason}. The training state at step {step} is saved in {path}: "
                         f"--resume_from_checkpoint {path} loads it.")
