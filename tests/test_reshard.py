"""Resume on another world size (docs/resharding.md): a checkpoint saved at 2 processes x 4 per device resumes at
4 x 2 (FSDP2, tensor parallel: torch.distributed.checkpoint reshards), 1 x 8 (DDP: a full state) and 1 x 4 x 2
accumulation, to the parameters of the uninterrupted run, and every optimizer step reads the samples it read there.

Each run records its samples (--record_samples: a CRC32 per row, per process, per step); the reference runs are
made once per module and checkpoint halfway, so the resumed runs continue their step-4 checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import launch, load_params, max_param_diff, run_recipe

STEPS, HALF = 8, 4
# fp32, no dropout, constant LR: runs that differ only in how the global batch of 8 is split end alike.
COMMON = ("--task", "causal-lm", "--disable_dropout", "--max_train_steps", str(STEPS), "--max_train_samples", "128",
          "--max_eval_samples", "16", "--max_seq_length", "32", "--learning_rate", "3e-3",
          "--lr_scheduler_type", "constant", "--logging_steps", str(HALF), "--record_samples")
SAVE = ("--per_device_train_batch_size", "4", "--checkpointing_steps", str(HALF))
TOL = 1e-5  # measured: FSDP2 2x4 -> 4x2 2.4e-6, DDP 2x4 -> 1x8 and TP 2 -> 4 about 1e-7


def samples(run_dir: Path) -> dict[int, list[int]]:
    """step -> the samples every process read at that step (tensor parallel: one process per group records)."""
    steps: dict[int, list[int]] = {}
    for path in sorted(run_dir.glob("samples_*.jsonl")):
        for line in path.read_text().splitlines():
            step, rows = json.loads(line)
            steps.setdefault(step, []).extend(rows)
    return steps


def assert_continues(reference: Path, resumed: Path, r: dict) -> None:
    """The resumed run starts at the checkpoint's step, ends at the uninterrupted run's parameters, and reads, per
    step, the uninterrupted run's samples: none repeated, none skipped."""
    assert r["resumed_from_step"] == HALF
    full, cont = samples(reference), samples(resumed)
    assert sorted(full) == list(range(STEPS)) and sorted(cont) == list(range(HALF, STEPS)), (sorted(full), sorted(cont))
    for step in range(HALF, STEPS):
        assert sorted(cont[step]) == sorted(full[step]), f"step {step} read other samples"
    seen = [x for s in range(HALF) for x in full[s]] + [x for s in cont for x in cont[s]]
    assert len(seen) == len(set(seen)) == sum(len(v) for v in full.values())  # nothing twice, nothing left out
    diff = max_param_diff(load_params(reference), load_params(resumed))
    print(f"{r['recipe']} resumed on {r['num_processes']} x {r['per_device_train_batch_size']} "
          f"(accumulation {r['gradient_accumulation_steps']}): max |param - uninterrupted| = {diff:.1e}")
    assert diff <= TOL


def _checkpoint(run_dir: Path) -> str:
    return str(run_dir / "checkpoints" / f"step_{HALF:08d}")


