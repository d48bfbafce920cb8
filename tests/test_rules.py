"""Every refusal of a combination goes through the one rule table (shared/core/rules.py), and every rule names a fix.

A combination refusal (this recipe or technique cannot train with that flag, launch or model) lives in rules.RULES;
recipes and techniques only gather the facts (resolve_launch's asks, rules.check_built(...)). What may still stop a
run outside the table is a bad input, listed below with why it is one.
"""

from __future__ import annotations

import ast
import itertools
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core import rules  # noqa: E402
from shared.core.errors import RecipeError
from shared.core.rules import RULES, SHARDINGS  # noqa: E402
from shared.tools.catalogue import recipe_run, recipes_support  # noqa: E402

# (file, function, the message's first words) -> why it is a bad input and not a combination refusal.
BAD_INPUTS = {
    # A launch config's FSDP settings, each honoured or refused naming it (moved from shared/core/, issue 32)
    ("shared/techniques/fsdp_launch.py", "launch_fsdp_settings", ""): "an fsdp_* setting FSDP2 here cannot run as "
                                                                      "written",
    ("shared/techniques/fsdp_launch.py", "fsdp_plugin_kwargs", ""): "--cpu_offload and the launch config disagree",
    ("shared/techniques/fsdp_launch.py", "wrap_blocks", "fsdp_transformer_layer_cls_to_wrap "): "a block class the "
                                                                                              "model lacks",
    # A DeepSpeed JSON's or launch config's settings the loop cannot run as written (tests/test_field_configs.py)
    ("shared/techniques/deepspeed_setup.py", "_check_global_batch", "train_batch_size "): "a JSON's global batch "
                                                                                          "no micro-batch can keep",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", '"'): "an amp / torch_autocast "
                                                                                       "block in the JSON",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", "optimizer "): "a 1-bit optimizer",
    ("shared/techniques/deepspeed_setup.py", "_check_json_optimizer", "optimizer "): "a JSON optimizer DeepSpeed "
    "cannot build here (a kernel this machine lacks, untested under ZeRO, a name it does not know, mup missing)",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", "Misspelled keys in "): "a top-level "
    "key DeepSpeed does not read, close to one it does (it would be ignored)",
    ("shared/techniques/deepspeed_setup.py", "_check_zero_block", "zero_optimization in "): "a zero_optimization "
    "block DeepSpeed's own model refuses (an unknown key, a wrong type)",
    ("shared/techniques/deepspeed_setup.py", "_fill_or_refuse_autos", " is \"auto\" in the DeepSpeed JSON "):
        "an \"auto\" nothing fills",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", "mixed precision "):
        "a precision DeepSpeed's blocks cannot hold (fp8)",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", "sequence_parallel_size in "):
        "the JSON's sequence parallelism",
    ("shared/techniques/deepspeed_setup.py", "_refuse_what_the_loop_cannot_run", "tensor_parallel.autotp_size "):
        "DeepSpeed's AutoTP",
    ("shared/techniques/deepspeed_setup.py", "launched_deepspeed_config", "The DeepSpeed JSON has "):
        "a JSON optimizer or scheduler for a recipe that builds its own",
    ("shared/techniques/fp8.py", "check_fp8_launch_config", " in the launch config's fp8_config: Tran"):
        "another FP8 backend's settings",
    ("shared/techniques/fp8.py", "check_fp8_launch_config", "fp8_config backend: "): "an FP8 backend not run here",
    ("shared/techniques/quant.py", "check_lora_targets", "--lora_target_modules: "): "LoRA target names that match "
                                                                                   "no layer of the built model",
    ("recipes/data_parallel.py", "main", "--compare_to "): "a --compare_to file that does not exist, or is the "
                                                           "results.json of a run with another process count",
    ("recipes/pruning.py", "main", "Need --pruning_start_step"): "a pruning schedule whose steps are "
                                                                                 "out of order or past the run's end",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", "Two DeepSpeed JSONs: --deepspeed_config "):
        "two DeepSpeed JSON files named at once",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", "Conflicting settings"):
        "one setting given two values by the flags, the launch config and the JSON",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", "ZeRO stage "): "a ZeRO stage out of range",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", " to nvme needs a directory"):
        "an NVMe offload without its path",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", "offload_param needs ZeRO stage 3"):
        "a DeepSpeed JSON that contradicts itself (DeepSpeed would refuse it)",
    ("shared/techniques/deepspeed_setup.py", "resolve_deepspeed_config", "stage3_gather_16bit_weights"):
        "a JSON setting that would leave the final model unsaved",
    ("shared/techniques/deepspeed_setup.py", "_check_async_io", "NVMe offload needs DeepSpeed's async_io"):
        "a library missing from this machine",
    ("shared/techniques/deepspeed_setup.py", "check_installed", "This run uses DeepSpeed"): "a library missing from "
                                                                                         "this machine",
    ("shared/techniques/pipeline_stages.py", "stage_loss", "--generate: "): "sft's greedy answers asked of pipeline "
                                                                          "stages, none of which holds the model",
    ("shared/techniques/pipeline_stages.py", "split_layers", "--layers_per_stage "): "a --layers_per_stage that does "
                                                                                     "not parse or add up",
    # A checkpoint written by another layout that these recipes cannot reshard (docs/resharding.md).
    ("shared/techniques/deepspeed_setup.py", "load_checkpoint", " holds the ZeRO slices of "): "a ZeRO checkpoint of "
                                                                                        "another process count, "
                                                                                        "not converted",
    ("shared/techniques/pipeline_stages.py", "load_hook", " holds the state of "): "a checkpoint of another "
                                                                                  "process count",
    ("shared/techniques/pipeline_stages.py", "load_hook", " holds another stage than"): "a checkpoint of another cut "
                                                                                       "of the model",
    ("shared/techniques/tensor_parallel.py", "load_hook", " has no mesh.json"): "a checkpoint no DTensor run wrote",
    ("shared/techniques/tensor_parallel.py", "load_hook", " was saved on the mesh "): "a checkpoint of another mesh",
    ("shared/techniques/quant.py", "load_hook", " was not trained on this base model"): "adapters of another base",
    ("shared/techniques/quant.py", "load_hook", " holds other trainable parameters"): "adapters of another shape",
}


