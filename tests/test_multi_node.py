"""Two "machines" on loopback: two `accelerate launch` commands with --machine_rank 0 and 1 train as one job; a
machine that never joins makes the other fail within the rendezvous timeout, with a message that says so."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import CONFIGS, QUIET, ROOT, free_port, load_params, max_param_diff
from tests.parallel_runs import COMMON, single


def _machine(rank: int, port: int, out, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "multi_node.yaml"),
           "--num_machines", "2", "--num_processes", "2", "--machine_rank", str(rank),
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), *extra,
           str(ROOT / "recipes" / "data_parallel.py"), *COMMON, "--per_device_train_batch_size", "8",
           *QUIET, "--output_dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_machines_train_together(tmp_path_factory, tmp_path):
    import json

    ref_dir, _ = single(tmp_path_factory)
    port = free_port()
    machines = [_machine(rank, port, tmp_path, "--rdzv_conf", "timeout=120") for rank in (0, 1)]
    logs = [m.communicate(timeout=600)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], "\n".join(log[-3000:] for log in logs)
    r = json.loads((tmp_path / "results.json").read_text())
    assert (r["num_processes"], r["distributed_type"], r["ddp_wrapped"]) == (2, "MULTI_CPU", True)
    diff = max_param_diff(load_params(ref_dir), load_params(tmp_path))  # one process per machine, batch 8 each
    print(f"param diff: 2 machines x 8 vs 1 process x 16 = {diff:.2e}")
    assert diff <= 1e-5


@pytest.mark.slow
def test_a_machine_that_never_joins_fails_the_other_in_time(tmp_path):
    start = time.monotonic()
    alone = _machine(0, free_port(), tmp_path, "--rdzv_conf", "timeout=10")
    log = alone.communicate(timeout=120)[0]
    elapsed = time.monotonic() - start
    assert alone.returncode != 0
    assert "1/2 clients joined" in log and "Timed out" in log, log[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert not (tmp_path / "results.json").exists()
