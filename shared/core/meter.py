"""What a run costs, measured: bytes on live tensors, peak memory per process, time, the dtype and optimizer really
used, and what activation checkpointing saves. It measures only: ending a run is shared/core/guard.py's job."""

from __future__ import annotations

import contextlib
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from tqdm.auto import tqdm

from .checkpoint import PREEMPTION_SIGNALS, agree_on_signal, local_signal

# ---------------------------------------------------------------- bytes on live tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 / tensor-parallel shard's local piece; any other tensor as it is."""
    # Only a run that shards imports torch.distributed.tensor (0.3 s of import the others, and --help, skip).
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold a tensor's bytes: a shard's local piece, and inside a wrapper subclass (torchao's
    4-bit / 8-bit / FP8 optimizer state) its inner tensors, such as codes, scales and the code book."""
    t = _local(t)
    if is_traceable_wrapper_subclass(t):  # a wrapper has no storage of its own (data_ptr raises)
        for name in t.__tensor_flatten__()[0]:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    t = _local(t)  # a shard counts this process's local piece
    if t.device.type == "meta":
        return None
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr()), s.nbytes()


def _walk(obj: object, path: str, seen_objs: set[int], depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from an optimizer (its state, and DeepSpeed's or bitsandbytes' own buffers)."""
    if depth > 8 or id(obj) in seen_objs or isinstance(obj, nn.Module):
        return
    seen_objs.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k if isinstance(k, (str, int)) else 'key'}", seen_objs, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _walk(v, path, seen_objs, depth + 1)
    # __package__: this core, under the name it was copied as (shared, or recipe_core in a copied-out recipe).
    elif type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "bitsandbytes", "accelerate", "torchao",
                                                "transformers", "peft", __package__, "__main__"):
        for k, v in getattr(obj, "__dict__", {}).items():
            yield from _walk(v, f"{path}.{k}", seen_objs, depth + 1)


