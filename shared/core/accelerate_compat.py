"""Accelerate's internals this project still needs, in one place, each with the reason and a check.

accelerate==1.15.0 is pinned (requirements.txt) and these are read or set as that version has them. Under another
version each is checked where it is used: still there and of the same kind, it is used (a warning says, once, that
the version is untested); gone or changed, the run is refused naming it, before it could do the wrong thing. Where
Accelerate has a public way, it is used instead (the installed trackers: accelerate.tracking.get_available_trackers).
"""

from __future__ import annotations

import logging

import accelerate
import torch

from .errors import LaunchError

TESTED = "1.15.0"
logger = logging.getLogger("recipes")
_warned = False


def _check(owner: object, attribute: str, kind: type, reason: str) -> None:
    """`owner.<attribute>` exists as a `kind`; under another Accelerate than TESTED, say so once."""
    global _warned
    if accelerate.__version__ == TESTED:
        return
    if not isinstance(getattr(owner, attribute, None), kind):
        raise LaunchError(f"accelerate {accelerate.__version__}: Accelerator.{attribute} is not a {kind.__name__} as "
                          f"in accelerate {TESTED}, and this project needs it {reason}. Install the pinned version: "
                          f"pip install accelerate=={TESTED}.")
    if not _warned:
        _warned = True
        logger.warning("accelerate %s is installed; this project is tested with %s (its internals used here are "
                       "checked: shared/core/accelerate_compat.py).", accelerate.__version__, TESTED)


def prepared_models(accelerator) -> list:
    """The models accelerator.prepare() returned. No public accessor: resume() sizes the final model's room from
    them (a ZeRO-3 parameter's full size) before any step."""
    _check(accelerator, "_models", list, "to size the final model before training")
    return accelerator._models


def prepared_schedulers(accelerator) -> list:
    """The schedulers accelerator.prepare() returned (what save_state/load_state checkpoint). No public accessor: a
    resume with a new --learning_rate rewrites their base rates, and refuses a recipe that keeps its own."""
    _check(accelerator, "_schedulers", list, "to apply a new --learning_rate on resume")
    return accelerator._schedulers


def available_trackers() -> list:
    """The trackers installed here (Accelerate's public function)."""
    from accelerate.tracking import get_available_trackers

    return list(get_available_trackers())


def enable_cpu_fp16(accelerator, scaler: torch.amp.GradScaler) -> None:
    """Turn on fp16 autocast and loss scaling on a CPU, which Accelerate leaves fp32 (no public switch). Before
    prepare(): prepare_model wraps forward in autocast when `native_amp` is set, and prepare_optimizer hands
    `scaler` to the optimizer wrapper."""
    _check(accelerator, "native_amp", bool, "to run fp16 on a CPU")
    if accelerate.__version__ != TESTED and not hasattr(accelerator, "scaler"):
        raise LaunchError(f"accelerate {accelerate.__version__}: Accelerator.scaler is gone, and this project needs "
                          f"it to run fp16 on a CPU. pip install accelerate=={TESTED}, or use bf16 / fp32.")
    accelerator.native_amp = True
    accelerator.scaler = scaler
