"""Measuring probes of the memory techniques, imported only by the recipes and tests that show them: bytes autograd
saves for backward, bytes forward leaves alive (selective checkpointing's cache included), what activation
checkpointing saves and costs on one batch, and how much optimizer state a low-bit optimizer really quantized."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..core.measure import _local, _storage, stepping_optimizer


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
