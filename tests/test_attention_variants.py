"""Today's attention variants through the recipes that change how attention runs: sliding windows (Mistral, Gemma 2/3,
gpt-oss), soft caps (Gemma 2: attention scores and final logits) and attention sinks (gpt-oss). Each is carried, giving
what one process gives on the unpacked sequence, or refused by the rule table naming the feature. The features are
read from the config (shared/core/attention.py attention_features), so a family not named here is handled alike.
Per-document packing's test is tests/test_data.py test_per_document_logits_equal_each_document_alone."""

from __future__ import annotations

import copy

import pytest
import torch

from shared.core.attention import attention_features
from shared.core.errors import RecipeError
from tests.conftest import launch, run_recipe
from tests.parallel_runs import COMMON
from tests.shipped_models import WINDOW, config_of, make_dir

IDS = dict(vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENGTH = 4 * WINDOW  # sequences longer than the window: dropping it changes the result
# fp32 AdamW at lr 3e-3, 3 steps, 2 processes vs 1: Adam's m/sqrt(v) magnifies the rounding of sharded sums where v
# is tiny; the soft caps' tanh adds to it (measured on Gemma-2-style: 2.3e-5 sequence parallel, 3.1e-5 tensor
# parallel; the losses agree to 3e-7).
PARAM_TOL = 1e-4


def _model(kind: str, attn: str | None = None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"attn_implementation": attn} if attn else {}
    return AutoModelForCausalLM.from_config(config_of(kind, IDS), **extra).eval()


def test_features_are_read_from_any_config():
    from transformers import Cohere2Config, LlamaConfig, Qwen2Config

    assert attention_features(config_of("mistral", IDS)) == {"sliding window": WINDOW}
    assert attention_features(config_of("gemma2", IDS)) == {
        "sliding window": WINDOW, "attention soft-capping": 50.0, "final logit soft-capping": 30.0}
    assert attention_features(config_of("gemma3", IDS)) == {"sliding window": WINDOW}
    assert attention_features(config_of("gpt-oss", IDS), _model("gpt-oss"))["attention sinks"] is True
    assert attention_features(config_of("qwen2-tied", IDS)) == {} == attention_features(LlamaConfig())
    # families named nowhere in this project: Qwen2 with its window switched on, Cohere 2 (3 sliding : 1 full)
    assert attention_features(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0))
    assert attention_features(Cohere2Config(sliding_window=64))["sliding window"] == 64


