"""A user's copy of a recipe, edited: its own step count and a plain print instead of the meter. What the copy still
does is written in its own loop: the final checkpoint (maybe_save_checkpoint(..., max_steps=...)) and the stop on
SIGTERM with a checkpoint saved (preemption.check), in 2 processes. Before, the step count lived in
launch.max_train_steps (written by total_steps) and the processes agreed on a signal inside Meter._log: both edits
broke them silently."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from shared.core.checkpoint import verify_checkpoint
from tests.conftest import CONFIGS, ROOT, free_port

EDITS = {  # recipes/baseline.py line -> the user's own
    "max_steps = total_steps(launch, accelerator, task.train_dataloader)":
        'max_steps = int(os.environ["MY_STEPS"])  # my own count, not total_steps',
    "    meter = Meter(accelerator, launch, task, model, optimizer)\n": "",
    "for step in meter.steps(start_step, max_steps):": "for step in range(start_step, max_steps):",
    "meter.record(step, loss, batch)": 'print(f"step {step} loss {loss.item():.4f}", flush=True)',
    "return finish(accelerator, launch, task, model, eval_dl, meter)": "end_run(accelerator)",
    "from shared.core.results import finish": "from shared.core.results import end_run",
    "import sys\n": "import os\nimport sys\n",
}


def _copy(tmp_path):
    source = (ROOT / "recipes" / "baseline.py").read_text()
    for old, new in EDITS.items():
        assert old in source, f"recipes/baseline.py no longer has {old!r}: update the edit"
        source = source.replace(old, new)
    source = source.replace("parents[1]", f"parents[0] / {str(ROOT)!r}")  # shared/ from the copy's folder
    copy = tmp_path / "my_recipe.py"
    copy.write_text(source)
    return copy


def _start(copy, out, steps, *flags):
    cmd = [*map(str, (sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                      CONFIGS / "multi_cpu.yaml", "--main_process_port", free_port(), copy)),
           "--max_train_samples", "64", "--per_device_train_batch_size", "4", "--checkpointing_steps", "4",
           "--logging_steps", "2", "--report_to", "none", "--no_save_model", "--output_dir", str(out), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "MY_STEPS": str(steps)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_edited_copy_keeps_its_final_checkpoint_and_stops_on_sigterm(tmp_path):
    import psutil

    copy = _copy(tmp_path)
    # Its own 6 steps, a checkpoint every 4: step 4, and step 6 because it is the last.
    done = _start(copy, tmp_path / "done", 6)
    # Its own 100000 steps: SIGTERM to the launcher and both workers once the first checkpoint is written.
    cut = _start(copy, tmp_path / "cut", 100_000)
    deadline = time.time() + 300
    while not list((tmp_path / "cut" / "checkpoints").glob("step_*")):
        assert cut.poll() is None, cut.stdout.read()[-3000:]
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.05)
    parent = psutil.Process(cut.pid)
    for p in [*parent.children(recursive=True), parent]:
        p.send_signal(15)
    cut_out, _ = cut.communicate(timeout=120)
    done_out, _ = done.communicate(timeout=300)

    assert done.returncode == 0, done_out[-4000:]
    steps = sorted(p.name for p in (tmp_path / "done" / "checkpoints").glob("step_*"))
    assert steps == ["step_00000004", "step_00000006"], (steps, done_out[-3000:])
    assert verify_checkpoint(tmp_path / "done" / "checkpoints" / "step_00000006") is None

    assert cut.returncode != 0, "the run finished before the signal: nothing was tested"
    saved = re.findall(r"SIGTERM received: saved (\S+) at step (\d+)", cut_out)
    assert len(set(saved)) == 1, cut_out[-4000:]  # every process saved the same step
    path, step = saved[0]
    assert int(step) % 2 == 0 and verify_checkpoint(Path(path)) is None  # agreed at a logging step (every 2)