@pytest.fixture(scope="module")
def fsdp_ref(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp_2x4")
    r = launch("fsdp", out, *COMMON, *SAVE, config="fsdp.yaml")
    assert (r["distributed_type"], r["num_processes"]) == ("FSDP", 2)
    return out


@pytest.fixture(scope="module")
def ddp_ref(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp_2x4")
    r = launch("data_parallel", out, *COMMON, *SAVE)
    assert (r["distributed_type"], r["num_processes"]) == ("MULTI_CPU", 2)
    return out


def test_fsdp2_checkpoint_of_2x4_resumes_at_4x2(fsdp_ref, tmp_path):
    """DCP reshards the 2 saved shards of every parameter and AdamW moment into 4."""
    shards = sorted(p.name for p in (Path(_checkpoint(fsdp_ref)) / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    r = launch("fsdp", tmp_path, *COMMON, "--per_device_train_batch_size", "2",
               "--resume_from_checkpoint", _checkpoint(fsdp_ref), config="fsdp.yaml",
               launch_args=("--num_processes", "4"))
    assert (r["distributed_type"], r["num_processes"]) == ("FSDP", 4)
    assert len(r["param_bytes"]) == 4 and max(r["param_bytes"]) < 0.3 * sum(r["param_bytes"])  # 4 shards now
    assert_continues(fsdp_ref, tmp_path, r)


def test_ddp_checkpoint_of_2x4_resumes_in_one_process_at_1x8(ddp_ref, tmp_path):
    r = run_recipe("data_parallel", tmp_path, *COMMON, "--per_device_train_batch_size", "8",
                   "--resume_from_checkpoint", _checkpoint(ddp_ref))
    assert r["num_processes"] == 1
    assert_continues(ddp_ref, tmp_path, r)


def test_accumulation_changes_with_the_global_batch_kept(tmp_path):
    """1 x 8 saved, 1 x 4 x 2 accumulation resumed: the data position is counted in the new micro-batches."""
    ref = tmp_path / "ref"
    run_recipe("gradient_accumulation", ref, *COMMON, "--per_device_train_batch_size", "8",
               "--gradient_accumulation_steps", "1", "--checkpointing_steps", str(HALF))
    r = run_recipe("gradient_accumulation", tmp_path / "acc", *COMMON, "--per_device_train_batch_size", "4",
                   "--gradient_accumulation_steps", "2", "--resume_from_checkpoint", _checkpoint(ref))
    assert r["gradient_accumulation_steps"] == 2
    assert_continues(ref, tmp_path / "acc", r)


@pytest.mark.slow  # 2 + 4 processes of tensor parallel: about 2 min here alone (7 min under the helpers' load)
def test_tensor_parallel_checkpoint_of_2_resumes_on_a_2x2_mesh(tmp_path):
    """tp 2 saved (one group), 4 processes resumed as 2 data-parallel groups of tp 2 at 2 per device."""
    ref = tmp_path / "ref"
    launch("tensor_parallel", ref, *COMMON, *SAVE, "--model_preset", "tiny-llama")
    r = launch("tensor_parallel", tmp_path / "mesh", *COMMON, "--model_preset", "tiny-llama",
               "--per_device_train_batch_size", "2", "--tp_size", "2", "--resume_from_checkpoint", _checkpoint(ref),
               launch_args=("--num_processes", "4"))
    assert r["mesh"] == [[0, 1], [2, 3]] and r["global_batch_size"] == 4
    assert_continues(ref, tmp_path / "mesh", r)


def test_a_resume_that_changes_the_global_batch_is_refused_with_the_batch_to_pass(ddp_ref, tmp_path):
    with pytest.raises(SystemExit) as exc:
        run_recipe("data_parallel", tmp_path, *COMMON, "--per_device_train_batch_size", "4",
                   "--resume_from_checkpoint", _checkpoint(ddp_ref))
    said = str(exc.value.code)
    assert "--num_processes was 2, now 1" in said and "global batch" in said and "was 8, now 4" in said
    assert "pass --per_device_train_batch_size 8" in said
    assert not (tmp_path / "results.json").exists()


@pytest.mark.slow  # 2 processes of ZeRO-2, the conversion, 1 process: about 2 min alone (6 min under the load)
def test_zero2_checkpoint_of_2x4_resumes_at_1x8_through_the_universal_checkpoint(tmp_path):
    """A plain ZeRO checkpoint of 2 processes is refused on 1 with the command; converted, it resumes there."""
    import subprocess
    import sys

    ref = tmp_path / "ref"
    launch("zero", ref, *COMMON, *SAVE, config="zero2.yaml")
    one = ("--per_device_train_batch_size", "8")
    proc = launch("zero", tmp_path / "plain", *COMMON, *one, "--resume_from_checkpoint", _checkpoint(ref),
                  config="zero2.yaml", launch_args=("--num_processes", "1"), expect_fail=True)
    assert "holds the ZeRO slices of 2 processes" in proc.stdout + proc.stderr
    assert "python -m shared.tools.reshard" in proc.stdout + proc.stderr
    subprocess.run([sys.executable, "-m", "shared.tools.reshard", _checkpoint(ref)], check=True,
                   cwd=Path(__file__).resolve().parents[1])
    universal = Path(_checkpoint(ref) + "_universal")
    assert (universal / "pytorch_model" / "zero").is_dir() and (universal / "manifest.json").is_file()
    r = launch("zero", tmp_path / "one", *COMMON, *one, "--resume_from_checkpoint", str(universal),
               config="zero2.yaml", launch_args=("--num_processes", "1"))
    assert (r["num_processes"], r["zero_stage"]) == (1, 2)
    assert_continues(ref, tmp_path / "one", r)
