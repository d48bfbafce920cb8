"""Every recipe against every launch config in accelerate_configs/: it trains as asked, or it is refused before
anything is loaded, with the reason and a fix.

The sweep needs no launch: each config is turned into the environment `accelerate launch` would give the recipe
(Accelerate's own launcher functions), and the recipe's main() runs up to its `Accelerator(...)` line, where the test
stops it. Whatever would stop the run before then (the rule table, shared/core/rules.py, and the DeepSpeed settings
check) has run by that point. A sample of pairs is then launched for real.

The grid is the source of docs/results/launch_grid.md: `python tests/test_launch_grid.py` writes it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.tools.catalogue import recipes_support
from tests.conftest import CONFIGS, ROOT, launch, load_params, load_recipe, run_recipe

RECIPES = sorted(recipes_support())  # tests/test_recipe_shape.py holds it to the files in recipes/
CONFIG_FILES = sorted(p.name for p in CONFIGS.glob("*.yaml"))
EXTRA_ARGS = {"ptq": ["--model_name_or_path", str(ROOT)]}  # PTQ needs a model to quantize; never loaded here


def extra_args(recipe: str, config: str, tmp: Path) -> list[str]:
    """What a user adds for this pair: NVMe offload needs a directory, and recipes that set up DeepSpeed take one."""
    nvme = config == "zero3_nvme.yaml" and "add_deepspeed_args" in (ROOT / "recipes" / f"{recipe}.py").read_text()
    return [*EXTRA_ARGS.get(recipe, []), *(["--nvme_path", str(tmp / "nvme")] if nvme else [])]


class ReachedAccelerator(Exception):
    """main() got past every check that runs before the Accelerator is built."""


def launch_env(config: str, launch_args: Sequence[str] = ()) -> dict[str, str]:
    """The variables `accelerate launch --config_file accelerate_configs/<config> [launch_args]` sets for the script
    it runs."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import (
        prepare_deepspeed_cmd_env,
        prepare_multi_gpu_env,
        prepare_simple_launcher_cmd_env,
    )

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), *launch_args, "recipe.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed and not args.cpu:  # as accelerate.commands.launch.launch_command dispatches
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        fields += ["mixed_precision"] if mp_from_config else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = prepare_deepspeed_cmd_env(args)[1]
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        env = prepare_multi_gpu_env(args)
    else:
        env = prepare_simple_launcher_cmd_env(args)[1]
    if args.num_processes <= 1:
        return {**env, "WORLD_SIZE": "1"}
    # torchrun gives each process its world size, and marks it as its own (TORCHELASTIC_RUN_ID).
    return {**env, "WORLD_SIZE": str(args.num_processes), "TORCHELASTIC_RUN_ID": "launch-grid"}


def verdict(recipe: str, config: str, tmp: Path, launch_args: Sequence[str] = (), args: Sequence[str] = ()
            ) -> str | None:
    """None when the pair gets as far as building the Accelerator; else the message that stopped it. launch_args
    and args: what a command line adds before and after the recipe (shared/tools/plan.py's commands)."""
    saved = dict(os.environ)
    module = load_recipe(recipe)

    def stop(*_a, **_kw):
        raise ReachedAccelerator

    module.Accelerator = stop  # the recipe's own name for it: everything before this line runs for real
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith(("ACCELERATE_", "FSDP_"))})
    os.environ.update(launch_env(config, launch_args))
    try:
        module.main(["--report_to", "none", "--output_dir", str(tmp / "out"), *extra_args(recipe, config, tmp),
                     *args])
    except ReachedAccelerator:
        return None
    except SystemExit as e:
        return str(e.code)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    raise AssertionError(f"{recipe} x {config}: main() returned without building an Accelerator")


