"""2-D: 4 processes = 2 data-parallel replicas x 2 pipeline stages, over gloo."""

import json
import shutil

import pytest
from safetensors.torch import load_file

from tests.conftest import launch, load_params, max_param_diff
from tests.parallel_runs import COMMON, STEPS, mesh, single

PARAM_TOL = 5e-5  # as for the pipeline: fp32 AdamW, 6 steps, vs 1 process over the same global batch of 16


def _shards(out_dir) -> list[dict]:
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return [load_file(out_dir / f) for f in sorted(set(index.values()))]


def test_two_replicas_of_two_stages_train_like_one_process(tmp_path_factory):
    ref_dir, ref = single(tmp_path_factory)
    out, r = mesh(tmp_path_factory)
    assert (r["num_processes"], r["distributed_type"]) == (4, "MULTI_CPU")
    assert (r["data_parallel_replicas"], r["pipeline_stages"], r["mesh"]) == (2, 2, [[0, 1], [2, 3]])
    assert r["stage_index"] == [0, 1, 0, 1] and r["global_batch_size"] == 16

    # each process holds one stage: about half the model; the two stages together are the model (+ the tied head)
    shards = _shards(out)
    total = sum(t.numel() for s in shards for t in s.values())
    tied = shards[0]["transformer.wte.weight"].numel()
    counts = r["stage_param_count"]
    assert counts[0] == counts[2] and counts[1] == counts[3] and counts[0] + counts[1] == total + tied
    for c in counts:
        assert 0.35 <= c / total <= 0.65, counts
    assert r["param_bytes"] == [4 * c for c in counts]

    # the replicas stayed identical, and the whole trains like one process over the same global batch
    assert r["max_param_diff_between_replicas"] == 0.0
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-5)
    assert r["first_step_grad_norm"] == pytest.approx(ref["first_step_grad_norm"], rel=1e-4)
    assert r["train_loss"] < r["initial_loss"] - 0.5
    diff = max_param_diff(load_params(ref_dir), {k: v for s in shards for k, v in s.items()})
    print(f"param diff: 2x2 mesh vs 1 process after 6 steps = {diff:.2e}; stage params {counts}")
    assert diff <= PARAM_TOL


@pytest.mark.slow
def test_resumes_every_stage_of_every_replica_exactly(tmp_path_factory, tmp_path):
    """A new run from a copy of the 2x2 run's halfway checkpoint (4 rank_* states) ends at the same parameters."""
    out, _ = mesh(tmp_path_factory)
    halfway = tmp_path / "halfway"
    shutil.copytree(out / "checkpoints" / f"step_{STEPS // 2:08d}", halfway)
    assert sorted(p.name for p in halfway.glob("rank_*")) == [f"rank_{i:05d}" for i in range(4)]
    r = launch("data_model_parallel", tmp_path / "resumed", *COMMON, "--per_device_train_batch_size", "8",
               "--pipeline_stages", "2", "--resume_from_checkpoint", halfway, config="data_model_parallel.yaml")
    assert r["resumed_from_step"] == STEPS // 2 and r["max_param_diff_between_replicas"] == 0.0
    merged = [{k: v for s in _shards(d) for k, v in s.items()} for d in (out, tmp_path / "resumed")]
    diff = max_param_diff(*merged)
    print(f"2x2 mesh resumed at step {r['resumed_from_step']} of {STEPS}: max abs param diff vs uninterrupted "
          f"{diff:.1e}")
    assert diff <= 1e-6


def test_refuses_a_mesh_that_does_not_fit(tmp_path, monkeypatch):
    from tests.conftest import run_recipe

    monkeypatch.setenv("WORLD_SIZE", "6")  # as `accelerate launch --num_processes 6` sets it: 6 is not 2 x 4
    with pytest.raises(SystemExit, match="6 processes cannot form 2 or more replicas of 4 stages"):
        run_recipe("data_model_parallel", tmp_path, "--max_train_steps", "1", "--pipeline_stages", "4")
