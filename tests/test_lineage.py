"""The second fault trial (issue 36): a rollback starts a branch of the run that `latest` follows, whatever
--save_total_limit prunes; results are written once per training (a resume with nothing to train, an elastic restart
after the end); the signals of a closed terminal (SIGHUP) and of Slurm's warning (SIGUSR1) save like SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from shared.core import checkpoint
from tests.conftest import load_params, max_param_diff, run_recipe
from tests.test_run_lifecycle import _signal_after_step  # a real signal as a step ends

EIGHT = ["--max_train_steps", 8, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16,
         "--logging_steps", 1]


class Killed(BaseException):
    """A kill -9 as this process sees it: nothing after the save runs (no handler, no final model)."""


def _killed_after_save(monkeypatch, step: int) -> None:
    save = checkpoint.save_checkpoint

    def save_then_die(accelerator, launch, at, *args, **kwargs):
        path = save(accelerator, launch, at, *args, **kwargs)
        if at >= step:
            raise Killed(path)
        return path

    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_die)


def _branches(out) -> dict[str, int]:
    return {p.name: json.loads((p / "trainer_state.json").read_text()).get("branch", 0)
            for p in sorted((out / "checkpoints").glob("step_*"))}


@pytest.mark.parametrize("limit", [None, 2])
def test_a_rollback_then_a_crash_resumes_the_new_branch(limit, monkeypatch, tmp_path, caplog):
    """docs/faults.md's loss-spike workflow: preempted at step 6 (lr 1e-3), resumed from step_2 with lr 5e-4, killed
    after that branch's step_4. `latest` takes the new step_4 (not the abandoned step_6), and the run ends where an
    uninterrupted run of the new branch does. With --save_total_limit 2 the rollback point step_2 is kept and the
    abandoned step_6 goes."""
    first = tmp_path / "first"
    with monkeypatch.context() as m, pytest.raises(SystemExit):
        _signal_after_step(m, 6, signal.SIGTERM)
        run_recipe("baseline", first, *EIGHT)
    assert sorted(_branches(first)) == ["step_00000002", "step_00000004", "step_00000006"]
    out, ref = tmp_path / "out", tmp_path / "ref"
    shutil.copytree(first, out)
    shutil.copytree(first, ref)
    keep = ["--save_total_limit", limit] if limit else []
    # The intended branch, never interrupted.
    run_recipe("baseline", ref, *EIGHT, *keep, "--learning_rate", 5e-4, "--resume_from_checkpoint",
               ref / "checkpoints" / "step_00000002")
    with monkeypatch.context() as m, pytest.raises(Killed):
        _killed_after_save(m, 4)
        run_recipe("baseline", out, *EIGHT, *keep, "--learning_rate", 5e-4, "--resume_from_checkpoint",
                   out / "checkpoints" / "step_00000002")
    left = _branches(out)
    if limit:
        assert left == {"step_00000002": 0, "step_00000004": 1}, "the rollback point kept, the abandoned step gone"
    else:
        assert left == {"step_00000002": 0, "step_00000004": 1, "step_00000006": 0}
    with caplog.at_level("INFO", logger="recipes"):
        r = run_recipe("baseline", out, *EIGHT, *keep, "--learning_rate", 5e-4, "--resume_from_checkpoint", "latest")
    assert r["resumed_from_step"] == 4 and r["resume_changes"] == {}
    assert r["lineage"]["branch"] == 1 and r["lineage"]["parent"] == 0 and r["lineage"]["from_step"] == 2
    assert "(branch 1)" in caplog.text
    diff = max_param_diff(load_params(ref), load_params(out))
    abandoned = max_param_diff(load_params(ref), load_params(first / "checkpoints" / "step_00000006"))
    print(f"limit {limit}: resumed branch vs its uninterrupted run {diff:.1e}; vs the abandoned step_6 {abandoned:.1e}")
    assert diff <= 1e-7 < abandoned
    lineage = json.loads((out / "checkpoints" / "lineage.json").read_text())
    assert [(b["branch"], b["parent"], b["from_step"]) for b in lineage] == [(0, None, None), (1, 0, 2)]
    assert lineage[1]["changes"] == {"learning_rate": [1e-3, 5e-4]}


def test_results_are_written_once_per_training(tmp_path, caplog):
    """A resume of a finished run has nothing to train: results.json stays as the training wrote it (it was rewritten
    with null losses and throughput)."""
    short = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16]
    run_recipe("baseline", tmp_path, *short)
    before = (tmp_path / "results.json").read_bytes()
    weights = (tmp_path / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level("WARNING", logger="recipes"):
        r = run_recipe("baseline", tmp_path, *short, "--resume_from_checkpoint", "latest")
    assert "is finished" in caplog.text and "results are left as they are" in caplog.text
    assert (tmp_path / "results.json").read_bytes() == before and r["train_loss"] is not None
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == weights
    # A run that wrote no checkpoint at its last step (no --checkpointing_steps): `latest` found none and trained it
    # again from scratch, writing over its results.
    plain = tmp_path / "plain"
    run_recipe("baseline", plain, *short[:2], *short[4:])
    before = (plain / "results.json").read_bytes()
    caplog.clear()
    with caplog.at_level("WARNING", logger="recipes"):
        run_recipe("baseline", plain, *short[:2], *short[4:], "--resume_from_checkpoint", "latest")
    assert "is finished" in caplog.text and (plain / "results.json").read_bytes() == before


class KilledBeforeSave(BaseException):
    """A kill -9 before the run's first checkpoint is written."""


