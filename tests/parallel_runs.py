"""Runs that several parallelism tests compare against, each made once per test session (launches are costly)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import launch
from tests.probed_run import launch_probed, run_probed

STEPS = 6
# fp32, no dropout, constant LR, tiny GPT-2 on a slice of the built-in data: runs that differ only in how the
# global batch of 16 is split over processes must end with the same parameters.
COMMON = ("--task", "causal-lm", "--disable_dropout", "--max_train_steps", str(STEPS), "--max_train_samples", "256",
          "--max_eval_samples", "32", "--max_seq_length", "64", "--learning_rate", "3e-3",
          "--lr_scheduler_type", "constant", "--logging_steps", "2")
_runs: dict[str, tuple[Path, dict]] = {}


def _once(name: str, factory: pytest.TempPathFactory, make) -> tuple[Path, dict]:
    if name not in _runs:
        out = factory.mktemp(name)
        _runs[name] = (out, make(out))
    return _runs[name]


def single(factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """1 process, batch 16: the reference."""
    return _once("single", factory, lambda out: run_probed("data_parallel", out, *COMMON,
                                                           "--per_device_train_batch_size", "16"))


def ddp(factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """2-process DDP, 8 per process (global batch 16), compared with the 1-process run for scaling."""
    ref = single(factory)[0] / "results.json"
    return _once("ddp", factory, lambda out: launch("data_parallel", out, *COMMON, "--per_device_train_batch_size",
                                                    "8", "--compare_to", ref))


def fsdp(factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """2-process FSDP2 full shard, 8 per process, a sharded checkpoint halfway."""
    return _once("fsdp", factory, lambda out: launch("fsdp", out, *COMMON, "--per_device_train_batch_size", "8",
                                                     "--checkpointing_steps", str(STEPS // 2), config="fsdp.yaml"))


def mesh(factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """4 processes = 2 data-parallel replicas x 2 pipeline stages, 8 per replica, a checkpoint halfway."""
    args = (*COMMON, "--per_device_train_batch_size", "8", "--pipeline_stages", "2",
            "--checkpointing_steps", str(STEPS // 2))
    return _once("mesh", factory, lambda out: launch_probed("data_model_parallel", out, *args,
                                                     config="data_model_parallel.yaml"))
