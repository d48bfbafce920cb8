"""QAT (torchao): trains fake-quantized, converts to a real quantized model that is smaller on disk, and reports its
metric next to the fake-quantized one and to PTQ of the same starting model. PTQ for serving: dynamic int8."""

import json

import pytest
import torch

from tests.conftest import _reset_accelerate, load_recipe, run_recipe

SMALL = ("--max_train_samples", "160", "--max_eval_samples", "64")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A briefly trained tiny GPT-2: the starting point for QAT and PTQ."""
    out = tmp_path_factory.mktemp("base-causal-lm")
    run_recipe("baseline", out, "--task", "causal-lm", "--max_train_steps", "20", "--max_train_samples", "320",
               "--max_eval_samples", "64")
    return out


def test_qat_converts_and_reports_against_ptq(trained, tmp_path):
    r = run_recipe("qat", tmp_path, "--task", "causal-lm", "--model_name_or_path", trained, "--weight_bits", "4",
                   "--max_train_steps", "8", *SMALL)
    assert r["quantized_layers"] == 8  # 4 Linear layers (ex-Conv1D) in each of the 2 blocks
    for prefix in ("fp32_start", "ptq", "before_qat_fake_quant", "fake_quant"):
        assert r[f"{prefix}_loss"] > 0
    # Before training, fake quantization computes what PTQ with the same scheme computes.
    assert r["before_qat_fake_quant_loss"] == pytest.approx(r["ptq_loss"], abs=1e-4)
    # After conversion, the real int8-activation / int4-weight model computes what the fake-quantized one did.
    assert r["eval_loss"] == pytest.approx(r["fake_quant_loss"], abs=1e-3)
    assert r["fake_quant_loss"] != r["before_qat_fake_quant_loss"]  # QAT changed the weights
    assert r["train_loss"] < r["initial_loss"] + 0.05
    # Smaller on disk; the file is plain tensors that a weights_only load accepts.
    assert r["quantized_model_bytes_on_disk"] < 0.6 * r["fp32_state_dict_bytes"]
    state = torch.load(tmp_path / "quantized_model.pt", weights_only=True)  # torchao (imported) allowlists its types
    quantized = [w for w in state.values() if type(w).__name__ == "IntxUnpackedToInt8Tensor"]
    assert len(quantized) == 8 and all(w.qdata.dtype == torch.int8 for w in quantized)


@pytest.mark.parametrize("task", ["text-classification", "image-classification"])
def test_qat_other_families(task, tmp_path):
    r = run_recipe("qat", tmp_path, "--task", task, "--weight_bits", "8", "--max_train_steps", "3", *SMALL,
                   "--no_save_model")
    assert r["quantized_layers"] == 12  # 6 Linear layers in each of the 2 BERT / ViT blocks
    assert r["eval_accuracy"] == pytest.approx(r["fake_quant_accuracy"], abs=1 / 64 + 1e-9)
    assert r["quantized_state_dict_bytes"] < r["fp32_state_dict_bytes"]


def test_qat_bad_group_size_fails_fast(tmp_path):
    with pytest.raises(SystemExit, match="--group_size 48 must divide"):
        run_recipe("qat", tmp_path, "--group_size", "48", "--max_train_steps", "1")
    assert not (tmp_path / "results.json").exists()


def test_ptq_dynamic_int8_halves_size_keeps_metric(trained, tmp_path):
    r = run_recipe_ptq(trained, tmp_path)
    assert r["quantized_layers"] == 8
    assert r["int8_bytes_on_disk"] < 0.5 * r["fp32_bytes_on_disk"]
    assert r["int8_loss"] == pytest.approx(r["fp32_loss"], abs=0.02)


def run_recipe_ptq(model_dir, out):
    # ptq.py evaluates and quantizes; it writes results.json without a training section.
    _reset_accelerate()
    try:
        return load_recipe("ptq").main(["--task", "causal-lm", "--model_name_or_path", str(model_dir),
                                        "--max_eval_samples", "64", "--report_to", "none", "--output_dir", str(out)])
    finally:
        _reset_accelerate()


def test_ptq_needs_a_trained_model(tmp_path):
    with pytest.raises(SystemExit, match="no --model_name_or_path was passed.*Fix: Pass --model_name_or_path"):
        load_recipe("ptq").main(["--output_dir", str(tmp_path)])


def test_ptq_preflight_stops_before_quantizing(trained, tmp_path):
    """--preflight, which every recipe takes, reports PTQ's resolved run and stops before it quantizes."""
    _reset_accelerate()
    try:
        with pytest.raises(SystemExit) as exc:
            load_recipe("ptq").main(["--task", "causal-lm", "--model_name_or_path", str(trained), "--preflight",
                                     "--max_eval_samples", "16", "--report_to", "none", "--output_dir", str(tmp_path)])
    finally:
        _reset_accelerate()
    assert exc.value.code == 0
    resolved = json.loads((tmp_path / "preflight.json").read_text())
    assert resolved["recipe"] == "ptq" and resolved["optimizer"] is None
    assert not (tmp_path / "quantized_model.pt").exists() and not (tmp_path / "results.json").exists()