# The cells a test launches as a user runs them: `accelerate launch` with that config, the model saved and loaded
# back (test file::function, decorators included: test_cells_marked_working_are_run_by_their_test reads it). Only
# these are ✓ in docs/results/launch_grid.md; a pair that passes every start-up check but that no
# test runs to the end is "c": it was not seen to train, save and reload.
_TIED = "test_tied_embeddings.py::test_sharded_recipes_keep_the_tie_through_saving_and_resuming"
RUN_BY_TESTS: dict[tuple[str, str], str] = {
    ("baseline", "multi_cpu.yaml"): "test_exactness.py::test_ddp_equals_one_process",
    ("gradient_accumulation", "multi_cpu.yaml"):
        "test_exactness.py::test_accumulation_under_ddp_equals_one_large_batch",
    ("chunked_loss", "fsdp.yaml"): "test_chunked_loss.py::test_two_processes_train_as_the_plain_one_process_run",
    ("chunked_loss", "zero3.yaml"): "test_chunked_loss.py::test_two_processes_train_as_the_plain_one_process_run",
    ("data_model_parallel", "data_model_parallel.yaml"):
        "test_data_model_parallel.py::test_resumes_every_stage_of_every_replica_exactly",
    ("expert_parallel", "multi_cpu.yaml"):
        "test_expert_parallel.py::test_two_processes_train_like_one_each_holding_half_the_experts",
    ("fsdp", "fsdp.yaml"): _TIED,
    ("fsdp", "fsdp_offload.yaml"):
        "test_fsdp.py::test_sharded_checkpoint_resumes_with_cpu_offload_to_the_uninterrupted_result",
    ("fsdp", "hsdp.yaml"): "test_hsdp.py::test_the_halfway_checkpoint_resumes_to_the_uninterrupted_run",
    ("pipeline_parallel", "pipeline.yaml"): _TIED,
    ("sequence_parallel", "multi_cpu.yaml"):
        "test_attention_variants.py::test_sequence_parallel_trains_like_one_process",
    ("tensor_parallel", "multi_cpu.yaml"):
        "test_tied_embeddings.py::test_tensor_parallel_splits_a_tied_embedding_and_head_as_one_weight",
    ("tensor_parallel", "tp2_dp2.yaml"):
        "test_tensor_parallel_2d.py::test_tp_x_dp_trains_like_one_process_and_resumes_exactly",
    ("zero", "zero3.yaml"): _TIED,
    ("zero", "zero2_offload.yaml"): "test_zero.py::test_zero2_offload_resume",
    ("combined", "zero2_offload.yaml"): "test_zero.py::test_combined_zero2_offload_resume",
    ("combined", "fsdp.yaml"): "test_launch_grid.py::test_combined_under_fsdp_trains_and_saves",
    ("zero3_offload", "zero3_offload.yaml"): "test_zero.py::test_zero3_offload_two_processes",
}
# Checkpoints as they ship, run through a recipe by a test (recipe, config, the model's shape, the test). The test's
# source names the recipe, the config and tests/shipped_models.py's kind.
SHAPES: list[tuple[str, str, str, str]] = [
    ("tensor_parallel", "multi_cpu.yaml", "qwen2-tied", RUN_BY_TESTS["tensor_parallel", "multi_cpu.yaml"]),
    *[(r, c, kind, _TIED) for r, c in (("fsdp", "fsdp.yaml"), ("zero", "zero3.yaml"), ("pipeline_parallel",
                                                                                    "pipeline.yaml"))
      for kind in ("llama-tied", "qwen2-tied")],
    ("sequence_parallel", "multi_cpu.yaml", "gemma2", RUN_BY_TESTS["sequence_parallel", "multi_cpu.yaml"]),
    ("sequence_parallel", "multi_cpu.yaml", "gpt-oss", RUN_BY_TESTS["sequence_parallel", "multi_cpu.yaml"]),
    *[("tensor_parallel", "multi_cpu.yaml", kind,
       "test_attention_variants.py::test_tensor_parallel_carries_windows_and_caps")
      for kind in ("gemma2", "gemma3", "mistral")],
]
WHAT = {"qwen2-tied": "Qwen2.5-style, tied head", "llama-tied": "Llama-3.2-1B-style, tied head",
        "gemma2": "Gemma-2-style: sliding window, soft caps, tied head", "gemma3": "Gemma-3-style: sliding window",
        "mistral": "Mistral-style: sliding window in every layer", "gpt-oss": "gpt-oss-style: sinks, sliding window"}


def source_of_test(ref: str) -> str:
    """The source of tests/<file>::<function>, its decorators included."""
    file, name = ref.split("::")
    source = (ROOT / "tests" / file).read_text()
    at = source.index(f"def {name}(")
    return source[source.rfind("\n\n\n", 0, at):source.find("\n\n\n", at)]


_grid: dict[tuple[str, str], str | None] = {}


def grid(tmp_factory) -> dict[tuple[str, str], str | None]:
    if not _grid:
        for recipe in RECIPES:
            for config in CONFIG_FILES:
                _grid[recipe, config] = verdict(recipe, config, tmp_factory.mktemp(f"{recipe}-{config}"))
    return _grid


