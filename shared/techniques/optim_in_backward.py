"""The optimizer step fused into backward: one optimizer per parameter, stepped by that parameter's
post-accumulate-grad hook, which then frees the gradient. At most one parameter's gradient is alive at a time, so
the whole model's gradients never exist together (torch's tutorial "How to save memory by fusing the optimizer step
into the backward pass"; torchtune's `optimizer_in_bwd`).

`OptimizerInBackward` holds the per-parameter optimizers behind one torch Optimizer, so that the rest of a recipe
stays as it is: one LR scheduler drives them all (it sets `lr` in `param_groups`, which are the per-parameter
optimizers' own groups), and `accelerator.prepare` / `save_state` / `load_state` see one optimizer whose state dict
holds every per-parameter state. The recipe registers `step_param` as each parameter's hook, in plain sight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..core import rules
from ..core.rules import Rule, launch_words


def live_grad_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes of the gradients alive now on these parameters, each storage once."""
    storages = {}
    for p in params:
        if p.grad is not None:
            s = p.grad.untyped_storage()
            storages[(str(p.grad.device), s.data_ptr())] = s.nbytes()
    return sum(storages.values())


class OptimizerInBackward(torch.optim.Optimizer):
    """`optimizer_cls` per parameter (same groups and hyperparameters as one optimizer over them all).

    Stepped only by `step_param`, from the parameter's post-accumulate-grad hook; `step()` refuses. Like
    Accelerate's AcceleratedOptimizer it does not call Optimizer.__init__: it holds no params or state of its own.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, **defaults: Any):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.defaults = {"lr": lr, **defaults}
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            hyper = {**self.defaults, **{k: v for k, v in group.items() if k != "params"}}
            for p in group["params"]:
                if p in self.optimizers:
                    raise ValueError("a parameter appears in two parameter groups")
                self.optimizers[p] = optimizer_cls([p], **hyper)
        self.peak_grad_bytes = 0  # the most gradient bytes alive at any hook, over the run

    # ---- what the hooks call

    def step_param(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: step this parameter with its finished gradient, then free the gradient."""
        # Counted on the live tensors at the moment the most gradients can exist: this one is complete, and any
        # other still alive would be counted too.
        self.peak_grad_bytes = max(self.peak_grad_bytes, live_grad_bytes(self.optimizers))
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._opt_called = True  # what LRScheduler checks, on its first step, to warn of a missed optimizer.step()

    def step(self, closure: Callable[[], float] | None = None) -> None:
        raise RuntimeError("OptimizerInBackward steps each parameter in its post-accumulate-grad hook (step_param), "
                           "during backward: a training loop must not call optimizer.step().")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    # ---- what schedulers, meters and checkpoints read

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        # The per-parameter optimizers' own group dicts: a scheduler's `group["lr"] = ...` reaches them.
        return [g for optimizer in self.optimizers.values() for g in optimizer.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        return {p: s for optimizer in self.optimizers.values() for p, s in optimizer.state.items()}

    def state_dict(self) -> dict[str, Any]:
        """Every per-parameter optimizer's state dict, in parameter order."""
        return {"per_parameter": [optimizer.state_dict() for optimizer in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("per_parameter")
        if saved is None or len(saved) != len(self.optimizers):
            found = "no per-parameter states" if saved is None else f"{len(saved)} per-parameter states"
            raise ValueError(f"this optimizer-in-backward state holds {found}, and the model has "
                             f"{len(self.optimizers)} trainable parameters: it was saved by another optimizer or "
                             "model. Resume with the recipe and model that saved it.")
        for optimizer, own in zip(self.optimizers.values(), saved, strict=True):
            optimizer.load_state_dict(own)

    def grad_bytes_report(self) -> dict[str, int]:
        """results.json fields: the peak gradient bytes the hooks saw, beside the whole model's gradient bytes (what
        an optimizer step after backward holds) and the largest single parameter's."""
        sizes = [p.numel() * p.element_size() for p in self.optimizers]
        return {"peak_grad_bytes": self.peak_grad_bytes, "full_model_grad_bytes": sum(sizes),
                "largest_param_bytes": max(sizes, default=0)}

    def __repr__(self) -> str:
        first = next(iter(self.optimizers.values()), None)
        return f"{type(self).__name__}({len(self.optimizers)} x {type(first).__name__})"


def _in_backward(run) -> bool:  # recipes/optimizer_in_backward.py, or combined.py --optimizer_in_backward
    return run.optimizer == "adamw_in_backward" or run.in_backward


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # The optimizer step in backward (recipes/optimizer_in_backward.py): a parameter steps, and its gradient is freed,
    # the moment that gradient is complete, so nothing can look at all the gradients first, or add to them later.
    Rule(lambda r: _in_backward(r) and r.accumulation > 1,
         lambda r: f"--gradient_accumulation_steps {r.accumulation} with the optimizer step in backward: each "
                   "parameter steps, and its gradient is freed, as soon as that gradient is computed, so there is no "
                   "gradient left to accumulate the next micro-batch into",
         lambda r: "drop the flag and raise --per_device_train_batch_size for a larger batch, or use "
                   "recipes/gradient_accumulation.py"),
    Rule(lambda r: _in_backward(r) and r.max_grad_norm > 0,
         lambda r: f"--max_grad_norm {r.max_grad_norm:g} with the optimizer step in backward: clipping by the global "
                   "norm needs every gradient before any parameter steps, and here each parameter steps (and frees "
                   "its gradient) as soon as its own gradient exists",
         lambda r: "pass --max_grad_norm 0 (this recipe's default), or use recipes/baseline.py to clip"),
    Rule(lambda r: _in_backward(r) and r.precision == "fp16",
         lambda r: "fp16 with the optimizer step in backward: the loss scaler must unscale every gradient and check "
                   "them all for inf/NaN before any parameter steps, and here each parameter steps inside backward "
                   "with its still-scaled gradient",
         lambda r: "use --mixed_precision bf16 (no loss scaling) or no"),
    Rule(lambda r: r.in_backward and r.sharding != "none",
         lambda r: f"{r.flag('in_backward')} under {launch_words(r)}: each parameter would step in its gradient hook "
                   "before the processes' gradients are averaged (DDP) or partitioned (ZeRO, FSDP)",
         lambda r: f"launch one process, or drop {r.flag('in_backward')} (ZeRO-2 shards the gradients instead)"),
)
rules.register(*RULES, fields=dict(in_backward=False))
