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

from shared.core.rules import RECIPES as CATALOGUE
from tests.conftest import CONFIGS, ROOT, launch, load_params, load_recipe, run_recipe

RECIPES = sorted(CATALOGUE)  # tests/test_recipe_shape.py holds it to the files in recipes/
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
    # torchrun gives each process its world size.
    return {**env, "WORLD_SIZE": str(args.num_processes if args.num_processes > 1 else 1)}


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
             "sample for real. ✓ launched by a test on the recipe's default task, trained and saved its model; "
             "c passes every start-up check, not launched by a test; R refused before anything is loaded (the "
             "reasons are below).", "",
             "| recipe | " + " | ".join(short) + " |", "|---|" + "---|" * len(short)]
    for recipe in RECIPES:
        ran = {(r, c) for r, c, _ in LAUNCHED}
        cells = ["R" if verdicts[recipe, c] is not None else "✓" if (recipe, c) in ran else "c" for c in CONFIG_FILES]
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
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


# The pairs a test launches for real, on the recipe's default task, the model saved: the grid's ✓ cells. combined x
# fsdp.yaml passed the start-up checks and crashed in fully_shard (BERT's embeddings wrapped as a unit), so a cell
# that only passes the checks is marked apart.
LAUNCHED = [("combined", "fsdp.yaml", 2), ("qat", "multi_cpu.yaml", 2), ("optim_8bit", "bf16.yaml", 1),
            ("activation_checkpointing", "multi_cpu.yaml", 2)]


@pytest.mark.parametrize("recipe, config, processes", [
    LAUNCHED[0], *(pytest.param(*pair, marks=pytest.mark.slow) for pair in LAUNCHED[1:])])
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