def test_every_pair_trains_or_is_refused_with_a_fix(tmp_path_factory):
    verdicts = grid(tmp_path_factory)
    assert len(verdicts) == len(RECIPES) * len(CONFIG_FILES) >= 17 * 14
    for (recipe, config), message in verdicts.items():
        if message is not None:  # the problem, and what to do instead
            assert any(w in message for w in ("Fix: ", "Pass ", "pass --", "Use ")), f"{recipe} x {config}: {message}"
            assert "Traceback" not in message
    # The pairs that crashed or silently trained something else before the rule table (measured 2026-12-01).
    for recipe, config, says in [("optim_8bit", "zero2_offload.yaml", "does not implement DeepSpeed ZeRO-2"),
                                 ("pruning", "zero3.yaml", "does not implement DeepSpeed ZeRO-3"),
                                 ("qat", "fsdp.yaml", "does not implement FSDP"),
                                 ("pipeline_parallel", "zero3.yaml", "does not implement DeepSpeed ZeRO-3"),
                                 ("baseline", "fsdp_offload.yaml", "does not implement FSDP"),
                                 ("fsdp", "single_process.yaml", "needs at least 2 processes"),
                                 ("model_parallel", "multi_cpu.yaml", "runs in one process"),
                                 ("zero3_offload", "zero2.yaml", "the launch config offloads nothing"),
                                 ("zero", "fsdp.yaml", "asks for FSDP, and recipes/zero.py runs DeepSpeed"),
                                 ("fsdp", "zero2.yaml", "asks for DeepSpeed ZeRO-2, and recipes/fsdp.py runs FSDP")]:
        assert says in (verdicts[recipe, config] or "trained"), (recipe, config, verdicts[recipe, config])
    # Every recipe trains under some config, and every config serves some recipe.
    for recipe in RECIPES:
        assert any(verdicts[recipe, c] is None for c in CONFIG_FILES), f"{recipe} trains under no config"
    for config in CONFIG_FILES:
        assert any(verdicts[r, config] is None for r in RECIPES), f"no recipe trains under {config}"
    # A recipe's own launch examples (its docstring's configs) are never refused.
    for recipe in RECIPES:
        doc = load_recipe(recipe).__doc__
        for config in CONFIG_FILES:
            if f"accelerate_configs/{config}" in doc:
                assert verdicts[recipe, config] is None, (recipe, config, verdicts[recipe, config])
    print(f"{sum(v is None for v in verdicts.values())} of {len(verdicts)} pairs train, the others are refused")


def test_cells_marked_working_are_run_by_their_test(tmp_path_factory):
    """Each ✓ cell's test launches that recipe under that config as a user does, with the model saved (no
    --no_save_model) and loaded back; and the start-up sweep lets the pair through."""
    verdicts = grid(tmp_path_factory)
    for (recipe, config), ref in RUN_BY_TESTS.items():
        source = source_of_test(ref)
        named = f'"{config}"' in source or (config == "multi_cpu.yaml" and "config=" not in source)  # the default
        assert "launch(" in source and f'"{recipe}"' in source and named, (recipe, config, ref)
        assert "--no_save_model" not in source, (recipe, config, ref)
        assert any(w in source for w in ("load_params", "from_pretrained", "reload(", "max_param_diff")), (
            recipe, config, ref)
        assert verdicts[recipe, config] is None, (recipe, config, verdicts[recipe, config])
    for recipe, config, kind, ref in SHAPES:
        source = source_of_test(ref)
        assert f'"{recipe}"' in source and f'"{config}"' in source or config == "multi_cpu.yaml", (recipe, ref)
        assert f'"{kind}"' in source and kind in WHAT, (recipe, kind, ref)


def test_docs_grid_is_current(tmp_path_factory):
    docs = ROOT / "docs" / "results" / "launch_grid.md"
    assert docs.read_text() == table(grid(tmp_path_factory)), \
        "regenerate: python tests/test_launch_grid.py"


