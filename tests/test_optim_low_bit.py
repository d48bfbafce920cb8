"""Low-bit AdamW (torchao 4-bit, FP8, 8-bit; bitsandbytes 8-bit): optimizer state counted on the live tensors
against torch AdamW's, the same loss within a stated tolerance, a 2-process FSDP2 run, and refusals before training.

The figures are printed (pytest -s) and recorded in docs/quantization.md.
"""

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import launch, run_recipe
from tests.quant_models import make_model_dir

# Same data, same init, no dropout: only the optimizer differs. Measured after 6 steps (hidden 256, 2026-12-01, two
# random inits): 8-bit and FP8 within 0.001% of torch AdamW's loss, 4-bit 0.60-0.66% above it.
LOSS_RTOL = {"adamw_torchao_8bit": 0.01, "adamw_bnb_8bit": 0.01, "adamw_torchao_fp8": 0.01, "adamw_torchao_4bit": 0.02}
# State bytes / torch AdamW's: ideal 0.125 (4-bit: 2 x 0.5 B/param) and 0.25 (8-bit, FP8), plus block scales and
# the small tensors (biases, LayerNorms) that keep 32-bit state.
STATE_RATIO = {"adamw_torchao_4bit": 0.14, "adamw_torchao_fp8": 0.27, "adamw_torchao_8bit": 0.27,
               "adamw_bnb_8bit": 0.27}
CLASS = {"adamw_torchao_4bit": "AdamW4bit", "adamw_torchao_fp8": "AdamWFp8", "adamw_torchao_8bit": "AdamW8bit",
         "adamw_bnb_8bit": "AdamW8bit"}
COMMON = ("--task", "causal-lm", "--max_train_steps", "6", "--logging_steps", "1", "--disable_dropout",
          "--max_train_samples", "96", "--max_eval_samples", "16", "--no_save_model")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Width 256, one block: every weight matrix and embedding has >= 4096 elements and a multiple of 256, so both
    # libraries quantize all of them; only the biases and LayerNorms (0.46% of parameters) keep 32-bit state.
    return make_model_dir(tmp_path_factory.getbasetemp() / "models", "causal-lm", layers=1)


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("low_bit")
    out = {"adamw": run_recipe("baseline", tmp / "adamw", "--model_name_or_path", model_dir, *COMMON)}
    for optim in STATE_RATIO:
        out[optim] = run_recipe("optim_low_bit", tmp / optim, "--optim", optim, "--model_name_or_path", model_dir,
                                *COMMON)
    return out


@pytest.mark.parametrize("optim", list(STATE_RATIO))
def test_state_bytes_and_loss_against_torch_adamw(optim, runs, model_dir):
    torch_adamw, low = runs["adamw"], runs[optim]
    assert (torch_adamw["optimizer_class"], low["optimizer_class"]) == ("AdamW", CLASS[optim])
    # Every tensor over the libraries' threshold got quantized state; the rest kept 32-bit state.
    params = list(AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    large = sum(p.numel() >= 4096 for p in params)
    assert low["tensors_with_quantized_state"] == large
    assert low["tensors_with_quantized_state"] + low["tensors_with_32bit_state"] == len(params)

    ratio = low["optimizer_state_bytes"][0] / torch_adamw["optimizer_state_bytes"][0]
    per_param = low["optimizer_state_bytes"][0] / sum(p.numel() for p in params)
    delta = low["train_loss"] / torch_adamw["train_loss"] - 1
    print(f"{optim}: state {low['optimizer_state_bytes'][0]:,} B = {ratio:.3f}x torch AdamW's "
          f"{torch_adamw['optimizer_state_bytes'][0]:,} B "
          f"({per_param:.2f} B/param); train loss {low['train_loss']:.5f} vs {torch_adamw['train_loss']:.5f} "
          f"({delta:+.4%})")
    assert ratio <= STATE_RATIO[optim], f"{optim} state is {ratio:.3f}x torch AdamW's"
    assert low["param_bytes"] == torch_adamw["param_bytes"]  # the model itself is unchanged
    assert low["train_loss"] < low["initial_loss"]  # it trains
    assert low["train_loss"] == pytest.approx(torch_adamw["train_loss"], rel=LOSS_RTOL[optim])
    assert low["train_loss"] != torch_adamw["train_loss"]  # really a different optimizer


@pytest.mark.slow
def test_4bit_under_fsdp2_in_two_processes(tmp_path):
    """torchao's AdamW4bit on FSDP2 shards: the combination that failed in its compiled step (shared/core/optim.py)."""
    r = launch("optim_low_bit", tmp_path, "--optim", "adamw_torchao_4bit", *COMMON, config="fsdp.yaml")
    assert (r["num_processes"], r["sharding"], r["optimizer_class"]) == (2, "fsdp", "AdamW4bit")
    assert r["tensors_with_quantized_state"] > 0
    assert r["train_loss"] < r["initial_loss"]
    # Each process holds state for its own shard only.
    assert r["optimizer_state_bytes"][0] < 0.6 * sum(r["optimizer_state_bytes"])


@pytest.mark.parametrize("optim, env, says", [
    ("adamw_bnb_8bit", {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"},
     "--optim adamw_bnb_8bit under FSDP: bitsandbytes' optimizer kernels do not take FSDP2's sharded DTensor"),
    ("adamw_torchao_4bit",
     {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2", "WORLD_SIZE": "2"},
     "torchao's optimizer would step DeepSpeed's flat fp32 partitions"),
])
def test_refused_before_training(optim, env, says, tmp_path, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match="Refused before training") as e:
        run_recipe("optim_low_bit", tmp_path, "--optim", optim, "--max_train_steps", "1")
    assert says in str(e.value) and "Fix: " in str(e.value)
    assert not (tmp_path / "results.json").exists()
