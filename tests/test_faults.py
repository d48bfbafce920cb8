"""A checkpoint knows its run: damaged manifests are skipped like truncated files, another run's checkpoints are
never resumed nor deleted nor replaced, a resume that changes a setting the checkpoint depends on is refused
naming it, a new learning rate is applied (not silently ignored), and the divergence guard's state loads."""

from __future__ import annotations

import json
import shutil

import pytest

from shared.core.rundir import FINISHED
from tests.conftest import load_params, max_param_diff, run_recipe

FOUR = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished 4-step baseline run with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("saved")
    run_recipe("baseline", out, *FOUR)
    return out


def _manifest_damages() -> dict[str, object]:
    """What a damaged manifest can look like: each must be skipped by `latest`, never trusted or crashed on."""
    return {
        "random bytes": b"\x8f\xff\x00\xfe garbage \xc3",
        "a JSON list": [["model.safetensors", 1]],
        "an empty manifest": {},
        "no sha256": {"trainer_state.json": {"bytes": 10}},
        "a size that is text": {"trainer_state.json": {"bytes": "10", "sha256": "0" * 64}},
        "a path outside the checkpoint": {"trainer_state.json": {"bytes": 1, "sha256": "0" * 64},
                                          "../../escape": {"bytes": 1, "sha256": "0" * 64}},
        "JSON null": None,
    }


