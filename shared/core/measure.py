"""Measuring functions, without state: bytes on live tensors, peak memory per process, the dtype a layer really
computed in, what was compiled. The loop's Meter calls them, and so do tests and benchmarks."""

from __future__ import annotations

import contextlib
import re
import resource
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# ---------------------------------------------------------------- bytes on live tensors

_CORE_PACKAGE = __package__.split(".")[0]  # "shared" (or "recipe_core" in a copy): its optimizers are walked


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
        # ZeRO-Offload keeps its fp32 gradient partition as the .grad of the fp32 partition, between steps too
        if obj.grad is not None:
            yield f"{path}.grad", obj.grad
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k if isinstance(k, (str, int)) else 'key'}", seen_objs, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _walk(v, path, seen_objs, depth + 1)
    # _CORE_PACKAGE: this core, under the name it was copied as (shared, or recipe_core in a copied-out recipe).
    elif type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "bitsandbytes", "accelerate", "torchao",
                                                "transformers", "peft", _CORE_PACKAGE, "__main__"):
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


def observe_compute_dtype(model: nn.Module) -> Callable[[], str | None]:
    """The dtype the first Linear layer really computes in (autocast included); read it after a forward.

    Skipped: LoRA adapters, which PEFT keeps in fp32 on a bf16 / fp16 base by design (autocast_adapter_dtype), and
    bitsandbytes layers, which cast their output back to their input's dtype whatever they computed in.
    """
    seen: dict[str, str] = {}
    linear = next((m for n, m in model.named_modules() if isinstance(m, nn.Linear) and "lora_" not in n
                   and type(m).__name__ not in ("Linear4bit", "Linear8bitLt")), None)
    if linear is None:
        def none() -> None:
            return None
        none.autocast = none
        return none

    def hook(_module, _inputs, output):
        seen.setdefault("dtype", str(output.dtype).replace("torch.", ""))
        device = output.device.type  # autocast as it was live in this forward (None: off)
        if "autocast" not in seen:
            seen["autocast"] = (str(torch.get_autocast_dtype(device)).replace("torch.", "")
                                if torch.is_autocast_enabled(device) else None)

    handle = linear.register_forward_hook(hook)

    def read() -> str | None:
        handle.remove()
        return seen.get("dtype")

    read.autocast = lambda: seen.get("autocast")  # the autocast dtype of that forward (None: no autocast)
    return read


def precision_dtypes(model: nn.Module, optimizer: object) -> dict[str, str | None]:
    """The dtypes training really used, read on live tensors after a step: the weights the model holds, the master
    weights the optimizer steps (DeepSpeed's fp32 partitions beside bf16 weights), and its state (AdamW's moments;
    a quantized optimizer's codes, or its state class). None where there is none (the state of a hook-stepped
    optimizer)."""
    def name(t: torch.Tensor | None) -> str | None:
        if t is None:
            return None
        t = _local(t)
        return type(t).__name__ if is_traceable_wrapper_subclass(t) else str(t.dtype).removeprefix("torch.")

    stepping = stepping_optimizer(optimizer)
    weights = next((p for p in model.parameters() if p.requires_grad), None)
    groups = getattr(stepping, "param_groups", None) or []
    master = next((p for g in groups for p in g["params"] if p.is_floating_point()), None)
    states = getattr(stepping, "state", None) or {}
    state = next((t for s in states.values() if isinstance(s, dict) for t in s.values()
                  if isinstance(t, torch.Tensor) and t.ndim > 0), None)
    return {"param_dtype": name(weights), "master_weights_dtype": name(master), "optimizer_state_dtype": name(state)}


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
