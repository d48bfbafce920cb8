"""Elastic restarts (`accelerate launch --rdzv_backend c10d --max_restarts N`): a process killed with SIGKILL after a
checkpoint makes torch elastic restart them all, and the restarted processes go on from the newest complete
checkpoint by themselves (the command unchanged) to the parameters of a run that was never interrupted; a process
that keeps dying ends the job after N restarts. (A launch whose restarts could not connect is refused before it
trains: tests/test_bad_inputs.py, elastic-restarts-shared-store.)"""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, QUIET, ROOT, free_port, load_params, max_param_diff
from tests.parallel_runs import COMMON, ddp

ELASTIC = ("--rdzv_backend", "c10d", "--monitor_interval", "0.5")


def _elastic_run(out, max_restarts: int, die_rank: int, every_attempt: bool, die_after: str = "checkpoint",
                 checkpointing: tuple[str, ...] = ("--checkpointing_steps", "2")) -> subprocess.CompletedProcess:
    """2-process DDP (multi_cpu.yaml) under torch elastic; the process of rank `die_rank` kills itself with SIGKILL
    right after the checkpoint of step 2 (or a later one, in every attempt when `every_attempt`)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_cpu.yaml"),
           "--main_process_port", str(free_port()), *ELASTIC, "--max_restarts", str(max_restarts),
           str(ROOT / "tests" / "faulty_run.py"), str(ROOT / "recipes" / "data_parallel.py"), *COMMON,
           "--per_device_train_batch_size", "8", *checkpointing, *QUIET, "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "DIE_RANK": str(die_rank), "DIE_AFTER_STEP": "2", "DIE_EVERY_ATTEMPT": "1" if every_attempt else "0",
           "DIE_AFTER": die_after}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_a_killed_process_is_restarted_and_the_run_ends_exact(tmp_path_factory, tmp_path):
    # Rank 0 dies: the process that holds the output directory's lock and writes the checkpoints.
    proc = _elastic_run(tmp_path, max_restarts=1, die_rank=0, every_attempt=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "rank 0 kills itself (SIGKILL) after checkpoint step_00000002" in log
    assert "torch elastic restart 1 of 1" in log and "resuming from" in log, log[-6000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert (r["num_processes"], r["resumed_from_step"], r["resolved"]["elastic_restarts"]) == (2, 2, 1)
    assert r["resolved"]["resume_from_checkpoint"] == "latest" and r["flags"]["resume_from_checkpoint"] is None
    assert r["param_fingerprint"][0] == r["param_fingerprint"][1]
    ref_dir, _ = ddp(tmp_path_factory)  # the same 2-process run, never interrupted
    diff = max_param_diff(load_params(ref_dir), load_params(tmp_path))
    print(f"killed at step 2, restarted by torch elastic: max abs param diff vs uninterrupted {diff:.1e}")
    assert diff == 0.0


@pytest.mark.slow  # two attempts of a 2-process launch (about a minute on 2 idle cores)
def test_a_process_that_keeps_dying_ends_the_job_after_its_restarts(tmp_path):
    proc = _elastic_run(tmp_path, max_restarts=1, die_rank=1, every_attempt=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-6000:]
    assert log.count("rank 1 kills itself (SIGKILL)") == 2, log[-6000:]  # the first attempt and the restart
    assert "torch elastic restart 1 of 1" in log and "the last one: if a process dies again, the job ends" in log
    assert "--resume_from_checkpoint latest" in log
    assert "exitcode  : -9" in log and "Signal 9 (SIGKILL)" in log, log[-6000:]  # the launcher's own summary
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert not (tmp_path / "results.json").exists()



def test_an_elastic_restart_after_the_run_finished_does_not_run_it_again(tmp_path):
    """The second fault trial's case: rank 1 SIGKILLed after results.json was written made torch elastic restart the
    job, which trained again from scratch (no checkpoints) or from the last one, and rewrote results.json with null
    losses. The restarted processes see the results this launch wrote, leave them, and the job exits 0."""
    proc = _elastic_run(tmp_path, max_restarts=1, die_rank=1, every_attempt=False, die_after="results",
                        checkpointing=())
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "rank 1 kills itself (SIGKILL) after results.json" in log and "torch elastic restart 1 of 1" in log
    assert "is finished" in log and "by this launch before a process died" in log, log[-6000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["train_loss"] is not None and r["resolved"]["elastic_restarts"] == 0, "the first attempt's results"
    assert not (tmp_path / "checkpoints").exists()
