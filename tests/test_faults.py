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


# ------------------------------------------------------------------ the second fault trial: what a resume applies


def test_every_flag_has_a_verdict_and_the_docs_table_holds_it():
    """docs/faults.md's table of every common flag's verdict on resume is the code's (shared/tools/resume_flags.py);
    every applied flag is shown applied below (APPLIED_CASES), and every other flag is refused, laid out or free."""
    from shared.core.checkpoint import APPLIED, FIXED, FREE, LAYOUT
    from shared.tools.resume_flags import DOCS, END, MARK, common_flags, table

    assert set(APPLIED_CASES) == set(APPLIED)
    assert not set(APPLIED) & set(FREE) and not set(LAYOUT) & set(FREE) and not set(FIXED) & set(FREE + APPLIED)
    assert set(common_flags()) >= set(APPLIED) | set(FREE) - {"elastic_restarts"}
    page = DOCS.read_text()
    assert page.split(MARK, 1)[1].split(END, 1)[0] == table(), "python -m shared.tools.resume_flags --write"


APPLIED_CASES = {  # flag -> the resume's flags (from a 4-step checkpoint at step 2, trained at these defaults)
    "weight_decay": ["--weight_decay", 0.5],
    "max_grad_norm": ["--max_grad_norm", 0.01],
    "learning_rate": ["--learning_rate", 1e-4],
    "lr_scheduler_type": ["--lr_scheduler_type", "constant"],
    "num_warmup_steps": ["--num_warmup_steps", 3],
    "max_train_steps": ["--max_train_steps", 6],
    "num_train_epochs": ["--num_train_epochs", 2],  # (from a run of --num_train_epochs 1: 4 steps)
}


def _applied(flags: list[str], saved, tmp_path) -> None:
    """Each flag the table calls applied changes the parameters (by far more than a plain resume's rounding), is
    reported, and starts branch 1 from step 2."""
    base = ["--max_train_samples", 64, "--max_eval_samples", 16, "--checkpointing_steps", 2]
    ckpt = saved / "checkpoints" / "step_00000002"
    run_recipe("baseline", tmp_path / "same", *FOUR, "--resume_from_checkpoint", ckpt)
    plain = max(max_param_diff(load_params(saved), load_params(tmp_path / "same")), 1e-9)
    for flag in flags:
        change, out, reference = APPLIED_CASES[flag], tmp_path / flag, tmp_path / "same"
        if flag == "num_train_epochs":  # its own 1-epoch run (4 steps) and plain resume
            epochs, reference = tmp_path / "epochs", tmp_path / "same_epochs"
            run_recipe("baseline", epochs, *base, "--num_train_epochs", 1)
            run_recipe("baseline", reference, *base, "--num_train_epochs", 1, "--resume_from_checkpoint",
                       epochs / "checkpoints" / "step_00000002")
            r = run_recipe("baseline", out, *base, *change, "--resume_from_checkpoint",
                           epochs / "checkpoints" / "step_00000002")
        else:
            r = run_recipe("baseline", out, *FOUR, *change, "--resume_from_checkpoint", ckpt)
        assert list(r["resume_changes"]) == [flag] and r["resume_changes"][flag][1] == change[1], r["resume_changes"]
        assert r["lineage"]["branch"] == 1 and r["lineage"]["from_step"] == 2
        acted = max_param_diff(load_params(reference), load_params(out))
        print(f"--{flag} {change[1]} on resume: max abs param diff vs the plain resume {acted:.1e} ({plain:.1e})")
        assert acted > 1000 * plain, f"--{flag} was not applied ({acted:.1e})"


