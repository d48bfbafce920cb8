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