def _first_words(message: ast.expr) -> str:
    """The literal text a SystemExit message starts with (an f-string's first constant part), at most 40 chars."""
    if isinstance(message, ast.BinOp):  # "..." + ...
        return _first_words(message.left)
    if isinstance(message, ast.JoinedStr):
        message = next((v for v in message.values if isinstance(v, ast.Constant)), ast.Constant(""))
    return message.value[:40] if isinstance(message, ast.Constant) and isinstance(message.value, str) else ""


# What a refusal raises: SystemExit, or one of the project's errors (shared/core/errors.py).
_REFUSALS = ("SystemExit", "RecipeError", "LaunchError", "InputError", "CheckpointError", "TrainingError")


def _is_exit(node: ast.AST) -> ast.Call | ast.Name | None:
    """The refusal a node raises (`raise SystemExit(...)`, `raise LaunchError(...)`, `sys.exit(...)`), else None."""
    if isinstance(node, ast.Raise):
        exc = node.exc
        if isinstance(exc, ast.Name) and exc.id in _REFUSALS:
            return exc
        if isinstance(exc, ast.Call) and isinstance(exc.func, ast.Name) and exc.func.id in _REFUSALS:
            return exc
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "sys"):
        return node
    return None


def system_exits(path: Path, root: Path = ROOT) -> Counter:
    """(file, innermost function, first words) of each SystemExit raised in a file."""
    found: Counter = Counter()
    rel = path.relative_to(root).as_posix()

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        exit_ = _is_exit(node)
        if exit_ is not None:
            args = exit_.args if isinstance(exit_, ast.Call) else []
            found[(rel, where, _first_words(args[0]) if args else "")] += 1
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def _raisers() -> dict[tuple[str, str, str], int]:
    found: Counter = Counter()
    for path in sorted([*(ROOT / "recipes").glob("*.py"), *(ROOT / "shared" / "techniques").glob("*.py")]):
        found += system_exits(path)
    return dict(found)


