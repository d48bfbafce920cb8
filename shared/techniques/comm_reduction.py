"""Less gradient traffic for data parallel: DDP communication hooks (Accelerate's DistributedDataParallelKwargs
comm_hook: fp16 / bf16 compression, PowerSGD low-rank compression) or LocalSGD (accelerate.local_sgd: replicas step
on their own gradients, parameters averaged every K steps), and the bytes each all-reduces, counted as they are sent.

Accelerate registers the hook in prepare() on any multi-process run, CPU / gloo included (Accelerator.prepare_model:
`self.ddp_handler.register_comm_hook(model)`), and LocalSGD accepts MULTI_CPU: no shim is needed on this stack.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..core import rules
from ..core.rules import Rule

HOOKS = tuple(h.value for h in DDPCommunicationHookType)  # no, fp16, bf16, power_sgd, batched_power_sgd
# The modules whose all_reduce calls are the gradients' (DDP's hooks) or the parameters' (LocalSGD's average).
_SENDERS = ("torch.distributed.algorithms.ddp_comm_hooks", "accelerate.local_sgd")
_counters: list[AllreduceBytes] = []


def powersgd_options(hook: str, rank: int, start_iter: int) -> dict:
    """Accelerate's comm_state_option: the keyword arguments of torch's PowerSGDState (its process group: WORLD)."""
    if "power_sgd" not in hook:
        return {}
    return {"matrix_approximation_rank": rank, "start_powerSGD_iter": start_iter}


def _counting_all_reduce(original: Callable) -> Callable:
    def all_reduce(tensor, *args, **kwargs):
        if _counters:
            frame, sender = sys._getframe(1), False
            for _ in range(12):  # LocalSGD reaches torch through accelerator.reduce: a few frames up
                if frame is None:
                    break
                if frame.f_globals.get("__name__", "").startswith(_SENDERS):
                    sender = True
                    break
                frame = frame.f_back
            if sender:
                for counter in _counters:
                    counter.sent += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    all_reduce.counts_bytes = True
    return all_reduce


class AllreduceBytes:
    """Bytes all-reduced for the gradients (by the DDP hook) or the parameters (LocalSGD's average), per step.

    Counted where torch's hooks and Accelerate's LocalSGD call torch.distributed.all_reduce, at each call (the hooks
    look it up then): what really went out, compressed or not. DDP's own all-reduce runs in C++, unseen: `watch`.
    """

    def __init__(self, ddp: DistributedDataParallelKwargs):
        self.sent, self.by_step, self._mark = 0, [], 0
        self.hook, self.options = DDPCommunicationHookType(ddp.comm_hook).value, dict(ddp.comm_state_option)
        if not getattr(dist.all_reduce, "counts_bytes", False):  # the hooks look dist.all_reduce up at each call
            dist.all_reduce = _counting_all_reduce(dist.all_reduce)
        _counters.append(self)
        self._step_hook = register_optimizer_step_post_hook(self._step_done)

    def watch(self, model: torch.nn.Module) -> None:
        """After prepare(): plain DDP (no hook) gets torch's allreduce_hook, its built-in all-reduce in Python, so
        that its bytes are counted too. Accelerate registered the asked hook already (DDP takes only one)."""
        model = getattr(model, "_orig_mod", model)  # under --torch_compile, prepare() compiled the DDP model
        if self.hook == "no" and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.register_comm_hook(state=None, hook=default_hooks.allreduce_hook)

    def _step_done(self, *_) -> None:
        self.by_step.append(self.sent - self._mark)
        self._mark = self.sent

    def summary(self, model: torch.nn.Module, num_processes: int) -> dict[str, object]:
        """results.json fields, beside plain DDP's: every trainable gradient once per step, in its own dtype."""
        self._step_hook.remove()
        _counters.remove(self)
        steps = max(1, len(self.by_step))
        plain = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        plain = plain if num_processes > 1 else 0
        per_step = self.sent / steps
        return {"comm_hook": self.hook, **{f"powersgd_{k}": v for k, v in self.options.items()},
                "allreduce_bytes_per_step": per_step, "allreduce_bytes_total": self.sent,
                "allreduce_bytes_first_step": self.by_step[0] if self.by_step else 0,
                "allreduce_bytes_last_step": self.by_step[-1] if self.by_step else 0,
                "allreduce_bytes_plain_ddp_per_step": plain,
                "allreduce_vs_plain_ddp": per_step / plain if plain else None}


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # Communication reduction (shared/techniques/comm_reduction.py): each would otherwise do nothing, silently.
    Rule(lambda r: (r.comm_hook != "no" or r.local_sgd_steps > 0) and r.num_processes < 2,
         lambda r: ("--local_sgd_steps" if r.local_sgd_steps else f"--comm_hook {r.comm_hook}") + " with one process: "
                   "nothing is all-reduced (Accelerate wraps no DDP model, and LocalSGD turns itself off)",
         lambda r: "launch 2 or more processes (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml), or drop the flag"),
    Rule(lambda r: r.comm_hook != "no" and r.local_sgd_steps > 0,
         lambda r: f"--comm_hook {r.comm_hook} with --local_sgd_steps: LocalSGD runs DDP under no_sync, so no "
                   "gradient is all-reduced and the hook never runs",
         lambda r: "pick one: --comm_hook to send every step's gradients compressed, or --local_sgd_steps"),
    Rule(lambda r: bool(r.powersgd_typed) and "power_sgd" not in r.comm_hook,
         lambda r: f"{r.powersgd_typed} tune PowerSGD, and --comm_hook {r.comm_hook} does not run it",
         lambda r: "add --comm_hook power_sgd (or batched_power_sgd), or drop them"),
    Rule(lambda r: r.comm_hook == "bf16" and not r.on_accelerator,  # though gloo all-reduces bf16 (tried here)
         lambda r: "--comm_hook bf16 on a CPU-only machine: torch's DDP refuses bf16_compress_hook without CUDA "
                   "and NCCL 2.10+ (or XPU and XCCL)",
         lambda r: "use --comm_hook fp16 (the same 2 bytes a value) on CPU, bf16 on GPUs"),
    Rule(lambda r: "power_sgd" in r.comm_hook and 0 < r.train_steps <= r.powersgd_start,
         lambda r: f"--max_train_steps {r.train_steps} with --powersgd_start_iter {r.powersgd_start}: PowerSGD sends "
                   "plain fp32 gradients before that step, so this run would never compress",
         lambda r: f"pass --powersgd_start_iter below {r.train_steps} (at least 2; torch suggests 10% of the steps)"),
    Rule(lambda r: r.local_sgd_steps > 0 and r.checkpoints,
         lambda r: "--local_sgd_steps with checkpoints: each process steps its own AdamW moments between averages, "
                   "and a checkpoint keeps process 0's, so a resumed run would not continue the saved one",
         lambda r: "drop --checkpointing_steps / --resume_from_checkpoint, or use --comm_hook (replicas always equal)"),
)
rules.register(*RULES, fields=dict(
    comm_hook="no", local_sgd_steps=0, powersgd_start=0, powersgd_typed="", train_steps=0, checkpoints=False))
