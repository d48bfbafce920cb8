"""No run ends without its model, and none touches another's: one run per output directory (a lock, a finished
run refused unless --overwrite_output_dir, no stale files), a preemption at the last step that finishes, Ctrl-C
during the final evaluation, a full disk named before the save, and signals that reach the recipe however it is
launched (shared/core/rundir.py, checkpoint.py, results.py; examples/supervise.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, launch_command, load_params, max_param_diff, run_recipe

SHORT = ["--max_train_steps", 4, "--max_train_samples", 64, "--max_eval_samples", 16]


def _signal_after_step(monkeypatch, step: int, signum: int) -> None:
    """A real signal to this process, delivered as step `step` (1-based) ends: the handler, not a mock, acts on it."""
    from shared.core.meter import Meter

    record = Meter.record

    def record_then_signal(self, at, loss, batches):
        record(self, at, loss, batches)
        if at + 1 == step:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(Meter, "record", record_then_signal)


def _signals_during_evaluation(monkeypatch, count: int) -> None:
    """`count` Ctrl-Cs (SIGINT to this process) as the final evaluation starts, as a user presses them."""
    from shared.core.tasks import Task

    evaluate = Task.evaluate

    def pressed(self, *args, **kwargs):
        for _ in range(count):
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Task, "evaluate", pressed)


# ------------------------------------------------------------------------------------ the end of a run keeps the model


def test_sigterm_at_the_last_step_finishes_the_run(monkeypatch, tmp_path, caplog):
    """The fault trial's case: --checkpointing_steps 3, SIGTERM in step 4 of 4. It used to save step 4 and exit with
    no model nor results, and a resume was refused as having nothing to train."""
    _signal_after_step(monkeypatch, 4, signal.SIGTERM)
    with caplog.at_level("WARNING", logger="recipes"):
        r = run_recipe("baseline", tmp_path, *SHORT, "--checkpointing_steps", 3)
    assert "SIGTERM received at the last step: finishing the run" in caplog.text
    assert r["eval_accuracy"] is not None and (tmp_path / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003", "step_00000004"]


def test_a_run_killed_in_its_final_save_is_finished_by_resuming(tmp_path, caplog):
    """A kill -9 in the final model write leaves a cut model.safetensors and no results.json. The checkpoint of the
    last step (always written when checkpointing) is resumed: no step trains, and the model and results are written,
    equal to the run's own."""
    run_recipe("baseline", tmp_path / "whole", *SHORT, "--checkpointing_steps", 3)
    run_recipe("baseline", tmp_path / "cut", *SHORT, "--checkpointing_steps", 3)
    weights = tmp_path / "cut" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (tmp_path / "cut" / "results.json").unlink()
    with caplog.at_level("WARNING", logger="recipes"):
        r = run_recipe("baseline", tmp_path / "cut", *SHORT, "--checkpointing_steps", 3,
                       "--resume_from_checkpoint", "latest")
    assert "is at the last step (4): nothing to train" in caplog.text
    assert r["resumed_from_step"] == 4 and r["eval_accuracy"] is not None
    assert max_param_diff(load_params(tmp_path / "whole"), load_params(tmp_path / "cut")) == 0.0


def test_sigterm_before_the_last_step_saves_and_exits_128_plus_signal(monkeypatch, tmp_path):
    _signal_after_step(monkeypatch, 3, signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path, *SHORT)
    assert exc.value.code == 128 + signal.SIGTERM
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000003"]
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize("presses", [1, 2, 3])
def test_ctrl_c_during_the_final_evaluation_keeps_the_model(presses, monkeypatch, tmp_path, capsys):
    """The new-user trial's case: the first Ctrl-C printed nothing, the second raised inside evaluate() and nothing
    was saved. Now the first is answered (the evaluation finishes); a second stops at once, the model on disk."""
    _signals_during_evaluation(monkeypatch, presses)
    if presses == 1:
        r = run_recipe("baseline", tmp_path, *SHORT)
        assert r["eval_accuracy"] is not None
    else:
        with pytest.raises(SystemExit) as exc:
            run_recipe("baseline", tmp_path, *SHORT)
        assert exc.value.code == 128 + signal.SIGINT and not (tmp_path / "results.json").exists()
    assert "SIGINT received: the run saves a checkpoint at the next step" in capsys.readouterr().err
    assert len(load_params(tmp_path)) > 10, "the trained model, whole"