def _prefix_of(key: tuple[str, str, str]) -> tuple[str, str, str] | None:
    return next((k for k in BAD_INPUTS if k[:2] == key[:2] and key[2].startswith(k[2])), None)


def test_no_refusal_outside_the_rule_table():
    unlisted = sorted(k for k in _raisers() if _prefix_of(k) is None)
    assert not unlisted, ("a refusal outside shared/core/rules.py: make it a Rule (facts via resolve_launch's "
                          f"asks or rules.check_built), or list it in BAD_INPUTS with its reason: {unlisted}")
    stale = set(BAD_INPUTS) - {_prefix_of(k) for k in _raisers()}
    assert not stale, f"BAD_INPUTS entries that no longer exist: {stale}"


def test_the_scan_finds_a_refusal(tmp_path):
    """The scan is not blind: a combination refusal written in a recipe is found (and would fail the test above)."""
    planted = tmp_path / "baseline.py"
    planted.write_text((ROOT / "recipes" / "baseline.py").read_text() + '\n\ndef check(args):\n    if args.lora:\n'
                       '        raise SystemExit(f"--lora {args.lora} with recipes/baseline.py: use qlora.py.")\n')
    found = system_exits(planted, root=tmp_path)
    assert found == Counter({("baseline.py", "check", "--lora "): 1})
    assert _prefix_of(("recipes/baseline.py", "check", "--lora ")) is None  # not a listed bad input: it would fail


