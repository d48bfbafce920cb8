"""The engines, each on this machine over loopback, each to the parameters of the same 2-process DDP run under
`accelerate launch`: SLURM (examples/slurm/multi_node.sbatch run with the variables SLURM sets, `srun` and
`scontrol` stood in for, 2 "nodes" of 1 process), Kubernetes (the Kubeflow TrainJob
in examples/kubernetes/, checked against the CRD's generated model, its command run as 2 "pods" with the variables the
torch runtime sets) and Ray Train (examples/ray/train_ray.py, 2 CPU workers; skipped where ray is not installed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import QUIET, ROOT, free_port, load_params, max_param_diff
from tests.parallel_runs import COMMON, ddp

RECIPE_ARGS = [*COMMON, "--per_device_train_batch_size", "8", *QUIET]  # as ddp(): 2 processes x 8
VENV_BIN = str(Path(sys.executable).parent)  # `accelerate` on PATH, as on a node with the requirements installed
SRUN = """#!/bin/bash
# srun on this machine: the command once per node of the job, each with its SLURM_NODEID. Node 0 first, the others
# once it listens on MAIN_PORT: on one machine the nodes share ports, and machine 0's launcher refuses a main port
# another node's launcher took first (on a cluster each node has its own).
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    [ "$i" = 1 ] && timeout 600 bash -c 'until (: > /dev/tcp/127.0.0.1/$MAIN_PORT) 2>/dev/null; do sleep 0.5; done'
    SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" & pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
SCONTROL = """#!/bin/bash
# `scontrol show hostnames LIST`: one host a line
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$3"
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}", **extra}


def _wait_for_port(port: int, first: subprocess.Popen, timeout: float = 600) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while first.poll() is None and time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise AssertionError(f"the first pod never listened on {port}:\n{first.communicate()[0][-3000:]}")


def _same_as_ddp(tmp_path_factory, out: Path, what: str) -> dict:
    r = json.loads((out / "results.json").read_text())
    assert (r["num_processes"], r["distributed_type"], r["ddp_wrapped"]) == (2, "MULTI_CPU", True)
    assert r["param_fingerprint"][0] == r["param_fingerprint"][1]
    diff = max_param_diff(load_params(ddp(tmp_path_factory)[0]), load_params(out))
    print(f"{what}: max abs param diff vs 2 processes under accelerate launch {diff:.1e}")
    assert diff == 0.0
    return r


def test_slurm_sbatch_as_two_nodes(tmp_path_factory, tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL)):
        (fake / name).write_text(body)
        (fake / name).chmod(0o755)
    out = tmp_path / "run"
    env = _env(PATH=f"{fake}:{VENV_BIN}:{os.environ['PATH']}", SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", GPUS_PER_NODE="1",
               MAIN_PORT=str(free_port()), OUTPUT_DIR=str(out))
    proc = subprocess.run(["bash", "examples/slurm/multi_node.sbatch", *RECIPE_ARGS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    _same_as_ddp(tmp_path_factory, out, "SLURM sbatch, 2 nodes of 1 process")


def _trainjob() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "examples" / "kubernetes" / "trainjob.yaml").read_text())


def test_trainjob_manifest_matches_the_crd():
    models = pytest.importorskip("kubeflow_trainer_api.models")
    manifest = _trainjob()
    job = models.TrainerV1alpha1TrainJob.from_dict(manifest)  # types checked (pydantic, strict)
    assert job.to_dict() == manifest, "a field the TrainJob CRD does not have (it would be dropped)"
    assert (job.api_version, job.kind, job.spec.runtime_ref.name) == ("trainer.kubeflow.org/v1alpha1", "TrainJob",
                                                                      "torch-distributed")
    bad = {**manifest, "spec": {**manifest["spec"], "trainer": {**manifest["spec"]["trainer"], "numNode": 2}}}
    assert models.TrainerV1alpha1TrainJob.from_dict(bad).to_dict() != bad  # the check above catches a typo


def test_trainjob_command_as_two_pods(tmp_path_factory, tmp_path):
    trainer = _trainjob()["spec"]["trainer"]
    recipe, flags = trainer["args"][0], trainer["args"][1:]
    assert recipe == "recipes/data_parallel.py" and "--output_dir" in flags and "--checkpointing_steps" in flags
    out = tmp_path / "run"
    # The operator's variables, and the manifest's own.
    port = free_port()
    env = _env(**{e["name"]: e["value"] for e in trainer["env"]}, PET_NNODES=str(trainer["numNodes"]),
               PET_NPROC_PER_NODE="1", PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=str(port))
    pods = []
    for rank in range(trainer["numNodes"]):
        if rank == 1:  # on one machine the pods share ports: pod 0's launcher first takes the master's (as SRUN)
            _wait_for_port(port, pods[0])
        pods.append(subprocess.Popen([*trainer["command"], recipe, *RECIPE_ARGS, "--output_dir", str(out)],
                                     cwd=ROOT, env={**env, "PET_NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in pods]
    assert [p.returncode for p in pods] == [0, 0], "\n".join(log[-3000:] for log in logs)
    _same_as_ddp(tmp_path_factory, out, "Kubeflow TrainJob command, 2 pods")


@pytest.mark.slow  # Ray starts its own cluster (about a minute here); needs examples/ray/requirements.txt
def test_ray_torchtrainer_two_cpu_workers(tmp_path_factory, tmp_path):
    pytest.importorskip("ray.train.torch")
    out = tmp_path / "run"
    cmd = [sys.executable, "examples/ray/train_ray.py", "--num_workers", "2", "recipes/data_parallel.py",
           *RECIPE_ARGS, "--output_dir", str(out)]
    # A local Ray; on a loaded machine its raylet took longer than the 60 s Ray waits by default.
    env = {k: v for k, v in _env(RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="400").items()
           if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    _same_as_ddp(tmp_path_factory, out, "Ray TorchTrainer, 2 CPU workers")
