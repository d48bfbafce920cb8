"""Activation offloading: the tensors autograd saves for backward go to host memory (or disk) in forward and come
back in backward, through torch's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks), as torchtune's
OffloadActivations and TRL's get_act_offloading_ctx_manager do.

Modes:
  all           every saved tensor of at least `min_bytes` (parameters, views of them and the model's own inputs
                stay: they live on the device anyway, so moving them would free nothing).
  checkpointed  on top of HF activation checkpointing (non-reentrant): only what a checkpointed block saves, its
                inputs (torch's checkpoint saves them through the outer hooks; everything inside the block is
                recomputed). Hooks on the blocks say when a forward is inside one: HF checkpoints `forward`, not
                `__call__`, so module hooks run outside the checkpoint and never again in the recompute.
Where to: "cpu" (pinned memory and a side stream on CUDA, so the copies overlap compute; the next tensor backward
needs is brought back while the current one is used), or "disk" (checkpointed mode only: one file per block input in
`disk_dir`, as axolotl's disk offload, removed once read back and at close / exit).

On a CPU-only machine the same code runs, and the "host" copy lives in the same memory as the "device" tensor: the
ledger then shows what would leave the device (bytes counted on live tensors), not a saving.

Interface (recipes/activation_offloading.py, recipes/combined.py --activation_offloading, benchmarks):
    offloader = ActivationOffloader(model, mode="all", min_bytes=MIN_BYTES, to="cpu", disk_dir=None)
    with offloader:                      # around the forward (and loss); backward may run inside or after
        loss = task.loss(model, batch)
    loss.backward()
    offloader.attach()                   # or: every forward of the model runs under the hooks, the loop as it is
    offloader.ledger.summary()           # device bytes kept / host bytes offloaded: live now, peak; tensor counts
    offloader.close()                    # hooks removed, disk files deleted (also at exit)
or, for one step, `with offload_activations(model, "all", MIN_BYTES) as ledger: forward; backward`.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..core import rules
from ..core.models import transformer_layers
from ..core.rules import Rule

MODES = ("all", "checkpointed")
TARGETS = ("cpu", "disk")
# Tensors below this many bytes stay on the device: there the hooks' fixed cost is more than the bytes' own. Measured
# by benchmarks/activation_offloading.py (2 CPU cores shared with other jobs, torch 2.13 CPU, one thread): a round
# trip through these hooks costs 26.5 us fixed plus 1.33 ns a byte (1 to 16 MiB), even at 20 KB; rounded up to 32 KiB.
# The GPU's figure (pinned copies over PCIe) comes from benchmarks/gpu_check.py's offload check.
MIN_BYTES = 32768


@dataclass
class Ledger:
    """Bytes of the saved activations (weights and the batch not counted), on live ones (packed and not yet freed by
    backward), each saved view once."""

    device_bytes: int = 0  # activations left on the device (below min_bytes, or outside the checkpointed blocks)
    host_bytes: int = 0  # moved to host memory or disk
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    offloaded: int = 0  # tensors moved (this forward)
    kept: int = 0  # tensors left (this forward)
    copy_seconds: float = 0.0  # host time spent in the copies (on CUDA the copies themselves run on a side stream)

    def add(self, device: int = 0, host: int = 0) -> None:
        self.device_bytes += device
        self.host_bytes += host
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def summary(self) -> dict[str, float]:
        return {f"offload_{k}": v for k, v in vars(self).items()}


class _Saved:
    """What autograd holds instead of one saved tensor: the tensor itself (kept), or its host copy or file (moved).
    It lives exactly as long as autograd needs the saved tensor, so its end is when the ledger counts it gone."""

    def __init__(self, ledger: Ledger, nbytes: int, kept: torch.Tensor | None = None):
        self.ledger, self.nbytes, self.kept = ledger, nbytes, kept
        self.host = self.path = self.device = self.event = self.src = self.ready = self.id = None
        ledger.add(**{"device" if kept is not None else "host": nbytes})

    def __del__(self) -> None:
        self.ledger.add(**{"device" if self.kept is not None else "host": -self.nbytes})
        if self.path is not None:
            with contextlib.suppress(OSError):  # read back: the file goes (close() sweeps what is left)
                os.remove(self.path)


class ActivationOffloader:
    """Saved-tensor hooks that move saved activations off the device; see the module docstring."""

    def __init__(self, model: nn.Module, mode: str = "all", min_bytes: int = MIN_BYTES, to: str = "cpu",
                 disk_dir: str | None = None):
        if mode not in MODES or to not in TARGETS:
            raise ValueError(f"mode must be one of {MODES} and to one of {TARGETS}, got {mode!r}, {to!r}")
        if to == "disk" and (not disk_dir or mode != "checkpointed"):
            raise ValueError("disk offload needs a directory (--offload_dir) and --offload_mode checkpointed: it "
                             "writes one file per checkpointed block input, not one per saved tensor")
        self.model, self.mode, self.min_bytes, self.to = model, mode, min_bytes, to
        self.ledger = Ledger()
        if to == "disk":
            os.makedirs(disk_dir, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="activations-", dir=disk_dir) if to == "disk" else None
        self.cuda = torch.cuda.is_available()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.ids = itertools.count()
        self.shared: dict[tuple, tuple[StorageWeakRef, weakref.ref]] = {}  # a view saved twice is handled once
        self.live: dict[int, weakref.ref] = {}  # moved tensors by pack order, for the prefetch in backward
        self.in_flight: list[_Saved] = []  # device tensors kept alive until their copy to the host is done
        self.inputs: set[int] = set()  # storages of the forward's own inputs (the batch)
        self.depth = 0  # > 0: inside a checkpointed block's call
        self.hooks = [model.register_forward_pre_hook(self._note_inputs, with_kwargs=True)]
        if mode == "checkpointed":
            layers = [m for m in transformer_layers(model) if getattr(m, "gradient_checkpointing", False)]
            if not layers:
                raise ValueError("--offload_mode checkpointed offloads the inputs of checkpointed blocks, and no "
                                 "block is checkpointed: call model.gradient_checkpointing_enable("
                                 "gradient_checkpointing_kwargs={'use_reentrant': False}) first, or use mode all")
            for layer in layers:
                self.hooks += [layer.register_forward_pre_hook(self._enter), layer.register_forward_hook(self._leave)]
        self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        atexit.register(self.close)

    # ---- where a forward is
    def _note_inputs(self, _module, args, kwargs) -> None:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        self.inputs = {t.untyped_storage().data_ptr() for t in leaves
                       if torch.is_tensor(t) and not is_traceable_wrapper_subclass(t)}

    def _enter(self, *_) -> None:
        self.depth += 1

    def _leave(self, *_) -> None:
        self.depth -= 1

    def __enter__(self) -> ActivationOffloader:
        self.ledger.offloaded = self.ledger.kept = 0
        self.live = {i: r for i, r in self.live.items() if r() is not None}  # the last step's, freed by its backward
        self.shared = {k: v for k, v in self.shared.items() if v[1]() is not None}
        self.saving.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.saving.__exit__(*exc)
        self._settle(wait=True)

    def attach(self) -> ActivationOffloader:
        """Enter around every forward of the model by its own hooks, for a loop left as it is (recipes/combined.py);
        what runs outside the model's forward (a loss computed after it) then saves its tensors as usual."""
        def enter(*_) -> None:
            self.__enter__()

        def leave(*_) -> None:
            self.__exit__(None, None, None)

        self.hooks += [self.model.register_forward_pre_hook(enter), self.model.register_forward_hook(leave)]
        return self

    # ---- the hooks
    def _stays(self, t: torch.Tensor) -> str:
        """Why `t` stays on the device ("": it moves). "weights" and "input" are no activations: not counted."""
        if is_traceable_wrapper_subclass(t) or t.layout != torch.strided or t.device.type == "meta":
            return "weights"  # shards and quantized wrappers: their storage is not ours to copy
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return "weights"  # they live on the device anyway
        if t.untyped_storage().data_ptr() in self.inputs:
            return "input"  # the batch: the loop holds it
        if self.cuda and not t.is_cuda:
            return "on host"
        if self.mode == "checkpointed" and self.depth == 0:
            return "outside"  # outside a checkpointed block: the embeddings, head and loss
        return "small" if t.numel() * t.element_size() < self.min_bytes else ""

    def _pack(self, t: torch.Tensor) -> _Saved:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        old = self.shared.get(key)
        if old is not None and not old[0].expired() and old[1]() is not None:
            return old[1]()
        n = t.numel() * t.element_size()
        why = self._stays(t)
        if why:
            self.ledger.kept += why not in ("weights", "input")
            saved = _Saved(self.ledger, 0 if why in ("weights", "input") else n, kept=t)
        else:
            t0 = time.perf_counter()
            saved = _Saved(self.ledger, n)
            saved.device, saved.id = t.device, next(self.ids)
            i = saved.id
            if self.to == "disk":
                saved.path = os.path.join(self.dir, f"{i}.pt")
                torch.save(t.detach().cpu(), saved.path)  # a plain tensor: loads with weights_only=True
            elif self.cuda:
                self._settle(wait=False)
                self.stream.wait_stream(torch.cuda.current_stream())  # t is complete before the copy reads it
                with torch.cuda.stream(self.stream):
                    saved.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    saved.host.copy_(t, non_blocking=True)
                saved.event, saved.src = self.stream.record_event(), t  # t is let go once the copy is done
                self.in_flight.append(saved)
            else:  # CPU only: the same path, a copy within the same memory (nothing is freed for real)
                saved.host = t.detach().clone()
            self.live[i] = weakref.ref(saved)
            self.ledger.offloaded += 1
            self.ledger.copy_seconds += time.perf_counter() - t0
        self.shared[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(saved))
        return saved

    def _settle(self, wait: bool) -> None:
        """Let go of the device tensors whose copy to the host is done (all of them when `wait`)."""
        while self.in_flight and (wait or self.in_flight[0].event.query()):
            saved = self.in_flight.pop(0)
            torch.cuda.current_stream().wait_event(saved.event)  # its memory is not reused before the copy ends
            saved.src = None

    def _fetch(self, saved: _Saved) -> torch.Tensor:
        if saved.path is not None:
            return torch.load(saved.path, weights_only=True).to(saved.device)
        if not self.cuda:
            return saved.host
        with torch.cuda.stream(self.stream):
            return saved.host.to(saved.device, non_blocking=True)

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        if saved.kept is not None:
            return saved.kept
        t0 = time.perf_counter()
        back, saved.ready = saved.ready if saved.ready is not None else self._fetch(saved), None
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
            back.record_stream(torch.cuda.current_stream())  # made on the side stream, used on this one
            # Prefetch: backward reads saved tensors about in reverse order, so the one packed before is likely next.
            earlier = [i for i, r in self.live.items() if i < saved.id and r() is not None and r().ready is None]
            if earlier:
                nxt = self.live[max(earlier)]()
                nxt.ready = self._fetch(nxt)
        self.ledger.copy_seconds += time.perf_counter() - t0
        return back

    def close(self) -> None:
        """Remove the hooks and any file left on disk (a forward without its backward leaves some)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.in_flight.clear()
        if self.dir and os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def offload_activations(model: nn.Module, mode: str = "all", min_bytes: int = MIN_BYTES,
                        disk_dir: str | None = None) -> Iterator[Ledger]:
    """One step's offloading: run forward and backward inside; yields the ledger (to disk when disk_dir is given)."""
    offloader = ActivationOffloader(model, mode, min_bytes, "disk" if disk_dir else "cpu", disk_dir)
    try:
        with offloader:
            yield offloader.ledger
    finally:
        offloader.close()


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # Activation offloading (techniques/activation_offload.py): DeepSpeed's engine was not run with the hooks here.
    Rule(lambda r: bool(r.activation_offload) and r.sharding.startswith("zero"),
         lambda r: f"{r.flag('activation_offload')} under DeepSpeed ZeRO-{r.sharding[-1]}: the saved-tensor hooks have "
                   "not been run with DeepSpeed's engine (its ZeRO-3 parameter hooks) here",
         lambda r: "use one process, DDP or FSDP2 (accelerate_configs/multi_cpu.yaml, fsdp.yaml)"),
    Rule(lambda r: r.activation_offload == "checkpointed" and r.checkpointing is False,
         lambda r: f"{r.flag('activation_offload')} moves the inputs of checkpointed blocks, and none is checkpointed",
         lambda r: f"add {r.flag('checkpointing')}, or pass {r.flag('activation_offload').split()[0]} all"),
    Rule(lambda r: r.activation_offload_to == "disk" and (not r.activation_offload_dir
                                                          or r.activation_offload != "checkpointed"),
         lambda r: "--offload_to disk writes one file per checkpointed block input: it needs --offload_dir and "
                   "--offload_mode checkpointed",
         lambda r: "pass --offload_dir DIR (a local disk with room for one step's block inputs) and --offload_mode "
                   "checkpointed, or --offload_to cpu"),
)
rules.register(*RULES, fields=dict(
    activation_offload="", activation_offload_to="cpu", activation_offload_dir=False, checkpointing=None), late=True)