def test_latest_follows_the_line_its_checkpoints_record(monkeypatch, tmp_path, caplog):
    """The lineage's record lost (lineage.json deleted, cut short, or an older copy without the rollback's branch):
    `latest` took the abandoned branch 0's step_6. Its checkpoints record their branch and parent: it takes branch 1's
    step_4."""
    first = tmp_path / "first"
    with monkeypatch.context() as m, pytest.raises(SystemExit):
        _signal_after_step(m, 6, signal.SIGTERM)
        run_recipe("baseline", first, *EIGHT)
    with monkeypatch.context() as m, pytest.raises(Killed):
        _killed_after_save(m, 4)
        run_recipe("baseline", first, *EIGHT, "--learning_rate", 5e-4, "--resume_from_checkpoint",
                   first / "checkpoints" / "step_00000002")
    assert _branches(first) == {"step_00000002": 0, "step_00000004": 1, "step_00000006": 0}
    for damage in ("deleted", "cut", "stale"):
        out = tmp_path / damage
        shutil.copytree(first, out)
        record = out / "checkpoints" / "lineage.json"
        stale = json.dumps(json.loads(record.read_text())[:1])  # as copied before the rollback began
        record.unlink() if damage == "deleted" else record.write_text(
            record.read_text()[:20] if damage == "cut" else stale)
        r = run_recipe("baseline", out, *EIGHT, "--learning_rate", 5e-4, "--resume_from_checkpoint", "latest")
        assert r["resumed_from_step"] == 4 and r["lineage"]["branch"] == 1 and r["lineage"]["from_step"] == 2, damage


def test_a_line_begun_at_another_folders_checkpoint_resumes_there(monkeypatch, tmp_path, caplog):
    """--resume_from_checkpoint of another run's checkpoint into a new --output_dir, killed before its first save:
    `latest` there found no checkpoint and trained from scratch. It resumes where the line began, and ends where
    the uninterrupted run does; with that checkpoint gone, it is refused by name."""
    short = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16]
    run_recipe("baseline", tmp_path / "a", *short)
    start = tmp_path / "a" / "checkpoints" / "step_00000002"
    save = checkpoint.save_checkpoint

    def killed(accelerator, launch, at, *args, **kwargs):
        if at >= 3:
            raise KilledBeforeSave(at)
        return save(accelerator, launch, at, *args, **kwargs)

    out = tmp_path / "b"
    with monkeypatch.context() as m, pytest.raises(KilledBeforeSave):
        m.setattr(checkpoint, "save_checkpoint", killed)
        run_recipe("baseline", out, *short, "--checkpointing_steps", 3, "--resume_from_checkpoint", start)
    assert not list((out / "checkpoints").glob("step_*")) and (out / "checkpoints" / "lineage.json").exists()
    run_recipe("baseline", tmp_path / "ref", *short, "--resume_from_checkpoint", start)
    with caplog.at_level("WARNING", logger="recipes"):
        r = run_recipe("baseline", out, *short, "--resume_from_checkpoint", "latest")
    assert r["resumed_from_step"] == 2 and "where it started" in caplog.text
    assert max_param_diff(load_params(tmp_path / "ref"), load_params(out)) <= 1e-7


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1])
def test_sighup_and_sigusr1_save_like_sigterm(signum, monkeypatch, tmp_path):
    """A closed terminal or dropped ssh session (SIGHUP) and Slurm's warning before the time limit (SIGUSR1) killed
    a 1-process run without a save. Now: saved at the next step, exit 128 + the signal, and the resume is exact."""
    short = ["--max_train_steps", 4, "--max_train_samples", 64, "--max_eval_samples", 16]
    _signal_after_step(monkeypatch, 2, signum)
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "cut", *short)
    assert exc.value.code == 128 + signum
    assert [p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()] == ["step_00000002"]
    monkeypatch.undo()
    r = run_recipe("baseline", tmp_path / "cut", *short, "--resume_from_checkpoint", "latest")
    assert r["resumed_from_step"] == 2 and r["lineage"]["branch"] == 0, "the same branch, continued"
    run_recipe("baseline", tmp_path / "whole", *short)
    assert max_param_diff(load_params(tmp_path / "whole"), load_params(tmp_path / "cut")) <= 1e-7


def test_other_folders_beside_the_checkpoints_are_left_alone(tmp_path, caplog):
    """docs/resharding.md's fix for a ZeRO checkpoint on another process count writes checkpoints/step_N_universal
    beside it; resuming from it raised `ValueError: invalid literal for int() with base 10: 'universal'` (and `latest`
    after it too). A folder there that is not step_<N> (reshard's, a user's backup) is resumed by path, never taken by
    `latest`, counted or pruned by --save_total_limit."""
    short = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16]
    run_recipe("baseline", tmp_path, *short[:2], "--checkpointing_steps", 2, *short[4:])
    (tmp_path / "results.json").unlink()
    backup = tmp_path / "checkpoints" / "step_00000002_backup"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000002", backup)
    r = run_recipe("baseline", tmp_path, *short, "--save_total_limit", 1, "--resume_from_checkpoint", backup)
    assert r["resumed_from_step"] == 2 and r["lineage"]["branch"] == 1 and backup.is_dir()
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002_backup",
                                                                                 "step_00000004"]
    with caplog.at_level("WARNING", logger="recipes"):
        run_recipe("baseline", tmp_path, *short, "--resume_from_checkpoint", "latest")
    assert "is finished" in caplog.text
