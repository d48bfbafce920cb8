"""FP8 training through Accelerate (torchao's float8): which Linears became Float8Linear, which stayed in high
precision and why, and the checks that the run really is fp8 rather than a silent bf16 / fp32 fallback.

The conversion rule is Accelerate's own default (accelerate.utils.ao.filter_linear_layers, applied in
Accelerator.prepare by convert_model_to_fp8_ao): every nn.Linear becomes a Float8Linear, except
  - the first and the last nn.Linear in module order (find_first_last_linear_layers): the layers next to the
    embeddings and the head, where FP8's error hurts convergence most;
  - any Linear whose in_features or out_features is not a multiple of 16 (torch._scaled_mm's alignment), e.g. a
    classifier with 2 labels.
Embeddings, LayerNorms, convolutions and GPT-2's Conv1D are not nn.Linear and are never converted. Everything that
stays in high precision runs under the bf16 autocast that Accelerate's mixed_precision="fp8" also turns on.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from accelerate.utils.ao import find_first_last_linear_layers

from ..core import results, rules
from ..core.errors import LaunchError
from ..core.rules import Rule
from . import quant  # noqa: F401  (its rule on weights outside nn.Linear)

FIRST_LAST = "first or last Linear"
NOT_16 = "in/out features not multiples of 16"


def layer_precisions(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """(names of the Float8Linear modules, {name of each nn.Linear kept in high precision: why})."""
    from torchao.float8.float8_linear import Float8Linear

    first, last = find_first_last_linear_layers(model)  # Float8Linear is an nn.Linear: same answer after prepare
    converted, kept = [], {}
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            converted.append(name)
        elif isinstance(module, torch.nn.Linear):
            kept[name] = NOT_16 if module.in_features % 16 or module.out_features % 16 else (
                FIRST_LAST if name in (first, last) else "not converted (another filter)")
    return converted, kept


def check_fp8_resolved(accelerator: Accelerator) -> None:
    """Right after Accelerator(...): Accelerate turns fp8 into fp16 on a GPU older than Ada/Hopper (a warning, no
    error). On this CPU-only stack (Accelerate 1.15, torchao 0.18, torch 2.13) it keeps fp8 with the AO backend, and
    torch._scaled_mm runs on the CPU; either way a run that is not fp8 stops here instead of training something else."""
    from accelerate.utils.dataclasses import FP8BackendType

    backend = accelerator.fp8_backend
    rules.check_built("fp8", resolved_precision=accelerator.mixed_precision,
                      fp8_backend=backend.name if isinstance(backend, FP8BackendType) else str(backend))


def check_fp8_launch_config(env: dict[str, str] | None = None) -> None:
    """A launch config's fp8_config (`accelerate launch` passes it as ACCELERATE_FP8_*): this recipe runs torchao's
    float8 (backend AO, AORecipeKwargs), so another backend, or settings only another backend reads, are refused
    rather than dropped (Accelerate would quietly take the recipe's AO handler over the config)."""
    import importlib.util
    import os

    env = os.environ if env is None else env
    backend = env.get("ACCELERATE_FP8_BACKEND", "AO").upper()
    if backend != "AO":
        installed = "installed" if importlib.util.find_spec("transformer_engine") else "not installed"
        raise LaunchError(f"fp8_config backend: {backend} in the launch config: recipes/fp8.py runs torchao's float8 "
                          f"(backend AO, installed: torchao); Transformer Engine is {installed} here and not wired "
                          "into these recipes. Set backend: AO in fp8_config and remove the other backend's keys, "
                          "or remove fp8_config.")
    if others := sorted(k for k in env if k.startswith("ACCELERATE_FP8_") and k != "ACCELERATE_FP8_BACKEND"):
        keys = ", ".join(k.removeprefix("ACCELERATE_").lower() for k in others)
        raise LaunchError(f"{keys} in the launch config's fp8_config: Transformer Engine's or MS-AMP's settings, "
                          "which torchao's float8 (the backend this recipe runs) does not read. Remove them.")


def fp8_summary(accelerator: Accelerator, model: torch.nn.Module) -> dict:
    """After prepare: the results.json fields. Stops when nothing was converted (e.g. GPT-2, whose blocks are Conv1D,
    not nn.Linear): that run would be plain bf16 under an fp8 label."""
    from .quant import weights_outside_linear

    inner = accelerator.unwrap_model(model)
    converted, kept = layer_precisions(inner)
    rules.check_built("fp8", fp8_converted=len(converted), fp8_kept=str(kept or ""))
    # A mixture of experts' experts are not nn.Linear: they would run in bf16 under the fp8 label.
    rules.check_built("fp8", model_type=inner.config.model_type, linear_only="converts to Float8Linear",
                      outside_linear=weights_outside_linear(inner))
    return {"fp8_backend": "AO (torchao float8, AORecipeKwargs)", "fp8_linears": len(converted),
            "fp8_linear_names": converted, "kept_high_precision": kept}


def save_fp8_model(accelerator: Accelerator, model: torch.nn.Module, task, output_dir: str) -> None:
    """finish()'s save with each float8 weight as the weight it holds: Accelerate's default Float8LinearConfig
    (enable_fsdp_float8_all_gather) wraps it in torchao's WeightWithDynamicFloat8CastTensor, whose own storage is
    invalid, and save_pretrained, reading storage pointers to find ties, failed on it."""
    results.save_model(accelerator, model, task, output_dir, plain=_plain)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor inside a wrapper subclass that holds one; any other as it is."""
    from torch.distributed.tensor import DTensor

    if type(tensor) is torch.Tensor or isinstance(tensor, DTensor) or not hasattr(tensor, "__tensor_flatten__"):
        return tensor
    inner, _ = tensor.__tensor_flatten__()
    return getattr(tensor, inner[0]) if len(inner) == 1 else tensor


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # Accelerate turns fp8 into fp16 on a GPU older than Ada/Hopper with a warning, no error.
    # (resolved_precision: given by check_fp8_resolved alone, in a recipe that asked for fp8)
    Rule(lambda r: bool(r.resolved_precision) and (r.resolved_precision != "fp8" or r.fp8_backend != "AO"),
         lambda r: f"recipes/{r.recipe}.py asked for fp8 with torchao, and Accelerate resolved mixed_precision="
                   f"{r.resolved_precision!r}, backend {r.fp8_backend}: this device has no FP8 support (a GPU needs "
                   "compute capability 8.9+: Ada or Hopper)",
         lambda r: "use recipes/mixed_precision.py --mixed_precision bf16 instead", built=True),
    Rule(lambda r: r.fp8_converted == 0,
         lambda r: "no nn.Linear was converted to Float8Linear (the model's Linears kept: "
                   f"{r.fp8_kept or 'none'}; GPT-2's blocks are Conv1D, not nn.Linear), so this would train in plain "
                   "bf16",
         lambda r: "use a model built from nn.Linear (BERT, ViT, Llama), or recipes/mixed_precision.py "
                   "--mixed_precision bf16", built=True),
)
rules.register(*RULES, fields=dict(resolved_precision="", fp8_backend="", fp8_converted=-1, fp8_kept="", model_type=""))
