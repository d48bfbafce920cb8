"""The training loop's meter: progress bar, loss logging, throughput, memory and state bytes of the run (measured
with shared/core/measure.py). It measures only: ending a run is shared/core/guard.py's job."""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .measure import (
    compile_times,
    compiled_modules,
    current_memory_bytes,
    observe_compute_dtype,
    param_fingerprint,
    peak_memory_bytes,
    precision_dtypes,
    reset_peak_memory,
    state_bytes,
    stepping_optimizer,
)

logger = logging.getLogger("recipes")


class Meter:
    """Progress bar (main process only), loss logging to the trackers, throughput, memory and state bytes."""

    def __init__(self, accelerator, launch, task, model: nn.Module, optimizer: object):
        self.accelerator, self.launch, self.task = accelerator, launch, task
        self.model, self.optimizer = model, optimizer
        self.samples = self.tokens = 0
        self.timed_steps = 0
        self.elapsed = 0.0
        self.window: list[torch.Tensor] = []
        self.initial_loss: float | None = None
        self.last_loss: float | None = None
        self._summary: dict | None = None
        self.state: dict[str, int] | None = None
        self.extras: dict[str, object] = {}
        self.step_loss: torch.Tensor | None = None  # the last recorded step's loss
        self.router_aux_loss: float | None = None  # a mixture of experts: the load-balancing loss, last logged
        self.max_steps: int | None = None  # the run's steps, as the recipe passed them to steps()
        self.memory_trace: list[int] = []  # this process's memory at each logging step: growth means a leak
        self._read_dtype = observe_compute_dtype(model)
        self._warmup = True
        self.first_step_s: float | None = None  # the first optimizer step's wall time (synced)
        self.step_times: list[float] = []  # each later step's wall time

    def steps(self, start: int, stop: int) -> Iterator[int]:
        """Optimizer steps start..stop-1. The first step of a run is warm-up and is left out of the timing."""
        bar = tqdm(range(start, stop), initial=start, total=stop, desc="train",
                   disable=not self.accelerator.is_local_main_process, dynamic_ncols=True)
        reset_peak_memory(self.accelerator.device)
        self.bar, self.max_steps = bar, stop
        self.extras["resumed_from_step"] = start
        # The clock runs from the end of the first step to the end of the last: two device syncs in all, where one
        # per step would stall the host's kernel launches at every step.
        t0, done = None, 0
        start = last = time.perf_counter()
        for step in bar:
            self._warmup = t0 is None
            yield step
            done += 1
            if t0 is None:
                self._sync()
                t0 = last = time.perf_counter()
                self.first_step_s = t0 - start  # compiles the model under --torch_compile (the forward and backward)
            else:  # host wall time per step, no device sync (on a GPU the host may run a little ahead)
                now = time.perf_counter()
                self.step_times.append(now - last)
                last = now
        self._sync()
        if t0 is not None:
            self.elapsed, self.timed_steps = time.perf_counter() - t0, done - 1
        bar.close()

    def _sync(self) -> None:
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize(self.accelerator.device)

    def set_states(self, states: dict[str, int], **extras: object) -> None:
        """Model-state bytes counted by the caller, where the loop cannot see them all alive at once (ZeRO's step:
        deepspeed_setup.patch_zero_step_to_count_states); `record` then counts none itself."""
        self.state = states
        self.extras.update(extras)

    def record(self, step: int, loss: torch.Tensor, batches: dict | list[dict]) -> None:
        """Call once per optimizer step, after optimizer.step() and before zero_grad(): state bytes are counted on
        the first call, while parameters, gradients and optimizer state all exist."""
        batches = batches if isinstance(batches, list) else [batches]
        if self.launch.args.record_samples:  # which samples this step read on this process (a CRC32 per row)
            with (Path(self.launch.output_dir) / f"samples_{self.accelerator.process_index}.jsonl").open("a") as f:
                f.write(json.dumps([step, [zlib.crc32(r.cpu().numpy().tobytes()) for b in batches
                                           for r in b.get("input_ids", b["labels"])]]) + "\n")
        if not self._warmup:  # the same steps as the timing
            self.samples += sum(len(b["labels"]) for b in batches)
            self.tokens += sum(self.task.tokens_in(b) for b in batches)
        if self.state is None:
            self.state = state_bytes(self.model, self.optimizer)
        if "master_weights_dtype" not in self.extras:  # measured once, as the states are: all alive now
            self.extras.update(precision_dtypes(self.model, self.optimizer))
        self.step_loss = loss.detach().float()
        self.window.append(self.step_loss)
        if len(self.window) >= self.launch.args.logging_steps or step + 1 == self.bar.total:
            self._log(step + 1)

    def _log(self, step: int) -> None:
        # One collective, summed over processes: the window's mean loss (and a router's loss): a step that does not
        # log has none.
        window = torch.stack(self.window).mean().to(self.accelerator.device)
        # A mixture of experts: its router's load-balancing loss (the last batch's, the same on every process count).
        aux = self.task.router_aux_loss
        aux = [] if aux is None else [aux.float().to(window.device)]
        values = torch.stack([window, *aux])
        total, *rest = self.accelerator.reduce(values, "sum").tolist()
        if aux:
            self.router_aux_loss = rest[0] / self.accelerator.num_processes
            log_metrics(self.accelerator, {"train/router_aux_loss": self.router_aux_loss}, step)
        mean = total / self.accelerator.num_processes
        if self.initial_loss is None:
            self.initial_loss = self.window[0].item()
        self.window.clear()
        self.last_loss = mean
        self.memory_trace.append(current_memory_bytes(self.accelerator.device))
        lr = self.optimizer.param_groups[0]["lr"]
        log_metrics(self.accelerator, {"train/loss": mean, "train/lr": lr}, step)
        self.bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")

    def summary(self) -> dict[str, object]:
        """The measured fields of results.json; memory figures are lists indexed by process rank. Measured once, at
        the first call (finish makes it before the model is saved)."""
        from accelerate.utils import gather_object

        if self._summary is not None:
            return self._summary

        per_process = {"peak_memory_bytes": peak_memory_bytes(self.accelerator.device), **(self.state or {}),
                       "param_fingerprint": param_fingerprint(self.model)}
        gathered = gather_object([per_process])
        fields = {k: [g[k] for g in gathered] for k in per_process}
        totals = self.accelerator.reduce(
            torch.tensor([self.samples, float(self.tokens)], dtype=torch.float64, device=self.accelerator.device),
            "sum")
        seconds = self.elapsed or float("nan")
        self._summary = {
            "initial_loss": self.accelerator.reduce(
                torch.tensor(self.initial_loss or float("nan"), device=self.accelerator.device), "mean").item(),
            "train_loss": self.last_loss,
            "train_runtime": self.elapsed,
            "seconds_per_step": seconds / max(1, self.timed_steps),
            "compiled_modules": compiled_modules(self.model),
            **compile_times(self.first_step_s, self.step_times),
            "train_samples_per_second": totals[0].item() / seconds,
            "train_tokens_per_second": totals[1].item() / seconds,
            "compute_dtype": self._read_dtype(),
            "autocast_dtype": self._read_dtype.autocast(),
            "optimizer_class": type(stepping_optimizer(self.optimizer)).__name__,
            "memory_trace_bytes": self.memory_trace,
            **({"router_aux_loss": self.router_aux_loss} if self.router_aux_loss is not None else {}),
            **fields,
        }
        return self._summary



def log_metrics(accelerator, values: dict, step: int) -> None:
    """accelerator.log; a tracker that cannot write (a full or read-only disk, a remount) is reported once and
    dropped, and training goes on: the losses stay in the console and results.json, and a checkpoint that cannot be
    written says so itself."""
    try:
        accelerator.log(values, step=step)
    except OSError as err:
        logger.error("the trackers (%s) could not write at step %d (%s: %s %s): training goes on without them",
                     ", ".join(str(getattr(t, "name", t)) for t in accelerator.trackers), step, type(err).__name__,
                     err.strerror or err, err.filename or "")
        accelerator.trackers = []