@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "mistral", "gpt-oss"])
def test_sequence_parallel_attention_keeps_windows_caps_and_sinks(kind):
    """recipes/sequence_parallel.py's attention function (shared/techniques/ulysses.py), on the whole sequence
    as each process runs it for its heads: the model's own logits, 1e-5, at 4x the window. Torch's causal sdpa alone
    (what it ran before) drops the window."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from shared.techniques import ulysses as sp

    model = _model(kind)
    ids = torch.randint(3, 100, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        AttentionInterface.register(sp.ATTENTION, sp.ulysses_attention)
        ulysses = copy.deepcopy(model)
        ulysses.set_attn_implementation(sp.ATTENTION)  # transformers refused Gemma 2 under the old "ulysses_sdpa"
        got = ulysses(input_ids=ids).logits
        AttentionInterface.register("plain_causal", lambda m, q, k, v, mask, **kw: sdpa_attention_forward(
            m, q, k, v, None, is_causal=True, dropout=0.0, scaling=kw.get("scaling")))
        plain = copy.deepcopy(model)
        plain.set_attn_implementation("plain_causal")
        dropped = plain(input_ids=ids).logits
    print(f"{kind}: |sequence parallel - own| {(got - own).abs().max():.1e}, plain causal "
          f"{(dropped - own).abs().max():.1e}")
    assert (got - own).abs().max() <= 1e-5
    assert (dropped - own).abs().max() > 1e-3


@pytest.mark.slow  # DeepSpeed's import makes a launch of this recipe the costliest (263 s at load 15 on 2 cores)
@pytest.mark.parametrize("kind", ["gemma2", "gpt-oss"])
def test_sequence_parallel_trains_like_one_process(kind, tmp_path):
    """2 processes, each half of every sequence (32 tokens, 4x the window), vs 1 process on the whole sequence:
    the first and the evaluation loss to 1e-5; each process's share of gpt-oss's sinks is its heads'. In the
    default selection, test_sequence_parallel_attention_keeps_windows_caps_and_sinks checks the attention itself."""
    args = (*COMMON, "--per_device_train_batch_size", "16", "--max_seq_length", str(LENGTH), "--max_train_steps", "3",
            "--max_train_samples", "128", "--model_name_or_path", make_dir(tmp_path / "models", kind))
    ref = run_recipe("baseline", tmp_path / "one", *args)
    r = launch("sequence_parallel", tmp_path / "sp", *args)
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-5)
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)
    from tests.conftest import load_params, max_param_diff

    diff = max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "sp"))
    print(f"{kind}: sequence parallel vs 1 process, loss {r['initial_loss']:.7f} / {ref['initial_loss']:.7f}, "
          f"params {diff:.1e}")
    assert diff <= PARAM_TOL


def test_pipeline_stages_carry_windows_and_refuse_caps_and_sinks():
    """Two stages of a Mistral-style model (every layer sliding), chained in one process, give the model's own
    logits at 4x the window; Gemma 2 (soft caps) and gpt-oss (sinks) are refused naming the feature."""
    from shared.techniques.pipeline_stages import Stage

    model = _model("mistral")
    ids = torch.randint(3, 100, (2, LENGTH), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    first, last = Stage(copy.deepcopy(model), range(0, 1), True, False), Stage(copy.deepcopy(model), range(1, 2),
                                                                              False, True)
    with torch.no_grad():
        own = model(input_ids=ids).logits
        staged = last(first(ids, mask), mask)
    assert (staged - own).abs().max() <= 1e-5
    for kind, feature in (("gemma2", "attention soft-capping, final logit soft-capping"),
                          ("gpt-oss", "attention sinks")):
        with pytest.raises(RecipeError, match=feature):
            Stage(_model(kind), range(0, 1), True, False)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gemma2", "mistral", "gemma3"])
def test_tensor_parallel_carries_windows_and_caps(kind, tmp_path):
    """The model's own plan splits the heads: windows and soft caps act per head and per score, so 2 processes
    train what 1 trains (32 tokens, 4x the window)."""
    from tests.conftest import load_params, max_param_diff

    args = (*COMMON, "--per_device_train_batch_size", "16", "--max_seq_length", str(LENGTH), "--max_train_steps", "3",
            "--max_train_samples", "128", "--model_name_or_path", make_dir(tmp_path / "models", kind))
    ref = run_recipe("baseline", tmp_path / "one", *args)
    r = launch("tensor_parallel", tmp_path / "tp", *args)
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], abs=1e-5)
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], abs=1e-5)
    assert max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "tp")) <= PARAM_TOL


def test_layer_types_written_for_neither_are_refused_by_name():
    """A layer type other than full or sliding (Llama 4's chunked attention, a hybrid's linear attention): sequence
    parallel and per-document packing would run it as plain attention, so they refuse it, naming it."""
    from types import SimpleNamespace

    from shared.core import rules
    from shared.core.errors import InputError
    from shared.tasks import packing
    from shared.techniques import ulysses as sp

    config = SimpleNamespace(layer_types=["chunked_attention", "full_attention"], num_hidden_layers=2)
    assert attention_features(config) == {"chunked_attention layers": True}
    drops = tuple(f for f in attention_features(config) if f not in sp.CARRIED)
    with pytest.raises(RecipeError, match="chunked_attention layers: sequence parallel"):
        rules.check_built(sp_drops=drops)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(InputError, match="chunked_attention"):
        packing.per_document_inputs({"input_ids": ids, "position_ids": torch.arange(8)[None]}, "sdpa", config)


def test_tensor_parallel_refuses_sinks_its_plan_does_not_split():
    from shared.core import rules

    with pytest.raises(RecipeError, match="attention sinks"):
        rules.check_built(tp_unsplit_sinks=True, model_type="gpt_oss")
