"""Optimizer steps counted from outside the recipe: `accelerate launch tests/counted_run.py RECIPE [flags]` runs
recipes/RECIPE.py with DeepSpeed's engine step (DeepSpeedEngine._take_model_step) and torch's Optimizer.step
wrapped, and each process writes <output_dir>/steps_<rank>.json: {"engine_steps": n, "optimizer_steps": n,
"lr": [the learning rate at each engine step]}. The loop's own counting is not trusted here: DeepSpeed steps when
its accumulation says so, whatever the loop thinks."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    recipe, argv = sys.argv[1], sys.argv[2:]
    counts = {"engine_steps": 0, "optimizer_steps": 0, "lr": []}

    def count_optimizer(optimizer, args, kwargs):
        counts["optimizer_steps"] += 1

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(count_optimizer)
    try:
        from deepspeed.runtime.engine import DeepSpeedEngine

        take = DeepSpeedEngine._take_model_step

        def counted(self, *a, **kw):
            counts["engine_steps"] += 1
            counts["lr"].append(self.get_lr()[0] if self.get_lr() else None)
            return take(self, *a, **kw)

        DeepSpeedEngine._take_model_step = counted
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(recipe, ROOT / "recipes" / f"{recipe}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.main(argv)
    finally:
        out = Path(argv[argv.index("--output_dir") + 1])
        if out.is_dir():
            (out / f"steps_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