def state_bytes(model: nn.Module, optimizer: object | None = None) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes of this process, each storage counted once.

    Parameters include DeepSpeed ZeRO-3 partitions (`ds_tensor`). Tensors reachable from the optimizer count as
    gradients when their attribute path names a gradient (ZeRO's gradient partitions), else as optimizer state
    (moments, fp32 master weights, quantization constants).
    """
    seen: set[tuple] = set()

    def add(t: torch.Tensor | None) -> int:
        total = 0
        for leaf in _leaves(t) if isinstance(t, torch.Tensor) else ():
            st = _storage(leaf)
            if st is not None and st[0] not in seen:
                seen.add(st[0])
                total += st[1]
        return total

    params = list(model.parameters())
    param_bytes = sum(add(p) + add(getattr(p, "ds_tensor", None)) for p in params)
    grad_bytes = sum(add(p.grad) for p in params)
    opt_bytes = 0
    if optimizer is not None:
        for path, t in _walk(optimizer, "optimizer", set()):
            n = add(t)
            if re.search(r"grad", path, re.IGNORECASE) and "grad_scaler" not in path:
                grad_bytes += n
            else:
                opt_bytes += n
    return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optimizer_state_bytes": opt_bytes}


def stepping_optimizer(optimizer: object) -> object:
    """The optimizer whose step() really updates the parameters, inside the wrappers: Accelerate's
    AcceleratedOptimizer, and under DeepSpeed the ZeRO optimizer around the one that steps (DeepSpeedCPUAdam with
    offload: Accelerate swaps it in for the recipe's AdamW)."""
    seen = set()
    while getattr(optimizer, "optimizer", None) is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def quantized_state_counts(optimizer: object) -> dict[str, int]:
    """How many parameters have quantized optimizer state, and how many kept 32-bit state (the libraries leave small
    tensors unquantized): torchao's state is a tensor subclass, bitsandbytes' 8-bit `state1` is uint8."""
    counts = {"tensors_with_quantized_state": 0, "tensors_with_32bit_state": 0}
    for state in stepping_optimizer(optimizer).state.values():
        moment = state.get("exp_avg", state.get("state1"))
        if isinstance(moment, torch.Tensor):
            local = _local(moment)
            quantized = is_traceable_wrapper_subclass(local) or local.dtype == torch.uint8
            counts["tensors_with_quantized_state" if quantized else "tensors_with_32bit_state"] += 1
    return counts


def param_fingerprint(model: nn.Module) -> float:
    """A number that differs when this process's parameters differ: equal on every rank iff replicas are in sync.

    Sharded parameters (FSDP2 DTensors) count their local shard, so the ranks differ there by design.
    """
    with torch.no_grad():
        total = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(model.parameters()):
            local = _local(p).detach()
            if type(local) is not torch.Tensor:  # quantized tensor subclasses (torchao) support few ops
                continue
            if local.numel():
                weights = 1 + (torch.arange(local.numel()) % 7)
                total += (local.double().flatten().cpu() * weights).sum() * (i + 1)
    return total.item()


# ---------------------------------------------------------------- peak memory of this process

_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: allocator peak on GPU; on Linux CPU, the kernel's resident-set high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")  # resets VmHWM (Linux >= 4.0)


def current_memory_bytes(device: torch.device) -> int:
    """Allocated bytes on GPU; resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    with contextlib.suppress(OSError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
    return 0


def peak_memory_bytes(device: torch.device) -> int:
    """Max allocated bytes on GPU; peak resident set size (VmHWM) of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError):
        m = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        if m:
            return int(m.group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def saved_activation_bytes(model: nn.Module) -> Iterator[dict[str, int]]:
    """Bytes autograd keeps for backward inside the block (parameters excluded, each storage once).

    Checkpointed regions keep only their inputs: non-reentrant checkpointing installs its own hooks there.
    """
    params = {_storage(p)[0] for p in model.parameters() if _storage(p) is not None}
    seen: set[tuple] = set()
    out = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = _storage(t)
        if st is not None and st[0] not in params and st[0] not in seen:
            seen.add(st[0])
            out["bytes"] += st[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield out


class _OpOutputs(TorchDispatchMode):
    """Weak references to the storage of every tensor an op returns while it is active."""

    def __init__(self, exclude: set[tuple]):
        super().__init__()
        self.exclude = exclude
        self.refs: dict[tuple, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            st = _storage(t) if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t) else None
            if st is None or st[0] in self.exclude:  # views of parameters, buffers and inputs are not new bytes
                continue
            old = self.refs.get(st[0])
            if old is None or old[0].expired():  # the address may be reused once a storage is freed
                self.refs[st[0]] = (StorageWeakRef(t.untyped_storage()), st[1])
        return out


@contextlib.contextmanager
def forward_kept_bytes(model: nn.Module, inputs: dict | None = None) -> Iterator[dict[str, int]]:
    """Bytes the ops inside the block allocated that are still alive at its end: run around forward + loss, what
    forward leaves for backward, however it is kept (autograd's saved tensors, checkpoint inputs, selective
    checkpointing's cache of op outputs, which saved_tensors_hooks never see) plus the loss itself."""
    owned = [*model.parameters(), *model.buffers(), *(v for v in (inputs or {}).values() if torch.is_tensor(v))]
    out = {"bytes": 0}
    mode = _OpOutputs({st[0] for t in owned if (st := _storage(t)) is not None})
    with mode:
        yield out
    out["bytes"] = sum(n for ref, n in mode.refs.values() if not ref.expired())


def _one_step(task, model: nn.Module, batch: dict) -> tuple[int, int, float, list[torch.Tensor]]:
    """Saved-for-backward bytes, bytes kept from forward (first run only: its dispatch mode costs time), seconds
    (best of 3) and gradients of one forward + backward, same RNG each time."""
    best, kept = float("inf"), {"bytes": 0}
    for i in range(3):
        model.zero_grad(set_to_none=True)
        with torch.random.fork_rng(devices=[]), saved_activation_bytes(model) as saved:
            torch.manual_seed(0)  # the same dropout masks with and without checkpointing
            t0 = time.perf_counter()
            with forward_kept_bytes(model, batch) if i == 0 else contextlib.nullcontext(kept) as kept:
                loss = task.loss(model, batch)
            loss.backward()
            if i:
                best = min(best, time.perf_counter() - t0)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return saved["bytes"], kept["bytes"], best, grads


def checkpointing_probe(task, device: torch.device, enable: Callable[[nn.Module], object],
                        disable: Callable[[nn.Module], object]) -> dict[str, float]:
    """What activation checkpointing saves and costs on one batch of task.model, before prepare(): saved-for-backward
    bytes without and with it (autograd's saved tensors; selective checkpointing keeps its op outputs elsewhere, so
    the bytes forward leaves alive for backward too), the step-time ratio, and the largest gradient difference
    (0 up to float rounding).

    `enable` / `disable` are the recipe's own switches; the model is left without checkpointing, on `device`.
    """
    model = task.model.to(device).train()
    batch = {k: v.to(device) for k, v in next(iter(task.train_dataloader)).items()}
    plain_bytes, plain_kept, plain_s, plain_grads = _one_step(task, model, batch)
    enable(model)
    ckpt_bytes, ckpt_kept, ckpt_s, ckpt_grads = _one_step(task, model, batch)
    disable(model)
    return {
        "activation_bytes_without_checkpointing": plain_bytes,
        "activation_bytes_with_checkpointing": ckpt_bytes,
        "activation_bytes_saved": plain_bytes - ckpt_bytes,
        "forward_kept_bytes_without_checkpointing": plain_kept,
        "forward_kept_bytes_with_checkpointing": ckpt_kept,
        "step_time_ratio_vs_no_checkpointing": ckpt_s / plain_s,
        "max_abs_grad_diff_vs_no_checkpointing": max(
            (a - b).abs().max().item() for a, b in zip(plain_grads, ckpt_grads, strict=True)),
    }


def observe_compute_dtype(model: nn.Module) -> Callable[[], str | None]:
    """The dtype the first Linear layer really computes in (autocast included); read it after a forward.

    Skipped: LoRA adapters, which PEFT keeps in fp32 on a bf16 / fp16 base by design (autocast_adapter_dtype), and
    bitsandbytes layers, which cast their output back to their input's dtype whatever they computed in.
    """
    seen: dict[str, str] = {}
    linear = next((m for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lora_" not in n
                   and type(m).__name__ not in ("Linear4bit", "Linear8bitLt")), None)
    if linear is None:
        return lambda: None

    def hook(_module, _inputs, output):
        seen.setdefault("dtype", str(output.dtype).replace("torch.", ""))

    handle = linear.register_forward_hook(hook)

    def read() -> str | None:
        handle.remove()
        return seen.get("dtype")

    return read


def compiled_modules(model: nn.Module) -> int:
    """How many modules run compiled: wrapped by torch.compile (an OptimizedModule, as Accelerate's regional and
    full compilation return) or compiled in place with module.compile() (Accelerate's FSDP2 and DeepSpeed paths)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return sum(isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def compile_times(first_step_s: float | None, step_times: list[float]) -> dict[str, float | None]:
    """What compiling cost, for every run (compiled or not, so they compare): `steady_step_s`, the median of the
    steps after the first (a recompile at a later step, e.g. a new batch shape, does not move it), and `compile_s`,
    the first step's wall time minus that steady time: the one-off cost of the first step (tracing and code
    generation under --torch_compile; in an eager run only the allocator's and the kernels' warm-up)."""
    if first_step_s is None or not step_times:
        return {"first_step_s": first_step_s, "steady_step_s": None, "compile_s": None}
    steady = statistics.median(step_times)
    return {"first_step_s": first_step_s, "steady_step_s": steady, "compile_s": max(0.0, first_step_s - steady)}


# ---------------------------------------------------------------- the training-loop meter


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
        self.state: dict[str, int] | None = None
        self.extras: dict[str, object] = {}
        self.step_loss: torch.Tensor | None = None  # the last recorded step's loss
        # Steps with a non-finite loss, counted on the device and read (all processes summed) only when the meter
        # logs: no step that does not log waits on the host or on a collective for it (shared/core/guard.py).
        self._nonfinite = torch.zeros((), device=accelerator.device)
        self.nonfinite_steps = 0  # as of the last logging step, all processes
        self.logged_window: tuple[int, int] | None = None  # the optimizer steps (1-based) the last logging covered
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
        self.bar = bar
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

    def record(self, step: int, loss: torch.Tensor, batches: dict | list[dict]) -> None:
        """Call once per optimizer step, after optimizer.step() and before zero_grad(): state bytes are counted on
        the first call, while parameters, gradients and optimizer state all exist."""
        batches = batches if isinstance(batches, list) else [batches]
        if not self._warmup:  # the same steps as the timing
            self.samples += sum(len(b["labels"]) for b in batches)
            self.tokens += sum(self.task.tokens_in(b) for b in batches)
        if self.state is None:
            self.state = state_bytes(self.model, self.optimizer)
        self.step_loss = loss.detach().float()
        self._nonfinite += (~torch.isfinite(self.step_loss)).any()
        self.window.append(self.step_loss)
        if len(self.window) >= self.launch.args.logging_steps or step + 1 == self.bar.total:
            self._log(step + 1)

    def _log(self, step: int) -> None:
        # One collective, summed over processes: the window's mean loss, the non-finite count (shared/core/guard.py) and
        # which processes received a preemption signal (shared/core/checkpoint.py): a step that does not log has none.
        window = torch.stack(self.window).mean().to(self.accelerator.device)
        signals = [float(local_signal() == s) for s in PREEMPTION_SIGNALS]
        values = torch.stack([window, self._nonfinite.float(), *torch.tensor(signals, device=window.device)])
        total, nonfinite, *received = self.accelerator.reduce(values, "sum").tolist()
        agree_on_signal(received)
        mean = total / self.accelerator.num_processes
        self.nonfinite_steps = int(nonfinite)
        self.logged_window = (step - len(self.window) + 1, step)
        if self.initial_loss is None:
            self.initial_loss = self.window[0].item()
        self.window.clear()
        self.last_loss = mean
        self.memory_trace.append(current_memory_bytes(self.accelerator.device))
        lr = self.optimizer.param_groups[0]["lr"]
        self.accelerator.log({"train/loss": mean, "train/lr": lr}, step=step)
        self.bar.set_postfix(loss=f"{mean:.4f}", lr=f"{lr:.2e}")

    def summary(self) -> dict[str, object]:
        """The measured fields of results.json; memory figures are lists indexed by process rank."""
        from accelerate.utils import gather_object

        per_process = {"peak_memory_bytes": peak_memory_bytes(self.accelerator.device), **(self.state or {}),
                       "param_fingerprint": param_fingerprint(self.model)}
        gathered = gather_object([per_process])
        fields = {k: [g[k] for g in gathered] for k in per_process}
        totals = self.accelerator.reduce(
            torch.tensor([self.samples, float(self.tokens)], dtype=torch.float64, device=self.accelerator.device),
            "sum")
        seconds = self.elapsed or float("nan")
        return {
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
            "optimizer_class": type(stepping_optimizer(self.optimizer)).__name__,
            "memory_trace_bytes": self.memory_trace,
            **fields,
        }