# One Run per rule's situation: launch-time asks on every recipe, launch and process count, and built facts.
_ASKS = [
    {}, {"accumulation": 2}, {"optimizer": "adamw_torchao_8bit"}, {"optimizer": "adamw_bnb_8bit"},
    {"optimizer": "adamw_bnb_8bit", "offload": "cpu"}, {"optimizer": "adamw_in_backward", "accumulation": 2},
    {"optimizer": "adamw_in_backward", "max_grad_norm": 1.0}, {"optimizer": "adamw_in_backward", "precision": "fp16"},
    {"precision": "fp16"}, {"precision": "bf16"}, {"precision": "fp8"}, {"precision": "fp16", "on_accelerator": False},
    {"compile": "regional"}, {"load_in": "4bit"}, {"load_in": "8bit", "lora": True},
    {"load_in": "4bit", "lora": True}, {"load_in": "4bit", "lora": True, "dora": True}, {"dora": True},
    {"spread_devices": True}, {"merge_unsaved": True}, {"stages_per_replica": 3}, {"tensor_parallel_size": 3},
    {"parallelism_config": "tp=2 cp=2", "on_accelerator": False}, {"packing": "per_document"},
    {"task": "text-classification"}, {"task": "text-classification", "packing": "per_document"},
    {"task": "causal-lm", "seq_len": 7}, {"task": "causal-lm", "packing": "none"}, {"task": "sft", "packing": "concat"},
    {"offload": "nvme"}, {"offload": "cpu"}, {"microbatches": 4, "batch_size": 6},
    {"microbatches": 2, "batch_size": 4, "accumulation": 2},
    {"checkpoint_impl": "hf", "checkpoint_every": 2}, {"checkpoint_impl": "hf", "checkpoint_policy": "selective"},
    {"shard_vocab": True, "task": "image-classification"}, {"chunked_loss": True, "task": "text-classification"},
    {"model_given": False}, {"preset": "tiny-llama", "task": "image-classification"},
    {"preset": "tiny-qwen3-moe", "task": "image-classification"}, {"lone_launch": True}, {"weights": "bf16"},
    {"weights": "bf16", "precision": "bf16"},
    {"preset": "tiny-moe", "packing": "per_document"},
    {"attention": "flash_attention_2", "on_accelerator": False}, {"async_checkpoint": True},
    {"dp_replicate_size": 3}, {"dp_replicate_size": 4}, {"parallelism_config": "tp=2"},  # HSDP; Accelerate's TP
    {"comm_hook": "fp16", "local_sgd_steps": 4}, {"comm_hook": "bf16", "on_accelerator": False},
    {"powersgd_typed": "--powersgd_rank"}, {"comm_hook": "power_sgd", "train_steps": 5, "powersgd_start": 10},
    {"local_sgd_steps": 4, "checkpoints": True},
    {"in_backward": True},  # the ladder's combined.py
    {"checkpoint_policy": "selective", "checkpointing": False},
    {"activation_offload": "all"}, {"activation_offload": "checkpointed", "checkpointing": False},
    {"activation_offload": "all", "activation_offload_to": "disk", "activation_offload_dir": True},
]
_FACTS = [
    {"model_type": "llama", "tp_plans": ("gpt2", "bert")}, {"heads": 4, "mlp_width": 6, "tp_degree": 4},
    {"heads": 3, "kv_heads": 3, "sp_degree": 2}, {"model_type": "llama", "stage_families": ("gpt2",)},
    {"layers": 2, "stages": 3}, {"stages": 4, "devices": 2, "device_kind": "cuda"},
    {"layers": 2, "checkpoint_every": 3}, {"group_size": 48, "in_features": (64, 256)},
    {"paged": True, "device": "cpu"}, {"head_kind": "None"}, {"logit_transform": "final_logit_softcapping=30.0"},
    {"head_calls": 2}, {"linear_head_needed": True, "head_kind": "Conv1D"},
    {"recipe": "fp8", "resolved_precision": "fp16", "fp8_backend": "None"}, {"fp8_converted": 0},
    {"shard_vocab": True, "tp_plan_source": "own", "model_type": "llama"},
    {"model_type": "gpt2", "ep_dispatch": False}, {"experts": 4, "ep_degree": 3},
    {"recipe": "qat", "model_type": "mixtral", "linear_only": "fake-quantizes", "outside_linear": "mlp.experts"},
    {"no_router_loss": "MixtralForSequenceClassification", "task": "text-classification"},
    {"stage_drops": ("attention soft-capping",)}, {"sp_drops": ("chunked_attention layers",)},  # attention variants
    {"tp_unsplit_sinks": True, "model_type": "gpt_oss"},
    {"tp_tie_mismatch": "lm_head.weight is tied to model.embed_tokens.weight (Shard(0) and Shard(1))"},
]


def _launch_runs():
    launches = [(s, s) for s in SHARDINGS] + [("zero2", "fsdp"), ("fsdp", "zero3"), ("megatron", "megatron")]
    for recipe, (sharding, launched), n, asks in itertools.product(recipes_support(), launches, (1, 2, 4), _ASKS):
        yield recipe_run(recipe=recipe, sharding=sharding, launched=launched, num_processes=n, **asks)


def test_the_recipes_a_refusal_points_to_are_the_recipes_that_say_so():
    """The compile and --async_checkpoint refusals name recipes (shared/core/rules.py), as their SUPPORT says."""
    catalogue = recipes_support()
    assert set(rules.COMPILING) == {name for name, support in catalogue.items() if support.compiles}
    assert set(rules.ASYNC_CHECKPOINTING) == {name for name, support in catalogue.items() if support.async_checkpoint}