# ------------------------------------------------------------------------------------ one run per output directory


def test_a_finished_run_is_refused_or_replaced_without_stale_files(tmp_path):
    """A second run into a folder holding a finished run used to replace it silently, and an image run's
    preprocessor_config.json stayed beside the text model that replaced it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own")  # there before any run: never removed
    run_recipe("baseline", out, *SHORT, "--task", "image-classification", "--checkpointing_steps", 2)
    assert (out / "preprocessor_config.json").exists()
    with pytest.raises(SystemExit, match=r"holds a finished run \(results.json\).*--overwrite_output_dir"):
        run_recipe("baseline", out, *SHORT)
    assert json.loads((out / "results.json").read_text())["task"] == "image-classification", "nothing was touched"
    r = run_recipe("baseline", out, *SHORT, "--overwrite_output_dir")
    assert r["task"] == "text-classification" and r["resumed_from_step"] == 0
    left = sorted(p.name for p in out.iterdir())
    assert "preprocessor_config.json" not in left and "checkpoints" not in left and "notes.txt" in left, left
    # A model whose results were never written (an interrupted evaluation) is a finished run too.
    (out / "results.json").unlink()
    with pytest.raises(SystemExit, match=r"holds a finished run \(model.safetensors\)"):
        run_recipe("baseline", out, *SHORT)


def test_two_runs_in_one_output_dir(tmp_path):
    """The fault trial's case: two runs started together in one --output_dir both exited 0, one over the other.
    The second is refused while the first holds the directory, naming it; the first finishes untouched."""
    out = tmp_path / "shared"
    cmd = [sys.executable, str(ROOT / "recipes" / "baseline.py"), "--report_to", "none", "--output_dir", str(out),
           "--max_train_steps", 150, "--checkpointing_steps", 50, "--max_eval_samples", 16]
    first = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while f"pid {first.pid}" not in ((out / ".run.lock").read_text() if (out / ".run.lock").exists() else ""):
        assert first.poll() is None and time.time() < deadline, "the first run never took the directory"
        time.sleep(0.05)
    with pytest.raises(SystemExit, match=rf"is in use by another run \(pid {first.pid} on "):
        run_recipe("baseline", out, *SHORT)
    assert first.poll() is None, "the second run was refused while the first ran"
    output, _ = first.communicate(timeout=300)
    assert first.returncode == 0, output[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["max_train_steps"] == 150 and r["resumed_from_step"] == 0
    # Once it ended (its lock released by the kernel), the folder holds its finished run.
    with pytest.raises(SystemExit, match="holds a finished run"):
        run_recipe("baseline", out, *SHORT)


# ------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of a given size, mounted under tmp_path and removed after the test (needs root, as CI has)."""
    mounts = []

    def mount(size: int) -> Path:
        where = tmp_path / f"disk{len(mounts)}"
        where.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "--lazy", str(where)], check=False)  # a failed save's file may be open still


def _sizes(tmp_path) -> tuple[int, int]:
    """The tiny BERT's model and one checkpoint, in bytes, as this run writes them."""
    run_recipe("baseline", tmp_path / "sizes", *SHORT, "--checkpointing_steps", 2)
    step = tmp_path / "sizes" / "checkpoints" / "step_00000002"
    return (tmp_path / "sizes" / "model.safetensors").stat().st_size, sum(p.stat().st_size for p in step.iterdir())


