"""The whole rule table and the planner's view of every recipe: tools and tests import this, recipes never do.

Importing it imports every technique module, so each one's rules and Run fields are registered
(shared/core/rules.py register) before any run is weighed, as they are in a recipe that imports its technique.
recipes_support() gathers what each recipe runs under (its SUPPORT, which a recipe run alone knows of itself)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from ..core import rules
from ..techniques import (  # noqa: F401  (imported for their rules)
    activation_offload,
    chunked_loss,
    comm_reduction,
    deepspeed_setup,
    expert_parallel,
    fp8,
    hsdp,
    optim_8bit,
    optim_in_backward,
    optim_low_bit,
    pipeline_stages,
    quant,
    selective_checkpointing,
    tensor_parallel,
    ulysses,
)


@functools.cache
def recipes_support() -> dict[str, rules.Support]:
    """Every recipe's SUPPORT by name (recipes/*.py, in name order), read by importing each recipe file: its main()
    runs only as a script."""
    found = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"recipe_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found[path.stem] = module.SUPPORT
    return found


def recipe_run(recipe: str, sharding: str, launched: str, **given: object) -> rules.Run:
    """The rule table's Run of recipes/<recipe>.py with its SUPPORT, as its resolve_launch would build it: a run the
    tools and tests weigh without launching it (a name that is no recipe: no Support, refused as such)."""
    return rules.Run(recipe, sharding, launched, support=recipes_support().get(recipe), **given)


# The memory planner (shared/tools/plan.py) has rows of its own for a recipe, or models it as the recipe in
# PLANS_AS, or says in NOT_PLANNED why it has no model of it.
PLANS_AS = {"gradient_accumulation": "baseline", "data_parallel": "baseline"}
_PIPELINE = "pipeline stages (each device's blocks and its micro-batches in flight) are not modelled"
NOT_PLANNED = {
    "pruning": "its masks and the pruning schedule's state are not modelled",
    "qat": "the fake-quantized weights and their observers are not modelled",
    "ptq": "it does not train: it quantizes a trained model for serving",
    "model_parallel": "one model spread over several devices by one process is not modelled",
    "pipeline_parallel": _PIPELINE,
    "data_model_parallel": _PIPELINE,
    "fp8": "FP8 weights, activations and scales (torchao's Float8Linear) are not modelled",
    "expert_parallel": "experts split over the processes (each holds 1/N of them, tokens exchanged by all-to-all) "
                       "and the routed tokens per expert are not modelled",
}