def test_fsdp_code_comes_with_the_recipes_that_run_fsdp(tmp_path):
    """The recipes whose SUPPORT runs FSDP hand the spine fsdp_launch's steps there; the others carry none of it (a
    baseline copy has no FSDP code), and a recipe that runs FSDP without them is refused before anything loads."""
    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.techniques import fsdp_launch

    catalogue = recipes_support()
    assert {n for n, s in catalogue.items() if s.fsdp is fsdp_launch.STEPS} == {
        n for n, s in catalogue.items() if "fsdp" in s.shardings}
    assert "fsdp_launch" not in (ROOT / "recipes" / "baseline.py").read_text()
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_USE_CPU": "true"}
    args = parse_args(["--output_dir", str(tmp_path / "out")])
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with pytest.raises(RecipeError, match=r"Support\(\.\.\., fsdp=fsdp_launch\.STEPS\)"):
            resolve_launch(args, "my_fsdp", rules.Support(shardings=("fsdp",), min_processes=2))


def test_deepspeed_code_comes_with_the_recipes_that_run_deepspeed(tmp_path):
    """As FSDP's: the recipes whose SUPPORT runs ZeRO hand the spine deepspeed_setup's steps (and its rules come with
    the import); a baseline copy has no DeepSpeed code, and its DeepSpeed launch is refused by the table naming the
    recipes that run it; a recipe that runs ZeRO without the steps is refused before anything loads."""
    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.techniques import deepspeed_setup

    catalogue = recipes_support()
    assert {n for n, s in catalogue.items() if s.deepspeed is deepspeed_setup.STEPS} == {
        n for n, s in catalogue.items() if set(s.shardings) & {"zero1", "zero2", "zero3"}} == {
        "zero", "zero3_offload", "combined", "chunked_loss", "qlora"}
    assert "deepspeed" not in (ROOT / "recipes" / "baseline.py").read_text()
    assert all(rule in RULES for rule in deepspeed_setup.RULES)
    args = parse_args(["--output_dir", str(tmp_path / "out")])
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
                     "ACCELERATE_CONFIG_DS_FIELDS": "zero_stage"}.items():
            mp.setenv(k, v)
        with pytest.raises(RecipeError, match=r"recipes/baseline.py does not implement DeepSpeed ZeRO-3.*Fix: Use "
                                              r"recipes/zero.py"):
            resolve_launch(args, "baseline", catalogue["baseline"])
        with pytest.raises(RecipeError, match=r"Support\(\.\.\., deepspeed=deepspeed_setup\.STEPS\)"):
            resolve_launch(args, "my_zero", rules.Support(shardings=("zero3",)))
    args = parse_args(["--output_dir", str(tmp_path / "out")], deepspeed_setup.add_deepspeed_args)
    config = deepspeed_setup.resolve_deepspeed_config(args, deepspeed_setup.zero_config(2))
    with pytest.raises(RecipeError, match=r"Support\(\.\.\., deepspeed=deepspeed_setup\.STEPS\)"):
        resolve_launch(args, "my_zero", rules.Support(shardings=("zero2",)), deepspeed_config=config)


def test_every_rule_fires_somewhere_and_names_a_fix():
    fired: Counter = Counter()
    runs = [*_launch_runs(),
            *(recipe_run(**{"recipe": "", "sharding": "none", "launched": "none", **f}) for f in _FACTS)]
    for run in runs:
        for i, rule in enumerate(RULES):
            if (run.recipe or rule.built) and rule.applies(run):
                fired[i] += 1
                reason, fix = rule.reason(run), rule.fix(run)
                assert len(reason.split()) >= 5 and len(fix.split()) >= 2, (reason, fix)
                assert fix.strip(" .").lower() not in reason.lower()
    never = [RULES[i].reason.__code__.co_firstlineno for i in range(len(RULES)) if not fired[i]]
    assert not never, f"rules (at these lines of shared/core/rules.py) that no example run reaches: {never}"


def test_built_rules_wait_for_their_facts():
    """A launch-time check() never reads a built fact: with the facts unknown (their defaults), no built rule fires."""
    for run in _launch_runs():
        assert not [r for r in RULES if r.built and r.applies(run)], run
        assert rules.built_refusals(run) == []