def test_a_full_disk_is_named_before_the_work_is_lost(small_disk, tmp_path):
    model, checkpoint = _sizes(tmp_path)
    # Too small for the final model: refused before the first step, the disk and both sizes named.
    disk = small_disk(model // 2)
    with pytest.raises(SystemExit, match=rf"The disk holding .* \({disk}\) has .* free, and the final model needs"):
        run_recipe("baseline", disk / "out", *SHORT, "--checkpointing_steps", 2)
    assert not (disk / "out" / "checkpoints").exists()
    # Room for the model and one checkpoint: the second is refused before it is written (the first one's size is
    # what it needs), and the first stays whole.
    from shared.core.checkpoint import verify_checkpoint

    disk = small_disk(model + checkpoint + checkpoint // 2)
    with pytest.raises(SystemExit, match=r"checkpoint step_00000004 needs about .*earlier checkpoints are intact"):
        run_recipe("baseline", disk / "out", *SHORT[:1], 6, *SHORT[2:], "--checkpointing_steps", 2)
    kept = sorted((disk / "out" / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step_00000002"] and verify_checkpoint(kept[0]) is None


def test_a_disk_that_fills_during_the_save_is_named(small_disk, tmp_path):
    """Room for the model at the start, but the first checkpoint fills the disk: the save fails half-way (torch:
    `file write failed`), said as a full disk; its partial files are removed."""
    model, checkpoint = _sizes(tmp_path)
    disk = small_disk(model + checkpoint // 3)
    with pytest.raises(SystemExit, match=rf"The disk holding .* \({disk}\) is full .*checkpoint step_00000002 did "
                                         "not fit"):
        run_recipe("baseline", disk / "out", *SHORT, "--checkpointing_steps", 2)
    assert list((disk / "out" / "checkpoints").iterdir()) == [], "no partial checkpoint left"


# ------------------------------------------------------------------------------------ signals, however launched


def _wait_for_checkpoint(output_dir: Path, proc, timeout=300) -> None:
    deadline = time.time() + timeout
    while not list((output_dir / "checkpoints").glob("step_*")):
        assert proc.poll() is None, f"the run ended before its first checkpoint:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.05)


LONG = ["--max_train_steps", 2000, "--checkpointing_steps", 5, "--max_eval_samples", 16]


def test_sigterm_to_a_one_process_accelerate_launch_reaches_the_recipe(tmp_path):
    """The fault trial's case: `accelerate launch` of one process does not forward SIGTERM; it died and its recipe
    trained on with no save. The recipe asks the kernel for SIGTERM when its launcher dies (PR_SET_PDEATHSIG)."""
    import psutil

    cmd, env = launch_command("baseline", tmp_path, *LONG, config=None, launch_args=("--num_processes", "1"))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_checkpoint(tmp_path, proc)
    recipe = psutil.Process(proc.pid).children()[0]
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, as a scheduler signals the process it started
    output, _ = proc.communicate(timeout=120)  # the pipe closes once the recipe, too, has ended
    psutil.wait_procs([recipe], timeout=60)
    assert "SIGTERM received: saved" in output, output[-3000:]
    from shared.core.checkpoint import verify_checkpoint

    newest = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
    assert verify_checkpoint(newest) is None and not (tmp_path / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_the_supervisor_as_pid_1_forwards_and_exits_128_plus_signal(processes, tmp_path):
    """A container's PID 1 (a new PID namespace): examples/supervise.py receives the SIGTERM `docker stop` sends,
    forwards it, waits for the recipe's save, and exits 143 even where torch elastic (2 processes) exits 1."""
    import psutil

    config = "multi_cpu.yaml" if processes == 2 else None
    cmd, env = launch_command("baseline", tmp_path, *LONG, "--logging_steps", 2, config=config,
                              launch_args=() if config else ("--num_processes", "1"))
    wrapped = ["unshare", "--pid", "--fork", sys.executable, str(ROOT / "examples" / "supervise.py"), *cmd]
    proc = subprocess.Popen(wrapped, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_checkpoint(tmp_path, proc)
    supervisor = psutil.Process(proc.pid).children()[0]  # PID 1 of the new namespace
    supervisor.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert output.count("SIGTERM received: saved") == processes, output[-3000:]  # each process saved its part
    from shared.core.checkpoint import verify_checkpoint

    assert verify_checkpoint(sorted((tmp_path / "checkpoints").glob("step_*"))[-1]) is None


# ------------------------------------------------------------------------------------ the run's own files (issue 36)


def test_an_output_path_too_long_for_the_filesystem_is_refused_at_the_start(tmp_path):
    """The second fault trial's case: a component over 255 bytes, or a path near PATH_MAX, failed with
    `OSError: [Errno 36]` (with --report_to none, after 2 steps, at the first checkpoint)."""
    with pytest.raises(SystemExit, match=r"over the 255 a name may have there \(ENAMETOOLONG\). Pass a shorter"):
        run_recipe("baseline", tmp_path / ("x" * 300), *SHORT, "--checkpointing_steps", 2)
    deep = tmp_path.joinpath(*["d" * 250] * 16)  # 16 x 251 bytes: each part fits, the whole does not
    with pytest.raises(SystemExit, match=r"would pass the 4096 a path may have there \(ENAMETOOLONG\)"):
        run_recipe("baseline", deep, *SHORT, "--checkpointing_steps", 2)
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_trackers_on_a_full_disk_are_refused_at_the_start(small_disk, tmp_path):
    """The TensorBoard folder on a full disk: `OSError: [Errno 28]` in start_run. Now named, with the fixes."""
    disk = small_disk(1 << 20)
    (disk / "filler").write_bytes(b"\0" * ((1 << 20) - 4096))
    with pytest.raises(SystemExit, match=r"--report_to tensorboard: the trackers could not start writing in .*"
                                         r"No space left on device.*--report_to none"):
        run_recipe("baseline", disk / "out", *SHORT, "--report_to", "tensorboard", "--no_save_model")


def _at_step(monkeypatch, step: int, act) -> None:
    """`act()` just before optimizer step `step` (1-based) is recorded."""
    from shared.core.meter import Meter

    record = Meter.record

    def record_after(self, at, loss, batches):
        if at + 1 == step:
            act()
        record(self, at, loss, batches)

    monkeypatch.setattr(Meter, "record", record_after)


def test_a_disk_that_turns_read_only_mid_run_is_reported_and_named_not_a_crash(small_disk, monkeypatch, tmp_path,
                                                                               caplog):
    """The second fault trial's case: the output folder remounted read-only mid-run; the run died in the TensorBoard
    write at the next step (`OSError: [Errno 30]`). Now the tracker's failure is reported once and training goes on;
    the next checkpoint, which cannot be written either, stops the run naming what happened and that the earlier
    checkpoints are intact: no traceback."""
    from shared.core.checkpoint import verify_checkpoint

    disk = small_disk(64 << 20)

    def remount_read_only() -> None:
        # The tracker's open file first takes an fd that refuses writes, as on the remounted disk (a disk with a file
        # open for writing cannot be remounted read-only); then the disk is.
        ro = os.open(os.devnull, os.O_RDONLY)
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}").startswith(str(disk)):
                    os.dup2(ro, int(fd))
        os.close(ro)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)

    _at_step(monkeypatch, 3, remount_read_only)
    with caplog.at_level("ERROR", logger="recipes"), pytest.raises(SystemExit) as exc:
        run_recipe("baseline", disk / "out", *SHORT[:1], 6, *SHORT[2:], "--checkpointing_steps", 2, "--report_to",
                   "tensorboard", "--logging_steps", 1)
    assert "the trackers (tensorboard) could not write at step 3" in caplog.text, caplog.text[-2000:]
    assert "training goes on without them" in caplog.text and caplog.text.count("could not write at step") == 1
    said = str(exc.value.code)
    assert "checkpoint step_00000004 could not be written under" in said and "Read-only file system" in said, said
    assert "earlier checkpoints are intact" in said
    assert verify_checkpoint(disk / "out" / "checkpoints" / "step_00000002") is None


@pytest.mark.slow
def test_sighup_to_a_two_process_launcher_saves_on_every_process(tmp_path):
    """The second fault trial's case: SIGHUP to a 2-process `accelerate launch` (a closed terminal, an ssh drop)
    killed the workers without a save. torch elastic forwards it to the workers, which now save like on SIGTERM."""
    cmd, env = launch_command("baseline", tmp_path, *LONG, "--logging_steps", 2)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    _wait_for_checkpoint(tmp_path, proc)
    os.kill(proc.pid, signal.SIGHUP)  # the launcher alone
    output, _ = proc.communicate(timeout=180)
    assert output.count("SIGHUP received: saved") == 2, output[-3000:]
    from shared.core.checkpoint import verify_checkpoint

    assert verify_checkpoint(sorted((tmp_path / "checkpoints").glob("step_*"))[-1]) is None
