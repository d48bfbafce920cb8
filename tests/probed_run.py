"""Test probes, kept out of the recipes: the first optimizer step's gradient norm (what the recipe's clip function
returned first) and the label sum of the first batch each process read (which batches a layout's processes share).

`accelerate launch tests/probed_run.py RECIPE [flags]` runs recipes/RECIPE.py with them, each process writing
<output_dir>/probes_<rank>.json; `launch_probed` does that and `run_probed` runs a recipe in this process, both
returning results.json with "first_step_grad_norm" (the main process's) and "first_batch_label_sum" (per process)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def probes(module):
    """Wrap the recipe module's clip function and batch iterator (its own names, before main runs)."""
    import accelerate

    seen: dict[str, float] = {}

    def first_norm(clip):
        def clipped(*args, **kwargs):
            norm = clip(*args, **kwargs)
            seen.setdefault("first_step_grad_norm", float(norm))
            return norm
        return clipped

    batches = module.endless_batches

    def endless(*args, **kwargs):
        it = batches(*args, **kwargs)
        batch = next(it)
        seen["first_batch_label_sum"] = batch["labels"].sum().item()
        yield batch
        yield from it

    module.endless_batches = endless
    for name in ("clip_grad_norm", "clip_global_grad_norm"):
        if hasattr(module, name):
            setattr(module, name, first_norm(getattr(module, name)))
    clip_ = accelerate.Accelerator.clip_grad_norm_
    accelerate.Accelerator.clip_grad_norm_ = first_norm(clip_)
    try:
        yield seen
    finally:
        accelerate.Accelerator.clip_grad_norm_ = clip_


def _merged(output_dir: Path) -> dict:
    results = json.loads((output_dir / "results.json").read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(output_dir.glob("probes_*.json"),
                                                        key=lambda p: int(p.stem.split("_")[1]))]
    results["first_step_grad_norm"] = ranks[0].get("first_step_grad_norm")
    results["first_batch_label_sum"] = [r.get("first_batch_label_sum") for r in ranks]
    return results


def run_probed(name: str, output_dir: Path, *args) -> dict:
    """tests.conftest.run_recipe, with the probes."""
    from tests import conftest

    load = conftest.load_recipe
    held: dict = {}

    def probed_load(recipe):
        module = load(recipe)
        held["cm"] = probes(module)
        held["seen"] = held["cm"].__enter__()
        return module

    conftest.load_recipe = probed_load
    try:
        conftest.run_recipe(name, output_dir, *args)
    finally:
        conftest.load_recipe = load
        if "cm" in held:
            held["cm"].__exit__(None, None, None)
    (Path(output_dir) / "probes_0.json").write_text(json.dumps(held.get("seen", {})))
    return _merged(Path(output_dir))


def launch_probed(name: str, output_dir: Path, *args, timeout: int = 600, **kwargs) -> dict:
    """tests.conftest.launch, through this script."""
    from tests.conftest import launch_command

    cmd, env = launch_command(name, output_dir, *args, **kwargs)
    script = cmd.index(str(ROOT / "recipes" / f"{name}.py"))
    cmd[script:script + 1] = [str(Path(__file__).resolve()), name]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return _merged(Path(output_dir))


def main() -> None:
    from tests.conftest import load_recipe

    recipe, *flags = sys.argv[1:]
    module = load_recipe(recipe)
    with probes(module) as seen:
        module.main(flags)
    out = Path(flags[len(flags) - flags[::-1].index("--output_dir")])  # the last one given (launch_command's)
    (out / f"probes_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
