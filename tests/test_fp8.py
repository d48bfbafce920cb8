"""FP8 training (recipes/fp8.py): Accelerate's mixed_precision="fp8" with torchao really converts the inner Linears to
Float8Linear on this CPU-only stack, their matmuls really run in float8 (torch._scaled_mm), the first/last Linear and
the layers whose dims are not multiples of 16 stay in high precision, and the loss stays close to the bf16 run's over
the same data, init and steps. Kept small: torch._scaled_mm on CPU is a slow reference kernel (about 1,000x a bf16
matmul of the same size), so the runs use 16-token sequences.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import launch, run_recipe

SMALL = ["--max_seq_length", "16", "--per_device_train_batch_size", "4", "--max_train_samples", "64",
         "--max_eval_samples", "8", "--per_device_eval_batch_size", "8", "--no_save_model"]
STEPS = 8
# Measured 2026-12-01 (tiny BERT, 8 steps): last loss 0.69982 (fp8) vs 0.70876 (bf16), 1.3% apart.
LOSS_RTOL = 0.03
# Tiny BERT: 2 layers x (query, key, value, attention out, intermediate, output) + the pooler = 13 Linears.
EXPECTED_KEPT = {"bert.encoder.layer.0.attention.self.query": "first or last Linear",
                 "classifier": "in/out features not multiples of 16"}


def test_the_filter_rule_names_what_it_keeps():
    """The rule (accelerate.utils.ao.filter_linear_layers): the first and last Linear, and dims not multiple of 16."""
    from accelerate.utils.ao import convert_model_to_fp8_ao

    from shared.techniques.fp8 import FIRST_LAST, NOT_16, layer_precisions

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 40), torch.nn.Linear(40, 64), torch.nn.Linear(64, 64),
                                torch.nn.Linear(64, 2))
    convert_model_to_fp8_ao(model)  # what Accelerator.prepare calls
    converted, kept = layer_precisions(model)
    assert converted == ["2", "5"]
    assert kept == {"0": FIRST_LAST, "3": NOT_16, "4": NOT_16, "6": NOT_16}


@pytest.fixture(scope="module")
def fp8_and_bf16(tmp_path_factory):
    """One fp8 run with torch._scaled_mm counted, and the bf16 run (recipes/mixed_precision.py) over the same steps."""
    calls = {"n": 0, "dtypes": set()}
    real = torch._scaled_mm

    def counting(a, b, *args, **kwargs):  # torchao's float8 ops look torch._scaled_mm up at each call
        calls["n"] += 1
        calls["dtypes"].add((a.dtype, b.dtype))
        return real(a, b, *args, **kwargs)

    torch._scaled_mm = counting
    try:
        out = tmp_path_factory.mktemp("fp8")
        # The model saved, as a user's default run saves it (save_pretrained once failed on the float8 weights).
        fp8 = run_recipe("fp8", out, *[a for a in SMALL if a != "--no_save_model"], "--max_train_steps", STEPS)
        fp8["output_dir"] = str(out)
    finally:
        torch._scaled_mm = real
    bf16 = run_recipe("mixed_precision", tmp_path_factory.mktemp("bf16"), *SMALL, "--max_train_steps", STEPS,
                      "--mixed_precision", "bf16")
    return fp8, bf16, calls


def test_the_model_is_saved_and_reloads(fp8_and_bf16):
    """model.safetensors holds plain high-precision weights (not torchao's wrapper), which from_pretrained loads;
    results.json names the backend that ran."""
    from transformers import AutoModelForSequenceClassification

    from tests.conftest import load_params

    fp8 = fp8_and_bf16[0]
    assert fp8["fp8_backend"].startswith("AO")
    saved = load_params(fp8["output_dir"])
    model = AutoModelForSequenceClassification.from_pretrained(fp8["output_dir"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items() if k in model.state_dict())
    assert saved["bert.encoder.layer.0.attention.self.value.weight"].dtype == torch.float32


def test_the_inner_linears_become_float8(fp8_and_bf16):
    fp8, _, _ = fp8_and_bf16
    assert fp8["mixed_precision"] == "fp8"  # not silently bf16 or fp32
    assert fp8["kept_high_precision"] == EXPECTED_KEPT
    assert fp8["fp8_linears"] == 12 and len(fp8["fp8_linear_names"]) == 12
    assert all(".encoder.layer." in n or n == "bert.pooler.dense" for n in fp8["fp8_linear_names"])


def test_the_matmuls_run_in_float8(fp8_and_bf16):
    fp8, _, calls = fp8_and_bf16
    # Each converted Linear: one _scaled_mm forward, two backward (grad input, grad weight) per step; eval: one.
    eval_batches = 1
    assert calls["n"] == fp8["fp8_linears"] * (3 * STEPS + eval_batches), calls
    assert calls["dtypes"] <= {(a, b) for a in (torch.float8_e4m3fn, torch.float8_e5m2)
                               for b in (torch.float8_e4m3fn, torch.float8_e5m2)}, calls


def test_the_loss_stays_close_to_bf16(fp8_and_bf16):
    fp8, bf16, _ = fp8_and_bf16
    gap = abs(fp8["train_loss"] - bf16["train_loss"]) / bf16["train_loss"]
    print(f"loss after {STEPS} steps: fp8 {fp8['train_loss']:.5f} bf16 {bf16['train_loss']:.5f} ({gap:.2%} apart)")
    assert gap < LOSS_RTOL
    assert gap > 1e-5, "identical to bf16: the float8 matmuls did not run"


def test_fp8_refuses_another_precision(tmp_path):
    with pytest.raises(SystemExit, match="trains in fp8 only"):
        run_recipe("fp8", tmp_path, *SMALL, "--max_train_steps", "1", "--mixed_precision", "bf16")


def test_a_model_without_linears_is_refused(tmp_path):
    """Tiny GPT-2's blocks are Conv1D and its head is the last Linear: nothing would be fp8."""
    with pytest.raises(SystemExit, match="no nn.Linear was converted"):
        run_recipe("fp8", tmp_path, *SMALL, "--max_train_steps", "1", "--task", "causal-lm")


@pytest.mark.slow
def test_ddp_two_processes(tmp_path):
    result = launch("fp8", tmp_path, *SMALL, "--max_train_steps", "4")
    assert result["num_processes"] == 2 and result["distributed_type"] == "MULTI_CPU"
    assert result["mixed_precision"] == "fp8" and result["fp8_linears"] == 12