@pytest.mark.parametrize("damage", list(_manifest_damages()))
def test_a_damaged_manifest_is_skipped_by_latest(damage, saved, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    manifest = out / "checkpoints" / "step_00000004" / "manifest.json"
    value = _manifest_damages()[damage]
    manifest.write_bytes(value if isinstance(value, bytes) else json.dumps(value).encode())
    with caplog.at_level("WARNING", logger="recipes"):
        r = run_recipe("baseline", out, *FOUR[:2], "--resume_from_checkpoint", "latest", "--max_train_samples", 64,
                       "--max_eval_samples", 16, "--no_save_model", "--max_train_steps", 6)
    assert r["resumed_from_step"] == 2, "the previous, whole checkpoint"
    assert "skipping checkpoint" in caplog.text and "step_00000004" in caplog.text


def test_a_damaged_state_file_is_skipped(saved, tmp_path):
    """The state file listed, sized and hashed as written, but not a state: a checker that trusts nothing."""
    from shared.core.checkpoint import _sha256, verify_checkpoint

    ckpt = tmp_path / "step"
    shutil.copytree(saved / "checkpoints" / "step_00000004", ckpt)
    (ckpt / "trainer_state.json").write_text("[1, 2]")
    entries = json.loads((ckpt / "manifest.json").read_text())
    entries["trainer_state.json"] = {"bytes": 6, "sha256": _sha256(ckpt / "trainer_state.json")}
    (ckpt / "manifest.json").write_text(json.dumps(entries))
    assert "trainer_state.json is damaged" in verify_checkpoint(ckpt)


def test_another_runs_checkpoints_are_never_resumed_deleted_or_replaced(saved, tmp_path, caplog):
    """The fault trial's case: a new run (another seed, --save_total_limit 1) in a folder holding an old run's
    checkpoints. It is refused before its first step; `latest` skips the old run's, naming the difference."""
    out = tmp_path / "run"
    shutil.copytree(saved, out)
    for name in FINISHED:  # its checkpoints only, as a preempted run leaves them (a finished run: test_run_lifecycle)
        (out / name).unlink(missing_ok=True)
    before = {p.name: (p / "model.safetensors").read_bytes() for p in (out / "checkpoints").glob("step_*")}
    with pytest.raises(SystemExit, match=r"holds checkpoints of another run \(step_\d+: --seed was 42, now 7\)"):
        run_recipe("baseline", out, *FOUR, "--seed", 7, "--save_total_limit", 1)
    with caplog.at_level("WARNING", logger="recipes"), pytest.raises(SystemExit, match="another run"):
        run_recipe("baseline", out, *FOUR, "--seed", 7, "--resume_from_checkpoint", "latest")
    assert "another run's (--seed was 42, now 7)" in caplog.text
    assert {p.name: (p / "model.safetensors").read_bytes() for p in (out / "checkpoints").glob("step_*")} == before


@pytest.mark.parametrize("change, words", [
    (["--model_preset", "base"], "--model_preset was 'tiny', now 'base'"),
    (["--task", "causal-lm"], "--task was 'text-classification', now 'causal-lm'"),
    (["--max_train_samples", 48], "--max_train_samples was 64, now 48"),  # other data
    (["--seed", 3], "--seed was 42, now 3"),
])
def test_a_resume_that_changes_what_the_checkpoint_holds_is_refused(change, words, saved, tmp_path):
    ckpt = saved / "checkpoints" / "step_00000002"
    argv = [*FOUR[:2], "--max_train_samples", 64, "--max_eval_samples", 16, *change]
    with pytest.raises(SystemExit, match="was written by another run") as exc:
        run_recipe("baseline", tmp_path / "out", *argv, "--resume_from_checkpoint", ckpt)
    assert words in str(exc.value.code) and "Resume with that run's settings" in str(exc.value.code)
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_new_learning_rate_on_resume_is_applied_and_reported(saved, tmp_path):
    ckpt = saved / "checkpoints" / "step_00000002"
    same = run_recipe("baseline", tmp_path / "same", *FOUR, "--resume_from_checkpoint", ckpt)
    lower = run_recipe("baseline", tmp_path / "lower", *FOUR, "--resume_from_checkpoint", ckpt,
                       "--learning_rate", 1e-4)
    assert same["resume_changes"] == {} and same["resumed_from_step"] == 2
    # A plain resume continues the saved run (in-process, so within float rounding of the thread pool's sums).
    plain = max_param_diff(load_params(saved), load_params(tmp_path / "same"))
    assert plain <= 1e-7
    assert lower["resume_changes"] == {"learning_rate": [1e-3, 1e-4]} and lower["learning_rate"] == 1e-4
    acted = max_param_diff(load_params(tmp_path / "same"), load_params(tmp_path / "lower"))
    assert acted > 1000 * max(plain, 1e-9), f"the new rate was not applied ({acted:.1e} vs {plain:.1e})"


def test_the_divergence_guards_state_loads(tmp_path):
    from shared.core.checkpoint import verify_checkpoint

    with pytest.raises(SystemExit, match=r"--resume_from_checkpoint \S+diverged_step_\d+ loads it"):
        run_recipe("baseline", tmp_path, "--max_train_steps", 40, "--learning_rate", 1e30, "--max_grad_norm", 0,
                   "--logging_steps", 5)
    diverged = next(tmp_path.glob("diverged_step_*"))
    assert verify_checkpoint(diverged) is None
    state = json.loads((diverged / "trainer_state.json").read_text())
    assert state["step"] == int(diverged.name.split("_")[-1]) and state["run"]["learning_rate"] == 1e30


@pytest.mark.slow
def test_a_resume_on_another_process_count_that_changes_the_global_batch_is_refused(saved, tmp_path):
    """Saved by 1 process x 16, resumed by 2 x 16: the global batch (and the data position) would double. Refused,
    naming the per-device batch that keeps it (docs/resharding.md: resuming at 2 x 8 continues the run)."""
    from tests.conftest import launch

    proc = launch("baseline", tmp_path / "out", *FOUR[:2], "--max_train_samples", 64, "--max_eval_samples", 16,
                  "--resume_from_checkpoint", saved / "checkpoints" / "step_00000002", expect_fail=True)
    said = proc.stdout + proc.stderr
    assert "--num_processes was 1, now 2" in said and "was 16, now 32: pass --per_device_train_batch_size 8" in said
    assert not (tmp_path / "out" / "results.json").exists()