def test_check_built_refuses_with_the_reason_and_the_fix():
    with pytest.raises(RecipeError, match=r"--num_stages 4 but only 2 cuda devices.*Fix: Pass --num_stages 2 or less"):
        rules.check_built(stages=4, devices=2, device_kind="cuda", flags={"stages": "--num_stages"})
    rules.check_built(stages=2, devices=2, device_kind="cuda")  # fits: nothing raised
    rules.check_built(heads=4, mlp_width=16, tp_degree=2)
    with pytest.raises(RecipeError, match=r"MLP width \(6\) does not split over 4 processes"):
        rules.check_built(heads=4, mlp_width=6, tp_degree=4)


def test_the_sweeps_quant_storage_follows_the_table():
    """benchmarks/compat_sweep.py adds --bnb_4bit_quant_storage bfloat16 exactly where the table refuses uint8
    packing."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compat_sweep as compat

    for sharding in compat.SHARDING:
        run = recipe_run(recipe="combined", sharding=sharding, launched=sharding, num_processes=2, load_in="4bit",
                         lora=True)
        refused = any("packed in uint8" in r for r in rules.refusals(run))
        assert compat.bf16_storage_lifts_a_rule(sharding, "nf4+lora") == refused == (sharding in ("zero3", "fsdp"))
        assert not rules.refusals(replace(run, quant_storage="bfloat16"))


# Moved rules, end to end: refused by the recipe's main, with the words and the fix, before anything is written.
E2E = [
    ("pipeline_parallel", ["--gradient_accumulation_steps", "2"],
     ["--gradient_accumulation_steps 2: recipes/pipeline_parallel.py's micro-batches already accumulate",
      "Drop the flag, and raise --n_microbatches"]),
    ("data_model_parallel", ["--per_device_train_batch_size", "3", "--n_microbatches", "2"],
     ["--per_device_train_batch_size 3 is not divisible by --n_microbatches 2", "Fix: Pick a batch size"]),
    ("activation_checkpointing", ["--checkpointing_impl", "hf", "--checkpointing_policy", "selective"],
     ["--checkpointing_impl hf checkpoints every block whole", "Fix: Pass --checkpointing_impl torch"]),
    ("tensor_parallel", ["--shard_vocab", "--task", "image-classification"],
     ["--shard_vocab with --task image-classification", "Fix: Drop --shard_vocab, or use --task causal-lm"]),
    ("tensor_parallel", ["--mixed_precision", "fp16"],
     ["fp16 with recipes/tensor_parallel.py: its loss scaler", "Fix: Use --mixed_precision bf16 or no"]),
    ("chunked_loss", ["--task", "text-classification"],
     ["recipes/chunked_loss.py chunks a causal LM's vocabulary logits", "Fix: Pass --task causal-lm"]),
    ("ptq", [], ["recipes/ptq.py quantizes a trained model", "Fix: Pass --model_name_or_path"]),
    # a built fact: the tiny preset's 2 blocks, read once the model exists
    ("activation_checkpointing", ["--checkpointing_impl", "torch", "--checkpoint_every", "3", "--no_probe"],
     ["--checkpoint_every 3 checkpoints no block: the model has 2", "Fix: Pass --checkpoint_every 2 or less"]),
]


@pytest.mark.parametrize("recipe, argv, says", E2E, ids=[f"{r}-{'-'.join(a)[:40]}" for r, a, _ in E2E])
def test_a_moved_rule_refuses_through_the_recipe(recipe, argv, says, tmp_path, capsys, monkeypatch):
    from tests.conftest import run_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run_recipe(recipe, out, *argv, "--max_train_steps", 2)
    printed = capsys.readouterr()
    message = str(exc.value.code)
    assert message.startswith("Refused before training: ")
    for fragment in says:
        assert fragment in message, (fragment, message)
    assert "train:" not in printed.err + printed.out, "training started before the refusal"
    assert not (out / "results.json").exists() and not list(out.glob("checkpoints/step_*"))
