"""`accelerate launch tests/count_collectives.py OUT.json RECIPE [flags]`: runs recipes/RECIPE.py with every
Python-level torch.distributed collective counted, and writes the calls of each optimizer step
(tests/test_step_overhead.py). DDP's gradient all-reduce runs inside its C++ reducer and is not counted: it is the
technique's own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
               "reduce", "gather", "scatter", "all_to_all", "all_gather_object", "broadcast_object_list")
calls: list[str] = []


def _counted(name: str):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    return wrapper


def main() -> None:
    out, recipe, *flags = sys.argv[1:]
    for name in COLLECTIVES:  # before anything imports them: Accelerate calls torch.distributed.<name> at call time
        setattr(dist, name, _counted(name))
    from shared.core.meter import Meter
    from tests.conftest import load_recipe

    per_step: list[list[str]] = []
    record = Meter.record

    def counting_record(self, step, *args, **kwargs):
        record(self, step, *args, **kwargs)
        per_step.append(list(calls))  # what this step called, from the previous record up to the end of this one
        calls.clear()

    Meter.record = counting_record
    load_recipe(recipe).main(flags)
    Path(f"{out}.{os.environ.get('RANK', '0')}").write_text(json.dumps(per_step))


if __name__ == "__main__":
    main()