def table(verdicts: dict[tuple[str, str], str | None]) -> str:
    short = [c.removesuffix(".yaml") for c in CONFIG_FILES]
    lines = ["<!-- generated by python tests/test_launch_grid.py; do not edit -->",
             "# Which recipe runs under which launch config", "",
             "Generated by `python tests/test_launch_grid.py`; the tests in that file check every cell through the "
             "recipe's own start-up (the rule table, `shared/core/rules.py`) and launches a "
             "sample for real. ✓ launched by a test as a user runs it, trained, saved its model and loaded it back "
             "(RUN_BY_TESTS names the test); c passes every start-up check, not "
             "launched by a test; R refused before anything is loaded (the reasons are below).", "",
             "| recipe | " + " | ".join(short) + " |", "|---|" + "---|" * len(short)]
    for recipe in RECIPES:
        ran = set(RUN_BY_TESTS)
        cells = ["R" if verdicts[recipe, c] is not None else "✓" if (recipe, c) in ran else "c" for c in CONFIG_FILES]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    lines += ["", "## Checkpoints as they ship", "",
              "Tiny models shaped like today's checkpoints (tests/shipped_models.py), launched, saved and loaded "
              "back by the test named; -m slow marks the ones the default selection leaves out.", "",
              "| recipe | config | model | test |", "|---|---|---|---|"]
    for recipe, config, kind, ref in SHAPES:
        lines.append(f"| {recipe} | {config.removesuffix('.yaml')} | {WHAT[kind]} | `{ref}` |")
    reasons: dict[str, list[str]] = {}
    for (recipe, config), message in verdicts.items():
        if message is not None:
            reasons.setdefault(message.removeprefix("Refused before training: "), []).append(f"{recipe} x {config}")
    lines += ["", "## Why", ""]
    for message, pairs in sorted(reasons.items(), key=lambda kv: kv[1][0]):
        lines.append(f"- {', '.join(pairs[:3])}{f' and {len(pairs) - 3} more' if len(pairs) > 3 else ''}: "
                     f"{' '.join(message.split())}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- a sample, launched for real


@pytest.mark.slow
@pytest.mark.parametrize("recipe, config", [("pruning", "zero3.yaml"), ("qat", "fsdp.yaml"),
                                            ("optim_8bit", "zero2_offload.yaml")])
def test_refused_pairs_stop_before_loading_when_launched(recipe, config, tmp_path):
    start = time.perf_counter()
    proc = launch(recipe, tmp_path, "--max_train_steps", 2, config=config, expect_fail=True, timeout=300)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    assert "Refused before training" in out and "Fix: " in out, out[-3000:]
    assert "train:" not in out and not (tmp_path / "results.json").exists()  # no progress bar ever started
    assert "Loading" not in out and not list(tmp_path.glob("*.safetensors"))
    print(f"{recipe} x {config}: refused in {seconds:.1f} s")


def test_combined_under_fsdp_trains_and_saves(tmp_path):
    """combined x fsdp.yaml passed every start-up check and crashed in fully_shard (Accelerate's default wrap took
    BERT's embeddings as a unit too): launched as a user does, on the default task, the model saved and loaded."""
    r = launch("combined", tmp_path, "--max_train_steps", 3, "--max_train_samples", 128, "--max_eval_samples", 32,
               config="fsdp.yaml")
    assert r["num_processes"] == 2 and r["train_loss"] is not None
    assert all(t.numel() > 0 for t in load_params(tmp_path).values())  # consolidated, not the shards


@pytest.mark.slow
@pytest.mark.parametrize("recipe, config, processes", [("qat", "multi_cpu.yaml", 2), ("optim_8bit", "bf16.yaml", 1),
                                                       ("activation_checkpointing", "multi_cpu.yaml", 2)])
def test_allowed_pairs_train_as_asked_when_launched(recipe, config, processes, tmp_path):
    # One pair trains the mixture-of-experts decoder preset (DDP over 2 processes: its router loss reduced too).
    moe = ["--task", "causal-lm", "--model_preset", "tiny-moe"] if recipe == "activation_checkpointing" else []
    r = launch(recipe, tmp_path, *moe, "--max_train_steps", 3, "--max_train_samples", 128, "--max_eval_samples", 32,
               config=config)
    assert all(t.numel() > 0 for t in load_params(tmp_path).values())  # the model a user's run saves
    if moe:
        assert r["model_type"] == "mixtral" and r["router_aux_loss"] > 0
    assert r["num_processes"] == processes and len(r["param_fingerprint"]) == processes
    assert len(set(r["param_fingerprint"])) == 1  # replicas in sync
    assert r["train_loss"] is not None and r["mixed_precision"] == ("bf16" if "bf16" in config else "no")
    if "bf16" in config:
        assert r["compute_dtype"] == "bfloat16"


def test_in_process_refusal_matches_the_sweep(tmp_path, monkeypatch):
    """The sweep's stand-in launch gives the same refusal as the recipe started in-process under that env."""
    for key, value in launch_env("zero3.yaml").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="recipes/pruning.py does not implement DeepSpeed ZeRO-3"):
        run_recipe("pruning", tmp_path)


if __name__ == "__main__":
    import tempfile

    class _Factory:
        def mktemp(self, name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=name))

    (ROOT / "docs" / "results" / "launch_grid.md").write_text(table(grid(_Factory())))
