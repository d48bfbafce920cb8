"""A recipe run in which the process of rank DIE_RANK kills itself with SIGKILL (no handler runs, nothing is saved)
right after the checkpoint of step DIE_AFTER_STEP or a later one is written: in the first attempt only, or, with
DIE_EVERY_ATTEMPT=1, in every attempt torch elastic restarts (a fault that keeps coming back). With DIE_AFTER=results,
right after the run wrote results.json instead (the run finished; a process died on its way out). The fault the
elastic tests inject; the recipe, its checkpoints and the launcher are the real ones.
    accelerate launch [--max_restarts N ...] tests/faulty_run.py recipes/data_parallel.py --checkpointing_steps 2 ...
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.core import checkpoint, results  # noqa: E402  (the modules whose functions the recipe's calls reach)

_save, _write_results = checkpoint.save_checkpoint, results.write_results


def _die_if_asked(what: str) -> None:
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if os.environ["RANK"] == os.environ["DIE_RANK"] and (first or os.environ.get("DIE_EVERY_ATTEMPT") == "1"):
        print(f"faulty_run: rank {os.environ['RANK']} kills itself (SIGKILL) after {what}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def _write_results_then_die(accelerator, launch, written):
    done = _write_results(accelerator, launch, written)  # the process group is gone after it: poll the file
    while not (Path(launch.output_dir) / "results.json").exists():
        time.sleep(0.05)
    _die_if_asked("results.json")
    return done


def _save_then_die(accelerator, launch, step, *args, **kwargs):
    path = _save(accelerator, launch, step, *args, **kwargs)
    if os.environ.get("DIE_AFTER") != "results" and step >= int(os.environ["DIE_AFTER_STEP"]):
        _die_if_asked(f"checkpoint {path.name}")
    return path


checkpoint.save_checkpoint = _save_then_die
results.write_results = _write_results_then_die
sys.argv = sys.argv[1:]  # the recipe's path, then its flags, as if it had been launched itself
runpy.run_path(sys.argv[0], run_name="__main__")
