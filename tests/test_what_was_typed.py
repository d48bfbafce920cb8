"""What was typed stays what was typed: a run never writes into the parsed flags. The values the launch resolves
(learning rate, output dir, precision, step count, DeepSpeed's agreed batch and clipping) live in the Launch, and
results.json reports both: the flags as parsed and what ran."""

from __future__ import annotations

import copy
import json

import pytest

from tests.conftest import run_recipe

STEPS = ["--max_train_steps", "2", "--max_train_samples", "64", "--max_eval_samples", "16", "--no_save_model"]


def _spy_on_parse_args(monkeypatch) -> list:
    """Each namespace parse_args returns, with a deep copy of it as it was returned."""
    from shared.core import args as core_args

    real, seen = core_args.parse_args, []

    def spy(*a, **kw):
        parsed = real(*a, **kw)
        seen.append((parsed, copy.deepcopy(vars(parsed))))
        return parsed

    monkeypatch.setattr(core_args, "parse_args", spy)  # the recipe's `from shared.core.args import parse_args`
    return seen


@pytest.mark.parametrize("recipe, flags", [
    ("baseline", []),
    ("pruning", ["--task", "causal-lm"]),  # its schedule's defaults were written back into args
    ("activation_checkpointing", ["--checkpoint_every", "2", "--no_probe"]),  # its implementation default too
])
def test_a_run_leaves_the_parsed_flags_as_they_were(recipe, flags, tmp_path, monkeypatch):
    seen = _spy_on_parse_args(monkeypatch)
    results = run_recipe(recipe, tmp_path, *STEPS, *flags)
    (parsed, as_returned), = seen
    assert vars(parsed) == as_returned, {k: (as_returned.get(k), v) for k, v in vars(parsed).items()
                                          if as_returned.get(k) != v}
    # Asked: no --learning_rate, no --output_dir default, no --mixed_precision; ran: each resolved.
    assert results["flags"]["learning_rate"] is None and results["learning_rate"] == 1e-3  # a random preset's
    assert results["flags"]["mixed_precision"] is None and results["resolved"]["mixed_precision"] == "no"
    assert results["resolved"]["output_dir"] == str(tmp_path) and results["resolved"]["max_train_steps"] == 2
    assert "max_train_steps" in results["explicit_flags"] and "learning_rate" not in results["explicit_flags"]


@pytest.mark.slow
def test_deepspeeds_agreed_values_are_the_launchs_not_the_flags(tmp_path, monkeypatch):
    """A DeepSpeed JSON that sets the micro-batch and clipping: the loop runs them, the flags keep their defaults."""
    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
                                   "zero_optimization": {"stage": 2}}))
    seen = _spy_on_parse_args(monkeypatch)
    results = run_recipe("zero", tmp_path / "out", *STEPS, "--deepspeed_config", str(ds_json))
    (parsed, as_returned), = seen
    assert vars(parsed) == as_returned
    assert (parsed.per_device_train_batch_size, parsed.max_grad_norm) == (16, 1.0)  # the flags' defaults
    assert results["per_device_train_batch_size"] == 4 == results["deepspeed_micro_batch_size"]
    assert results["resolved"]["max_grad_norm"] == 0.5 == results["deepspeed_gradient_clipping"]
