"""--async_checkpoint (shared/techniques/async_checkpoint.py): checkpoints written in the background.

What is checked: the save returns while its write is still held, and what reaches the disk is the state at the
save (the training went on meanwhile), byte for byte what a synchronous dcp.save writes; a 2-process FSDP2 run
trains past a checkpoint whose write is held, a kill -9 then leaves that one partial and `latest` resumes from the
one before, to the parameters of an uninterrupted run (whose synchronous checkpoint holds the same bytes); a SIGTERM
while a write is held waits for it, saves, and exits 143 with both checkpoints whole.
"""

import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import filesystem

from shared.core.checkpoint import verify_checkpoint
from shared.techniques.async_checkpoint import AsyncCheckpoints
from tests.conftest import ROOT, launch, launch_command, load_params, max_param_diff
from tests.test_reliability import _kill_tree

ARGS = ["--task", "causal-lm", "--max_train_steps", 12, "--checkpointing_steps", 4, "--max_train_samples", 96,
        "--per_device_train_batch_size", 4, "--max_eval_samples", 8, "--disable_dropout", "--logging_steps", 1]


def _dcp_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*.distcp"))}


def _same_dcp(a: Path, b: Path) -> None:
    """The shard files byte for byte, and the index of what they hold (.metadata also names its save, an id)."""
    fa, fb = _dcp_files(a), _dcp_files(b)
    assert fa and fa.keys() == fb.keys(), (sorted(fa), sorted(fb))
    assert all(fa[k] == fb[k] for k in fa), [k for k in fa if fa[k] != fb[k]]
    for meta in {p.parent.relative_to(a) for p in a.rglob(".metadata")}:
        ma, mb = (filesystem.FileSystemReader(str(d / meta)).read_metadata() for d in (a, b))
        assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data


def test_a_background_save_writes_the_state_at_the_save(tmp_path, monkeypatch):
    """The call returns with its write held; the model and optimizer change; what is written is the state at the
    call, the same bytes as a synchronous dcp.save of it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step() -> None:
            model(torch.randn(4, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        def state() -> dict:
            return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

        step()
        at_save = {k: v.clone() for k, v in model.state_dict().items()}
        dcp.save(state(), checkpoint_id=str(tmp_path / "sync"))

        gate, write = threading.Event(), filesystem._FileSystemWriter.write_data
        monkeypatch.setattr(filesystem._FileSystemWriter, "write_data",
                            lambda self, plan, planner: gate.wait(60) and write(self, plan, planner))
        writes = AsyncCheckpoints()
        with writes.deferred():
            dcp.save(state(), checkpoint_id=str(tmp_path / "async"))
        assert writes.in_flight(), "the save did not return before its write"
        assert dcp.save is dcp.state_dict_saver.save  # the redirect ends with the save
        for _ in range(3):  # the training goes on while the checkpoint is written
            step()
        assert not torch.equal(model[0].weight, at_save["0.weight"])
        gate.set()
        writes.written()
        assert not writes.in_flight()

        _same_dcp(tmp_path / "sync", tmp_path / "async")
        loaded = {"model": {k: torch.zeros_like(v) for k, v in at_save.items()}}
        dcp.load(loaded, checkpoint_id=str(tmp_path / "async"))
        assert all(torch.equal(loaded["model"][k], at_save[k]) for k in at_save)
    finally:
        dist.destroy_process_group()


def _start_held(output_dir: Path, hold: int, *args) -> subprocess.Popen:
    """recipes/fsdp.py on 2 processes through tests/held_write.py: step `hold`'s checkpoint held on its way out."""
    cmd, env = launch_command("fsdp", output_dir, *args, config="fsdp.yaml")
    at = cmd.index(str(ROOT / "recipes" / "fsdp.py"))
    cmd[at:at + 1] = [str(ROOT / "tests" / "held_write.py"), "fsdp"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "HOLD_STEP": str(hold)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_until(proc: subprocess.Popen, done, what: str, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.stdout.read()[-4000:]}"
        assert time.time() < deadline, f"not {what} in {timeout:.0f} s"
        time.sleep(0.1)


def _steps(output_dir: Path) -> list[int]:
    path = output_dir / "steps.txt"
    return [int(s) for s in path.read_text().split()] if path.exists() else []


def test_killed_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    """kill -9 while step 8's checkpoint is being written (and steps 9+ train): step_8 is left a .tmp_ directory,
    `latest` takes step_4, and the resumed run (--async_checkpoint) ends at the parameters of an uninterrupted,
    synchronous run, whose step_4 holds the same bytes as the background-written one."""
    launch("fsdp", tmp_path / "full", *ARGS, config="fsdp.yaml")
    cut = tmp_path / "cut"
    proc = _start_held(cut, 8, *ARGS, "--async_checkpoint")
    try:
        held = cut / "checkpoints" / ".tmp_step_00000008"
        _wait_until(proc, lambda: len(list(cut.glob("held_*"))) == 2 and max(_steps(cut), default=0) >= 10,
                    "step 10 trained while step 8's checkpoint was held")
        assert held.is_dir() and verify_checkpoint(held) is not None  # in flight: not complete
        assert verify_checkpoint(cut / "checkpoints" / "step_00000004") is None
    finally:
        _kill_tree(proc, signal.SIGKILL)
        proc.communicate(timeout=120)
    assert not (cut / "checkpoints" / "step_00000008").exists()
    _same_dcp(tmp_path / "full" / "checkpoints" / "step_00000004", cut / "checkpoints" / "step_00000004")

    r = launch("fsdp", cut, *ARGS, "--async_checkpoint", "--resume_from_checkpoint", "latest", config="fsdp.yaml")
    assert r["num_processes"] == 2 and r["resumed_from_step"] == 4, r["resumed_from_step"]
    assert all(verify_checkpoint(cut / "checkpoints" / f"step_{s:08d}") is None for s in (4, 8, 12))
    diff = max_param_diff(load_params(tmp_path / "full"), load_params(cut))
    print(f"killed during step 8's background write, resumed at step 4: max abs param diff {diff:.1e}")
    assert diff == 0.0


@pytest.mark.slow  # a third 2-process launch
def test_sigterm_during_a_background_write_waits_for_it_and_saves(tmp_path):
    """SIGTERM to the workers while step 4's checkpoint is held: at the next step the run finishes that write,
    saves its own step synchronously and exits (143 in each worker); both checkpoints verify, none is left partial."""
    out = tmp_path / "run"
    proc = _start_held(out, 4, *ARGS, "--async_checkpoint")
    _wait_until(proc, lambda: len(list(out.glob("held_*"))) == 2 and max(_steps(out), default=0) >= 5,
                "step 5 trained while step 4's checkpoint was held")
    for worker in psutil.Process(proc.pid).children(recursive=True):  # as a scheduler's preemption reaches them
        worker.send_signal(signal.SIGTERM)
    time.sleep(1)
    (out / "release").touch()
    text, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "SIGTERM received: saved" in text, text[-4000:]
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved[0] == "step_00000004" and len(saved) >= 2, saved  # step 4's, then the step the signal saved
    assert all(verify_checkpoint(out / "checkpoints" / name) is None for name in saved)
    assert not list((out / "checkpoints").glob(".tmp_*"))