def test_a_new_weight_decay_clipping_or_schedule_on_resume_is_applied(saved, tmp_path):
    """The fault trial's case: `--weight_decay 0.5` on resume was reported as applied, but load_state brought the old
    0.01 back and the parameters equalled the 0.01 run's exactly. Now applied, and the saved optimizer holds it."""
    import torch

    _applied(["weight_decay", "max_grad_norm", "lr_scheduler_type"], saved, tmp_path)
    groups = torch.load(tmp_path / "weight_decay" / "checkpoints" / "step_00000004" / "optimizer.bin",
                        weights_only=True)["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0], "the saved optimizer holds the new weight decay"


@pytest.mark.slow
def test_every_other_applied_flag_on_resume_is_applied(saved, tmp_path):
    _applied(["learning_rate", "num_warmup_steps", "max_train_steps", "num_train_epochs"], saved, tmp_path)


def _rehash(ckpt) -> None:
    """The manifest made to match edited files: a damage the manifest does not see (what this test is about)."""
    from shared.core.checkpoint import _write_manifest

    (ckpt / "manifest.json").unlink()
    _write_manifest(ckpt)


@pytest.mark.parametrize("case", ["no run record", "no layout record", "no data record", "a flag not recorded"])
def test_a_checkpoint_that_does_not_record_what_it_depends_on_is_refused(case, saved, tmp_path):
    """The fault trial's case: a checkpoint whose trainer_state.json had no run record accepted a changed --seed,
    one with no layout fields a halved global batch. Unknown now means refused, before loading, with the fix."""
    ckpt = tmp_path / "step"
    shutil.copytree(saved / "checkpoints" / "step_00000002", ckpt)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    drop = {"no run record": ["run"], "no layout record": ["per_device_train_batch_size", "num_processes"],
            "no data record": ["data_content"], "a flag not recorded": ["disable_dropout"]}[case]
    for key in drop:
        state.pop(key, None) if key == "run" else state["run"].pop(key)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _rehash(ckpt)
    extra = ["--disable_dropout"] if case == "a flag not recorded" else ["--seed", 3] if case == "no run record" else []
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "out", *FOUR, *extra, "--resume_from_checkpoint", ckpt)
    said = str(exc.value.code)
    if case == "a flag not recorded":  # a flag that did not exist then, typed now: refused by name
        assert "--disable_dropout was 'not recorded', now True" in said, said
    else:
        assert "does not record" in said and "start afresh in another --output_dir" in said, said
        assert all(k in said for k in (drop if drop != ["run"] else ["seed", "recipe"])), said
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("change, words", [
    (["--mixed_precision", "bf16"], "--mixed_precision was 'no', now 'bf16'"),
    (["--mixed_precision", "fp16"], "--mixed_precision was 'no', now 'fp16'"),
    (["--disable_dropout"], "--disable_dropout was False, now True"),
    (["--attn_implementation", "eager"], "--attn_implementation was None, now 'eager'"),
])
def test_a_resume_that_changes_what_the_state_depends_on_is_refused(change, words, saved, tmp_path):
    """Precision (fp32 -> fp16 failed on a missing scaler.pt; -> bf16 was taken without a word) and every flag the
    table does not apply: refused before loading, both values named."""
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "out", *FOUR, *change, "--resume_from_checkpoint",
                   saved / "checkpoints" / "step_00000002")
    assert words in str(exc.value.code), str(exc.value.code)
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_data_file_replaced_under_the_same_name_is_refused(tmp_path):
    """The fault trial's case: --train_file with its content replaced resumed without a word (diff 1.4e-3). Its
    content is recorded (size and crc32) and compared before loading."""
    import random

    def text(path, seed):
        rng = random.Random(seed)
        path.write_text("\n".join(" ".join(rng.choice("abcdefgh") * 3 for _ in range(40)) for _ in range(48)))
        return path

    train, val = text(tmp_path / "train.txt", 0), text(tmp_path / "val.txt", 1)
    args = ["--task", "causal-lm", "--train_file", train, "--validation_file", val, "--max_train_steps", 4,
            "--checkpointing_steps", 2, "--max_seq_length", 64, "--no_save_model"]
    run_recipe("baseline", tmp_path / "run", *args)
    text(train, 2)
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "run", *args, "--max_train_steps", 6, "--resume_from_checkpoint", "latest")
    said = str(exc.value.code)
    assert "was trained on other data: --train_file held 1 file(s)" in said and ", now 1 file(s)" in said, said
    assert "Resume with the data it was trained on" in said


@pytest.mark.slow  # DeepSpeed, launched 4 times (one in-process DeepSpeed run per test process)
def test_a_resume_on_another_sharding_or_precision_is_refused_before_loading(tmp_path):
    """The fault trial's cases: a ZeRO-2 checkpoint resumed under ZeRO-3 (a bare AssertionError from DeepSpeed's
    check_ckpt_list), ZeRO-2 fp32 -> bf16 (FileNotFoundError: bf16_zero_pp_rank_0_..._optim_states.pt). The
    checkpoint records the sharding and the precision; another is refused before loading, naming both."""
    from tests.conftest import launch

    one = {"config": None, "launch_args": ("--num_processes", "1")}
    args = ["--max_train_steps", 4, "--checkpointing_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16,
            "--no_save_model"]
    launch("zero", tmp_path / "run", *args, "--zero_stage", 2, **one)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    for change, words in ((["--zero_stage", 3], "the launch config's sharding was 'zero2', now 'zero3'"),
                          (["--zero_stage", 1], "the launch config's sharding was 'zero2', now 'zero1'"),
                          (["--zero_stage", 2, "--mixed_precision", "bf16"], "--mixed_precision was 'no', now 'bf16'")):
        proc = launch("zero", tmp_path / "out", *args, *change, "--resume_from_checkpoint", ckpt, expect_fail=True,
                      **one)
        said = proc.stdout + proc.stderr
        assert words in said and "was written with another layout" in said, said[-3000:]
        assert "AssertionError" not in said and "FileNotFoundError" not in said, said[-3000:]
    assert not (tmp_path / "out" / "results.json").exists()
