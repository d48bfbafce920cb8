"""The technique ladder (benchmarks/ladder.py, shared/tools/ladder.py): its first rungs run for 2 steps and do what
each rung says (bf16 autocast over fp32 weights, packing more real tokens per step, the chunked loss fewer
activation bytes), and the planner's model-state bytes at every rung are within 5% of the measured ones."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from shared.core import rules
from shared.tools.ladder import RUNGS, predict_rung, run_of, stacked
from shared.tools.plan import load_config, model_spec

ROOT = Path(__file__).resolve().parents[1]
PRESET, BATCH, SEQ = "tiny-llama", 2, 64
STATES = ("param_bytes", "grad_bytes", "optimizer_state_bytes")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_ladder", ROOT / "benchmarks" / "ladder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(preset: str = PRESET):
    config, task, _ = load_config(None, preset, "causal-lm", None, None)
    return model_spec(config, task, f"preset:{preset}", disable_dropout=True)


def _check_states(row: dict, batch: int = BATCH, seq: int = SEQ, preset: str = PRESET) -> None:
    """The planner's params + grads + optimizer state for the rung within 5% of the measured ones (rank 0's, on the
    ZeRO rungs; with offload the host's too: on CPU host and device are one memory, measured together)."""
    p = predict_rung(_spec(preset), stacked(row["rung"]), row.get("config"), batch, seq, kernels="cpu")
    measured, planned = sum(row[k] for k in STATES), p.states_anywhere
    assert abs(planned / measured - 1) < 0.05, (row["rung"], measured, planned)


def test_first_rungs_do_what_they_say(tmp_path):
    bench = _bench()
    rows = bench.ladder(PRESET, RUNGS[:4], tmp_path, steps=2, batch=BATCH, seq=SEQ, repeats=1, threads=1)
    by = {r["rung"]: r for r in rows}
    assert [r["rung"] for r in rows] == ["baseline", "bf16", "packing", "chunked_loss"]
    assert all("param_bytes" in r for r in rows), [r.get("failed") or r.get("refused") for r in rows]
    base, bf16, packing, chunked = (by[n] for n in ("baseline", "bf16", "packing", "chunked_loss"))
    # bf16 is autocast: the matmuls run in bf16, the weights (and AdamW's moments) stay fp32, 4 bytes a parameter
    n = base["trainable_params"]
    assert base["compute_dtype"] == "float32" and bf16["compute_dtype"] == "bfloat16"
    assert bf16["param_bytes"] == base["param_bytes"] == 4 * n
    assert bf16["optimizer_state_bytes"] == base["optimizer_state_bytes"]
    # packing: no padding, so each step trains on more real tokens (the same batch of sequences)
    assert base["padding_fraction"] > 0.1 and packing["padding_fraction"] == 0
    assert packing["tokens_per_step"] > 1.5 * bf16["tokens_per_step"]
    assert packing["tokens_per_step"] == BATCH * SEQ
    # the chunked loss: the full logits never kept for backward
    assert chunked["activation_bytes"] < packing["activation_bytes"]
    for row in rows:
        _check_states(row)


def test_planner_states_match_the_benchmark_record():
    """Every rung of each model as docs/results/ladder.json recorded it (benchmarks/ladder.py), against
    the planner now: within 5%, the ZeRO rungs (rank 0, 2 processes) included."""
    record = json.loads((ROOT / "docs" / "results" / "ladder.json").read_text())
    assert PRESET in record["models"]
    for preset, block in record["models"].items():
        rows = [r for r in block["rungs"] if "param_bytes" in r]
        assert len(rows) >= 15 and sum(r["processes"] == 2 for r in rows) == 3, preset
        for row in rows:
            _check_states(row, block.get("batch", record["batch"]), block.get("seq", record["seq"]), preset)


def test_refused_rung_is_refused_by_the_rule_table():
    """The ladder's refusal comes from shared/core/rules.py: ZeRO on the whole stack (torchao, step in backward)."""
    stack = {r.name: r for r in RUNGS}["zero2_stack"]
    found = rules.refusals(run_of(stacked(stack.name), stack.config))
    assert any("torchao" in f for f in found) and any("--optimizer_in_backward" in f for f in found)
    assert not rules.refusals(run_of(stacked("zero3_offload"), "zero3_offload.yaml"))


@pytest.mark.slow
def test_every_rung_states_within_5_percent(tmp_path):
    """Every rung of the tiny model, 2 steps (about 6 minutes on 2 cores: slow)."""
    rows = _bench().ladder(PRESET, RUNGS, tmp_path, steps=2, batch=BATCH, seq=SEQ, repeats=1, threads=1)
    for row in rows:
        if "refused" not in row and "pending" not in row:
            assert "param_bytes" in row, row
            _check_states(row)


def test_ladder_labels_and_columns_add_up(capsys):
    """For bf16 weights (--weights_dtype bf16) the first rungs say so, not "fp32" and "fp32 master weights"; with the
    default fp32 masters they say fp32; every row's columns add up to its peak (the buffers column)."""
    from shared.tools import ladder

    argv = ["--model_name_or_path", "meta-llama/Llama-3.1-8B", "--seq_len", "2048", "--per_device_batch_size", "1"]
    for dtype, first in (("bf16", "bf16 weights as loaded"), ("fp32", "fp32, AdamW")):
        ladder.main([*argv, "--weights_dtype", dtype])
        out = capsys.readouterr().out
        baseline = next(line for line in out.splitlines() if line.startswith("baseline "))
        assert first in baseline and ("fp32, AdamW" not in baseline if dtype == "bf16" else True), baseline
        assert "buffers" in out.splitlines()[1 + (dtype == "bf16")]
        rows = 0
        for line in out.splitlines():
            sizes = [float(v) / (1024 if u == "MiB" else 1) for v, u in re.findall(r"([\d.]+) (GiB|MiB)", line)]
            if len(sizes) == 6:  # weights, grads, optim, activ, buffers, peak
                rows += 1
                assert abs(sum(sizes[:5]) - sizes[5]) < 0.03, line
        assert rows >= 10
