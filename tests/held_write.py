"""A recipe run whose checkpoint of one step (HOLD_STEP) is held on its way to disk until <output_dir>/release
exists: the storage made slow, the technique itself untouched (tests/test_async_checkpoint.py).

    accelerate launch [...] tests/held_write.py <recipe> <recipe flags>

Each process touches <output_dir>/held_<rank> when its write of that step starts, and the main process appends
every finished optimizer step to <output_dir>/steps.txt before its checkpoint call: a step noted while the write
is held trained while the checkpoint was being written.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch.distributed.checkpoint import filesystem  # noqa: E402

import shared.core.checkpoint as checkpoint  # noqa: E402

recipe, argv = sys.argv[1], sys.argv[2:]
out = Path(argv[argv.index("--output_dir") + 1])
held = f"step_{int(os.environ['HOLD_STEP']):08d}"
write_data, maybe_save = filesystem._FileSystemWriter.write_data, checkpoint.maybe_save_checkpoint


def held_write(self, plan, planner):
    if held in str(self.path):
        (out / f"held_{os.environ.get('RANK', '0')}").touch()
        deadline = time.time() + 600
        while not (out / "release").exists() and time.time() < deadline:
            time.sleep(0.05)
    return write_data(self, plan, planner)


def noted(accelerator, launch, step, micro_batches, **kwargs):
    if accelerator.is_main_process:
        with (out / "steps.txt").open("a") as f:
            f.write(f"{step}\n")
    return maybe_save(accelerator, launch, step, micro_batches, **kwargs)


filesystem._FileSystemWriter.write_data = held_write
checkpoint.maybe_save_checkpoint = noted  # before the recipe imports it
spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.main(argv)
