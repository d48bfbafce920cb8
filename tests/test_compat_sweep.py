"""The compatibility matrix (benchmarks/compat_sweep.py): the committed table has no broken cell, and its cells come out
the same when run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "results" / "compat.json"


def test_committed_matrix_has_no_broken_cell_and_every_refusal_names_a_fix():
    report = json.loads(COMMITTED.read_text())
    rows = report["rows"]
    assert not report["quick"] and len(rows) >= 144
    assert {r["sharding"] for r in rows} == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    assert {r["weights"] for r in rows} == {"full", "8bit-optim", "lora", "int8+lora", "nf4+lora", "nf4+dora",
                                           "chunked-loss", "ao-8bit-optim", "ao-4bit-optim", "ao-fp8-optim"}
    assert {r["precision"] for r in rows} == {"fp32", "bf16", "fp16"}
    broken = [f"{r['name']}: {r['detail']}" for r in rows if r["status"] == "broken"]
    assert not broken, broken
    for r in rows:
        if r["status"] == "refused":  # the message says what to do instead
            assert any(verb in r["detail"] for verb in ("Use ", "Pass ", "Drop ", "Add ", "use ")), r["detail"]
    works = [r for r in rows if r["status"] == "works"]
    print(f"{len(works)} work, {len(rows) - len(works)} refused, of {len(rows)}")
    assert len(works) >= len(rows) // 2  # most combinations train
    assert {r["sharding"] for r in works} == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    # The decoder presets, the shipped-shape ones (bf16 storage, a tied head, router logits off, a sliding window)
    # among them, under every sharding; each cell saved its model and the sweep loaded it back (decoder_presets.py's
    # reload_saved: from_pretrained with every weight found, a tied head tied again; or an adapter).
    presets = [r for r in rows if r.get("preset", "tiny") != "tiny"]
    assert {r["preset"] for r in presets} == {"tiny-llama", "tiny-moe", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mistral"}
    for name in ("tiny-qwen2", "tiny-qwen3-moe", "tiny-mistral"):
        assert {r["sharding"] for r in presets if r["preset"] == name} == {"ddp", "zero1", "zero2", "zero3", "fsdp"}
    for r in presets:
        assert r["saved"] == ("adapter" if "lora" in r["weights"] else "model"), r["name"]


@pytest.mark.slow
def test_quick_sweep_gives_the_committed_outcomes(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compat_sweep.py"), "--quick", "--output_dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "compat.json").read_text())["rows"]
    committed = {r["name"]: r for r in json.loads(COMMITTED.read_text())["rows"]}
    for r in rows:
        print(f"{r['name']}: {r['status']} ({(r.get('detail') or '')[:100]}), committed: "
              f"{committed[r['name']]['status']}")
        assert r["status"] == committed[r["name"]]["status"], r
    assert {r["status"] for r in rows} == {"works", "refused"}
    for r in rows:
        if r["status"] == "works":  # checked on the run itself by what_went_wrong: 2 processes, sharding, dtype
            assert r["compute_dtype"] == "bfloat16" and r["trainable_params"] < 0.5 * r["total_params"]
    assert any(r["model_type"] == "llama" for r in rows)  # one cell trains the Llama preset (replacing a GPT-2 one)
    table = (tmp_path / "compat.md").read_text()
    assert "| fsdp |" in table and "## Why each combination is refused or broken" in table
    assert "zero3 lora +ckpt bf16 tiny-llama ✓" in table  # the decoder presets' cells, listed under the grid
    assert (tmp_path / "compat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_combined_recipe_trains_and_saves_a_lora_adapter_with_checkpointing(tmp_path, monkeypatch):
    """The recipe on its own, one process, as `accelerate launch recipes/combined.py --lora --gradient_checkpointing`
    runs it: only the adapters train, the loss falls, the adapter is saved as safetensors."""
    import torch

    from tests.conftest import run_recipe

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # see test_memory_does_not_grow_over_a_thousand_steps
    torch.set_num_threads(1)
    r = run_recipe("combined", tmp_path, "--task", "causal-lm", "--lora", "--gradient_checkpointing",
                   "--max_train_steps", 30, "--learning_rate", 3e-3, "--max_train_samples", 256)
    assert (r["sharding"], r["offload"], r["lora"], r["gradient_checkpointing"]) == ("none", "none", True, True)
    assert 0 < r["trainable_params"] < 0.2 * r["total_params"]
    assert r["train_loss"] < r["initial_loss"], (r["initial_loss"], r["train_loss"])
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "adapter_config.json").exists()
