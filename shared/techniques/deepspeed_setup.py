"""DeepSpeed ZeRO for the recipes: one resolved config, conflicts stopped before training, state counted right.

A setting can come from four places: the recipe's own defaults, a flag on the command line, the accelerate config
(`accelerate launch` turns its YAML into ACCELERATE_* environment variables) and a DeepSpeed JSON. Left alone they
disagree silently: Accelerate warns and takes DeepSpeed's accumulation steps, fills an "auto" clipping with 1.0
whatever --max_grad_norm says, and drops the YAML's NVMe paths. Here every value the user set explicitly must agree;
the agreed value (or the recipe's default) is written into the config AND back into args, so the Accelerator,
the training loop and DeepSpeed all run on the same numbers.

A recipe that trains under DeepSpeed hands the spine its steps in its SUPPORT (`Support(..., deepspeed=STEPS)`: the
agreed settings, the install check, a lone process's rendezvous), and importing this module adds DeepSpeed's rules
to the rule table; a recipe that never runs DeepSpeed carries none of it, and the rule table refuses its DeepSpeed
launch.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core import rules
from ..core.boundary import loading
from ..core.errors import LaunchError
from ..core.launch import free_port
from ..core.measure import state_bytes
from ..core.rules import Rule, launch_words

logger = logging.getLogger("recipes")
SOURCES = "recipe_settings_sources"  # the key under which a resolved config records where each agreed value came from

_YAML = "the accelerate config (--config_file)"

# DeepSpeed JSON key -> (recipe flag that sets it, env var `accelerate launch` sets from the YAML)
SETTINGS: dict[str, tuple[str | None, str | None]] = {
    "gradient_accumulation_steps": ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    "gradient_clipping": ("max_grad_norm", "ACCELERATE_GRADIENT_CLIPPING"),
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", None),
    "mixed_precision": ("mixed_precision", "ACCELERATE_MIXED_PRECISION"),  # the fp16 / bf16 blocks
    "zero_optimization.stage": ("zero_stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    "zero_optimization.offload_optimizer.device": ("offload", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
    "zero_optimization.offload_param.device": ("offload", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    "zero_optimization.offload_optimizer.nvme_path": ("nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
    "zero_optimization.offload_param.nvme_path": ("nvme_path", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        None, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
    # The JSON's own optimizer and scheduler blocks, where it has them (json_optimizer_and_scheduler below)
    "optimizer.params.lr": ("learning_rate", None),
    "optimizer.params.weight_decay": ("weight_decay", None),
    "scheduler.params.warmup_num_steps": ("num_warmup_steps", None),
}
_TRAINING = ("gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu", "mixed_precision")
_FLAG_TYPES = {"max_grad_norm": float, "gradient_accumulation_steps": int, "per_device_train_batch_size": int,
               "learning_rate": float, "weight_decay": float, "num_warmup_steps": int}


def add_deepspeed_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--deepspeed_config", default=None,
                       help="A DeepSpeed JSON: its settings replace the recipe's (its optimizer and scheduler "
                            "blocks run too). Values set to \"auto\" are filled from the flags; explicit values must "
                            "agree with the flags and the accelerate config.")
    group.add_argument("--nvme_path", default=None,
                       help="Directory for NVMe offload (swap files go there; removed when the run ends).")


def _get(config: dict, key: str) -> object:
    node: object = config
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if not isinstance(node, dict):
        return None
    names = zero_spellings(last) if parents == ["zero_optimization"] else [last]
    return next((node[name] for name in names if name in node), None)


def zero_spellings(key: str) -> list[str]:
    """Every name DeepSpeed's own config model accepts for a zero_optimization setting: the field, its alias and
    the deprecated names that map to it (stage3_gather_fp16_weights_on_model_save ...), `key` first. A value the
    user's JSON spells another way is read, and never written again under a second name (DeepSpeed would reject
    the pair)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    target = next((name for name, f in fields.items() if key in (name, f.alias)), None)
    if target is None:
        return [key]
    names = [key, target, fields[target].alias]
    for name, f in fields.items():
        extra = f.json_schema_extra if isinstance(f.json_schema_extra, dict) else {}
        if extra.get("deprecated") and extra.get("new_param") == target:
            names += [name, f.alias]
    return list(dict.fromkeys(n for n in names if n))


def _set(config: dict, key: str, value: object) -> None:
    """Under the name the user's JSON already spells it, if it does."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if parents == ["zero_optimization"]:
        last = next((name for name in zero_spellings(last) if name in node), last)
    node[last] = value


def _normalize(key: str, value: object) -> object:
    if value is None or value == "auto":
        return None
    if key in ("gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay"):
        return float(value)
    if key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "zero_optimization.stage",
               "scheduler.params.warmup_num_steps"):
        return int(value)
    if key.endswith("gather_16bit_weights_on_model_save"):
        return str(value).lower() in ("1", "true")
    if key.endswith("nvme_path"):
        return None if str(value).lower() == "none" else str(Path(str(value)).expanduser().resolve())
    return str(value).lower()


def _json_precision(config: dict) -> str | None:
    """fp16 / bf16 / no as a DeepSpeed JSON states it; None when it leaves the choice open ("auto" or absent)."""
    enabled = {k: _get(config, f"{k}.enabled") for k in ("fp16", "bf16")}
    for name, value in enabled.items():
        if value is True or str(value).lower() == "true":
            return name
    if any(v is False or str(v).lower() == "false" for v in enabled.values()):
        return "no"
    return None


def zero_config(stage: int, offload: str | None = None) -> dict:
    """A recipe's own DeepSpeed settings for ZeRO `stage`, the base resolve_deepspeed_config merges the flags, the
    accelerate config and a DeepSpeed JSON into. "auto" values are filled from the flags, or by DeepSpeed at prepare().

    offload: None leaves it to the launch config; "none" / "cpu" / "nvme" sets where the optimizer state and, under
    ZeRO-3, the parameters live between uses.
    """
    zero: dict = {
        "stage": stage,
        "stage3_gather_16bit_weights_on_model_save": True,  # save_model gathers one consolidated model
        # "auto": sized from hidden_size. DeepSpeed's default threshold (1e5) would keep every tensor of a
        # small model whole on every process.
        "stage3_param_persistence_threshold": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "reduce_bucket_size": "auto",
    }
    config: dict = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                    "gradient_clipping": "auto", "zero_optimization": zero}
    if offload is None:
        return config
    zero["offload_optimizer"] = {"device": offload}
    if stage == 3:
        zero["offload_param"] = {"device": offload}
    return config


def zero3_init(ds_config: dict) -> bool:
    """Build the model under zero.Init (partitioned as it is built, no process ever holds it all): under ZeRO-3,
    unless the accelerate config says `zero3_init_flag: false`, which is honoured (the model is built whole, then
    partitioned at prepare())."""
    stated = os.environ.get("ACCELERATE_DEEPSPEED_ZERO3_INIT")
    stage3 = int(ds_config["zero_optimization"]["stage"]) == 3
    return stage3 and (stated is None or stated.lower() in ("1", "true", "yes"))


def launched_deepspeed_config(args: argparse.Namespace) -> dict | None:
    """For recipes whose launch config picks the sharding: the DeepSpeed settings when it chose DeepSpeed (stage and
    offload from it), resolved and checked as recipes/zero.py's; None when it chose anything else."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    config = resolve_deepspeed_config(args, zero_config(int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))))
    if blocks := [b for b in ("optimizer", "scheduler") if b in config]:
        raise LaunchError(f"The DeepSpeed JSON has {' and '.join(blocks)} blocks: this recipe builds its own optimizer "
                          "and schedule (its flags choose them). Remove the blocks, or run the JSON's with "
                          "recipes/zero.py.")
    return config


def resolve_deepspeed_config(args: argparse.Namespace, recipe_config: dict) -> dict:
    """The DeepSpeed config this run trains with. Stops (SystemExit) on any disagreement, naming both sources.

    Sources, all of which must agree where they are explicit: flags given on the command line, the accelerate
    config, a DeepSpeed JSON (--deepspeed_config, or deepspeed_config_file in the accelerate config). The JSON,
    when given, is the base; otherwise the recipe's defaults are, overlaid with the accelerate config.
    """
    json_file = args.deepspeed_config or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    json_file = None if json_file == "none" else json_file
    if args.deepspeed_config and os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") not in (
            "none", args.deepspeed_config):
        raise LaunchError(f"Two DeepSpeed JSONs: --deepspeed_config {args.deepspeed_config} and "
                          f"{os.environ['ACCELERATE_DEEPSPEED_CONFIG_FILE']} from {_YAML}. Keep one.")
    user_json: dict = {}
    if json_file:  # a missing file, a folder, malformed JSON: an InputError naming the file and the fix
        flag = "--deepspeed_config" if args.deepspeed_config else "deepspeed_config_file (the accelerate config)"
        with loading("DeepSpeed JSON", flag, json_file):
            user_json = json.loads(Path(json_file).read_text())
            if not isinstance(user_json, dict):
                raise ValueError(f"it holds a {type(user_json).__name__}, not an object of settings")
    config = copy.deepcopy(user_json or recipe_config)
    explicit = getattr(args, "explicit_flags", set())

    conflicts, chosen = [], {}
    for key, (flag, env) in SETTINGS.items():
        found: list[tuple[object, str]] = []
        if flag and flag in explicit and hasattr(args, flag):
            found.append((_normalize(key, getattr(args, flag)), f"--{flag}"))
        if env and os.environ.get(env) is not None:
            value = _normalize(key, os.environ[env])
            if not (key == "mixed_precision" and value == "no"):  # `accelerate launch` sets "no" by default
                found.append((value, f"{_YAML} ({env})"))
        json_value = _json_precision(user_json) if key == "mixed_precision" else _normalize(key, _get(user_json, key))
        if json_value is not None:
            found.append((json_value, f"the DeepSpeed JSON {json_file} (\"{key}\")"))
        found = [(v, s) for v, s in found if v is not None]
        if len({v for v, _ in found}) > 1:
            conflicts.append(f"  {key}: " + " vs ".join(f"{v} from {s}" for v, s in found))
            continue
        if found:
            chosen[key] = found[0]
        elif key in _TRAINING:  # nobody set it: the flag's default, so the loop and DeepSpeed still agree
            default = (args.mixed_precision or "no") if key == "mixed_precision" else getattr(args, flag)
            chosen[key] = (_normalize(key, default), f"the default of --{flag}")
    if conflicts:
        raise LaunchError("Conflicting settings, stopped before training:\n" + "\n".join(conflicts) +
                          "\nSet each value in one place (or set it to \"auto\" in the DeepSpeed JSON).")

    # One source of truth: the agreed values go into the config, which resolve_launch reads them from (the loop,
    # the Accelerator and the logs use them there; the flags as typed stay as they are).
    for key, (value, _) in chosen.items():
        if key == "mixed_precision":
            config.setdefault("fp16", {})["enabled"] = value == "fp16"
            config.setdefault("bf16", {})["enabled"] = value == "bf16"
        elif key.endswith("nvme_path"):
            continue  # written below, only where the device is nvme
        elif key.split(".")[0] in ("optimizer", "scheduler") and key.split(".")[0] not in config:
            continue  # no such block in the JSON: the recipe's own optimizer and schedule take the flag
        else:
            _set(config, key, _FLAG_TYPES.get(SETTINGS[key][0], lambda v: v)(value))
    _check_global_batch(config, chosen, json_file)
    _refuse_what_the_loop_cannot_run(config, chosen, json_file)

    zero = config.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise LaunchError(f"ZeRO stage {stage}: these recipes run stage 1, 2 or 3. Stage 0 shards nothing: that is "
                          "DDP, recipes/data_parallel.py with accelerate_configs/multi_cpu.yaml (multi_gpu.yaml on "
                          "GPUs).")
    for part in ("offload_optimizer", "offload_param"):
        block = zero.get(part)
        device = (block or {}).get("device", "none")
        if device == "none" and block is not None:
            block.pop("nvme_path", None)
        if device != "nvme" or stage < 3:  # NVMe under ZeRO-1/2 is refused by the rule table (shared/core/rules.py)
            continue
        path = chosen.get(f"zero_optimization.{part}.nvme_path", (None, ""))[0]
        if path is None:
            raise LaunchError(f"{part} to nvme needs a directory: pass --nvme_path DIR (Accelerate drops the YAML's "
                              "nvme paths, and DeepSpeed would then write to ./none).")
        Path(path).mkdir(parents=True, exist_ok=True)
        block["nvme_path"] = path
        _check_async_io()
    if stage < 3 and (zero.get("offload_param") or {}).get("device", "none") != "none":
        raise LaunchError(f"offload_param needs ZeRO stage 3 (resolved stage: {stage}).")
    if stage == 3 and not args.no_save_model:
        save16 = chosen.get("zero_optimization.stage3_gather_16bit_weights_on_model_save", (None, ""))
        if save16[0] is False:
            raise LaunchError(f"stage3_gather_16bit_weights_on_model_save is false ({save16[1]}): the final model "
                              "cannot be consolidated. Set it true, or pass --no_save_model.")
        _set(config, "zero_optimization.stage3_gather_16bit_weights_on_model_save", True)

    _fill_or_refuse_autos(config, json_file)  # after every value above is written

    # Accelerate refuses a config dict beside YAML DeepSpeed fields ("will be ignored"): they were merged and
    # checked against each other above, so that refusal no longer applies.
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    logger.info("DeepSpeed settings: %s", "; ".join(f"{k}={v} (from {s})" for k, (v, s) in chosen.items()))
    # Where each value came from, for results.json (deepspeed_summary); DeepSpeed ignores keys it does not know.
    config[SOURCES] = {k: s for k, (_, s) in chosen.items()}
    return config


def _check_global_batch(config: dict, chosen: dict, json_file: str | None) -> None:
    """A global batch the JSON states (train_batch_size) is honoured: the micro-batch or the accumulation that nobody
    set is derived from it, or, where both were set, all three must agree (the refusal names the flags that keep it)."""
    stated = _normalize("gradient_accumulation_steps", config.get("train_batch_size"))
    if stated is None:
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    if stated == micro * accumulation * world:
        return
    for key, other in (("train_micro_batch_size_per_gpu", accumulation), ("gradient_accumulation_steps", micro)):
        if chosen[key][1].startswith("the default") and stated % (other * world) == 0:
            config[key] = stated // (other * world)
            chosen[key] = (config[key], f"train_batch_size {stated} in the DeepSpeed JSON {json_file}")
            return
    # Both set, or neither divides: the refusal names the values that keep the global batch.
    keep = [f"--per_device_train_batch_size {stated // (accumulation * world)}"] if stated % (
        accumulation * world) == 0 else []
    keep += [f"--gradient_accumulation_steps {stated // (micro * world)}"] if stated % (micro * world) == 0 else []
    raise LaunchError(f"train_batch_size {stated} in the DeepSpeed JSON {json_file} != micro-batch {micro} x "
                      f"accumulation {accumulation} x {world} processes = {micro * accumulation * world}. To keep "
                      f"the global batch of {stated}: " + (" or ".join(keep) if keep else
                                                          "a micro-batch and accumulation whose product with the "
                                                          f"{world} processes is {stated}") +
                      "; or set train_batch_size to \"auto\".")


# Top-level keys DeepSpeed reads through its pydantic models rather than through named constants
_MODEL_KEYS = ("tensorboard", "wandb", "csv_monitor", "comet", "elasticity", "nebula", "amp", "sparse_attention",
               "pipeline", "compression_training", "weight_quantization", "hybrid_engine", "sparse_gradients",
               "eigenvalue", "progressive_layer_drop", "quantize_training", "compile", "graph_harvesting",
               "tensor_parallel", "sequence_parallel_size", "zero_optimization")


def _misspelled_keys(config: dict) -> list[tuple[str, str]]:
    """(key, the key DeepSpeed knows it is close to): DeepSpeed ignores a top-level key it does not read, so a
    misspelled block ("zero_optimisation") trained as if it were absent (no ZeRO), unsaid."""
    import difflib
    import sys

    import deepspeed.runtime.config  # noqa: F401  (loads the modules whose constants name the keys it reads)

    known = set(_MODEL_KEYS) | {v for name, module in list(sys.modules.items()) if name.startswith("deepspeed")
                                and module is not None for k, v in vars(module).items()
                                if k.isupper() and isinstance(v, str)}
    return [(key, near[0]) for key in config if key not in known
            and (near := difflib.get_close_matches(key, known, n=1, cutoff=0.85))]


def _check_zero_block(config: dict, where: str) -> None:
    """zero_optimization as DeepSpeed's own model validates it in deepspeed.initialize (a key it does not know, a
    value of the wrong type): a raw pydantic ValidationError from prepare() before. "auto" values are Accelerate's
    to fill, so they are left out here."""
    import difflib

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, get_zero_config
    from pydantic import ValidationError

    def known(node: object) -> object:
        return {k: known(v) for k, v in node.items() if v != "auto"} if isinstance(node, dict) else node

    try:
        get_zero_config({"zero_optimization": known(config.get("zero_optimization") or {})})
    except ValidationError as err:
        names = [n for k, f in DeepSpeedZeroConfig.model_fields.items() for n in (k, f.alias) if n]
        problems = "; ".join(f"zero_optimization.{'.'.join(map(str, e['loc']))}: {e['msg']}" + "".join(
            f' (did you mean "{n}"?)' for n in difflib.get_close_matches(str(e["loc"][-1]), names, n=1, cutoff=0.8)
            if e["type"] == "extra_forbidden") for e in err.errors())
        raise LaunchError(f"zero_optimization in {where}: {problems} (DeepSpeed's check of the block). Fix or "
                          "remove those keys: DeepSpeed's config docs list the zero_optimization keys.") from None


def _refuse_what_the_loop_cannot_run(config: dict, chosen: dict, json_file: str | None) -> None:
    """JSON settings that change training and that these recipes do not run as written: refused by name."""
    where = f"the DeepSpeed JSON {json_file}" if json_file else "the DeepSpeed settings"
    if typos := _misspelled_keys(config):
        said = "; ".join(f'"{key}" is not a key DeepSpeed reads (did you mean "{near}"?)' for key, near in typos)
        raise LaunchError(f"Misspelled keys in {where}: {said}. DeepSpeed ignores keys it does not know, so the "
                          "block would not apply. Fix the spelling.")
    _check_zero_block(config, where)
    # fp16 on a machine without a GPU: the rule table's (shared/core/rules.py), which names this JSON when it said fp16
    precision, source = chosen.get("mixed_precision", ("no", ""))
    if precision not in ("no", "fp16", "bf16"):  # the fp16 / bf16 blocks hold no other: it would have run in fp32
        raise LaunchError(f"mixed precision {precision!r} ({source}) under DeepSpeed: these recipes run DeepSpeed in "
                          "fp16, bf16 or fp32, and fp8 is recipes/fp8.py's (one process or DDP, checking what it "
                          "converts). Set mixed_precision bf16 in the launch config, or use recipes/fp8.py.")
    tp = config.get("tensor_parallel") or {}
    if int(tp.get("autotp_size", 1) or 1) > 1:
        raise LaunchError(f"tensor_parallel.autotp_size {tp['autotp_size']} in {where}: DeepSpeed's AutoTP is not "
                          "run by the ZeRO recipes (they shard data-parallel). Remove the block, or use "
                          "recipes/tensor_parallel.py for tensor parallelism.")
    if int(config.get("sequence_parallel_size", 1) or 1) > 1:
        raise LaunchError(f"sequence_parallel_size in {where}: the ZeRO recipes do not split sequences. Remove it, "
                          "or use recipes/sequence_parallel.py (DeepSpeed's Ulysses).")
    for block in ("amp", "torch_autocast"):
        if str((config.get(block) or {}).get("enabled", False)).lower() == "true":
            raise LaunchError(f'"{block}": {{"enabled": true}} in {where}: precision is set by --mixed_precision '
                              '(or the "fp16" / "bf16" blocks) here, which the loop and results.json follow. '
                              f'Remove the "{block}" block and pass --mixed_precision bf16 (or fp16 on a GPU).')
    if (config.get("optimizer") or {}).get("type", "").lower() in ("onebitadam", "zerooneadam", "onebitlamb"):
        raise LaunchError(f"optimizer {config['optimizer']['type']} in {where}: DeepSpeed's 1-bit optimizers need "
                          "NCCL or MPI compression backends these recipes do not set up. Use AdamW.")
    _check_json_optimizer(config, where)


# The kernel DeepSpeed builds each of its own optimizer types with (engine._configure_basic_optimizer), with the
# optimizer offloaded to the CPU and without; None: plain torch (or the import of a package).
_OPTIMIZER_OPS = {"adam": ("CPUAdamBuilder", None), "adamw": ("CPUAdamBuilder", None),
                  "adagrad": ("CPUAdagradBuilder", None), "lamb": ("FusedLambBuilder", "FusedLambBuilder"),
                  "lion": ("CPULionBuilder", "FusedLionBuilder")}
_ZERO_TESTED = ("adam", "adamw", "adagrad", "lion", "muon")  # what its classes are in ZERO_SUPPORTED_OPTIMIZERS


def _check_json_optimizer(config: dict, where: str) -> None:
    """The JSON's "optimizer" type as DeepSpeed builds it in prepare(): a kernel this machine lacks (Lamb on CPU:
    `ValueError: This op had not been implemented on CPU backend`), a torch.optim name under ZeRO without
    zero_allow_untested_optimizer (`AssertionError: You are using an untested ZeRO Optimizer`), a name neither
    DeepSpeed nor torch.optim has (AttributeError): each refused by name before any work."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    block = config.get("optimizer")
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        return
    name = block["type"]
    own = name.lower() in DEEPSPEED_OPTIMIZERS
    offload = _get(config, "zero_optimization.offload_optimizer")
    offload = isinstance(offload, dict) and str(offload.get("device")).lower() in ("cpu", "nvme")
    if own and name.lower() in _OPTIMIZER_OPS:
        op = _OPTIMIZER_OPS[name.lower()][0 if offload else 1]
        if op and type(get_accelerator().create_op_builder(op)).__name__ in ("NoneType", "NotImplementedBuilder"):
            raise LaunchError(f"optimizer {name} in {where}: DeepSpeed builds it with its {op} kernel, which has no "
                              f"{get_accelerator().device_name()} implementation here (prepare() would stop with "
                              "'This op had not been implemented'). Use AdamW, or remove the block to train with "
                              "the recipe's AdamW.")
    elif own and name.lower().startswith("mu") and name.lower() != "muon":
        import importlib.util

        if importlib.util.find_spec("mup") is None:
            raise LaunchError(f"optimizer {name} in {where}: DeepSpeed builds it from the mup package, which is not "
                              "installed. pip install mup, or use AdamW.")
    elif not own and not isinstance(getattr(torch.optim, name, None), type):
        raise LaunchError(f"optimizer {name} in {where}: not an optimizer DeepSpeed builds "
                          f"({', '.join(DEEPSPEED_OPTIMIZERS)}, any case) nor a class of torch.optim, where it looks "
                          "other names up (exact case: SGD, RMSprop). Fix the name, or remove the block.")
    stage = _get(config, "zero_optimization.stage")
    if own and name.lower() == "adagrad" and stage in (1, 2) and not offload:
        # torch.optim.Adagrad in ZeRO-1/2's flat partitions: IndexError in _get_flat_partition_unpadded at the first
        # backward (2 processes, DeepSpeed 0.19.8); DeepSpeedCPUAdagrad (offload) and ZeRO-3 ran.
        raise LaunchError(f"optimizer {name} in {where} under ZeRO stage {stage} without optimizer offload: "
                          "DeepSpeed's torch.optim.Adagrad stops in its first backward there (IndexError in "
                          "stage_1_and_2). Offload the optimizer (offload_optimizer device cpu: DeepSpeedCPUAdagrad), "
                          "run ZeRO stage 3, or use AdamW.")
    if (isinstance(stage, int) and stage > 0 and name.lower() not in _ZERO_TESTED
            and config.get("zero_allow_untested_optimizer") is not True):
        raise LaunchError(f"optimizer {name} in {where} under ZeRO stage {stage}: DeepSpeed runs only the optimizers "
                          "it has tested with ZeRO (Adam, AdamW, Adagrad, Lion) and stops in prepare() otherwise. Add "
                          '"zero_allow_untested_optimizer": true to the JSON to run it as it is, or use AdamW.')


# Where Accelerate fills an "auto" (DeepSpeedPlugin.__post_init__, Accelerator._prepare_deepspeed); any other "auto"
# made prepare() raise "`optimizer.params.betas` not found in kwargs" (or zero_optimization.sub_group_size ...).
FILLED_AT_PREPARE = frozenset((
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "zero_optimization.stage", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_param.device", "zero_optimization.offload_optimizer.nvme_path",
    "zero_optimization.offload_param.nvme_path", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "optimizer.params.lr", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps"))
ADAMW_CONSTANTS = {"betas": [0.9, 0.999], "eps": 1e-8}  # torch's AdamW defaults: the recipe's AdamW (core/optim.py)


def _autos(node: dict, prefix: str = "") -> list[str]:
    """The dotted paths of a config's "auto" values."""
    return [path for key, value in node.items() for path in (
        _autos(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"] if value == "auto" else [])]


def _fill_or_refuse_autos(config: dict, json_file: str | None) -> None:
    """AdamW's betas and eps left "auto" take the recipe's AdamW values (as Transformers' Trainer fills them from its
    own); any other "auto" that Accelerate does not fill is refused by name before anything loads."""
    params = (config.get("optimizer") or {}).get("params") or {}
    for key, value in ADAMW_CONSTANTS.items():
        if params.get(key) == "auto":
            params[key] = value
    if left := [path for path in _autos(config) if path not in FILLED_AT_PREPARE]:
        block = left[0].rpartition(".")[0]
        filled = sorted(k.rpartition(".")[2] for k in FILLED_AT_PREPARE if k.rpartition(".")[0] == block)
        raise LaunchError(f'{left[0]} is "auto" in the DeepSpeed JSON {json_file or ""}, and nothing fills it '
                          f"(Accelerate fills {block or 'the top level'}: {', '.join(filled) or 'nothing'}). Set it "
                          "to a value in the JSON.")


def json_optimizer_and_scheduler(ds_config: dict, launch: object, model: torch.nn.Module, max_steps: int
                                 ) -> tuple[object, object]:
    """The recipe's AdamW and schedule (shared/core/optim.py); where the DeepSpeed JSON has an "optimizer" or a
    "scheduler" block, that block runs instead, as DeepSpeed builds it: Accelerate's DummyOptim / DummyScheduler
    stand in until prepare(), which fills the block's "auto" values (--learning_rate, --weight_decay,
    --num_warmup_steps, the step count). Without this Accelerate refuses the JSON ("You cannot specify an optimizer
    in the config file and in the code")."""
    from accelerate.utils import DummyOptim, DummyScheduler

    from ..core.optim import flag_schedule, optimizer_and_scheduler

    optimizer, scheduler = optimizer_and_scheduler(launch, model, max_steps)
    if "optimizer" not in ds_config and "scheduler" not in ds_config:
        return optimizer, scheduler
    args = launch.args
    if "optimizer" in ds_config:
        # The JSON's weight decay on the weights; none on biases and norms, as the recipe's own AdamW.
        groups = [{"params": g["params"], **({"weight_decay": 0.0} if g["weight_decay"] == 0.0 else {})}
                  for g in optimizer.param_groups]
        optimizer = DummyOptim(groups, lr=launch.learning_rate, weight_decay=args.weight_decay)
    if "scheduler" in ds_config:
        # Accelerate divides the total by the process count (it counts batches over all processes).
        scheduler = DummyScheduler(optimizer, total_num_steps=max_steps * int(os.environ.get("WORLD_SIZE", "1")),
                                   warmup_num_steps=args.num_warmup_steps)
    elif isinstance(optimizer, DummyOptim):  # the JSON's optimizer with the recipe's schedule, built on it
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: flag_schedule(args, opt, max_steps))
    return optimizer, scheduler


def _check_async_io() -> None:
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().create_op_builder("AsyncIOBuilder").is_compatible(verbose=False):
        raise LaunchError("NVMe offload needs DeepSpeed's async_io op, which needs libaio: "
                          "`apt-get install libaio-dev` (Debian/Ubuntu) or `yum install libaio-devel`, then rerun.")


def patch_zero_step_to_count_states(meter, model: torch.nn.Module, optimizer: object) -> None:
    """Wrap ZeRO's optimizer step once, to give the meter parameter, gradient and optimizer-state bytes around it.

    ZeRO frees its gradient partitions inside step() (which `accelerator.backward` runs at the accumulation
    boundary), and creates the optimizer moments there, so the loop never sees all three alive: gradients are
    counted just before the first step, parameters and optimizer state just after (what the ZeRO paper's formula
    adds up), and handed to meter.set_states. The wrapper removes itself after that first step.
    """
    zero_optimizer = model.optimizer
    original = zero_optimizer.step

    def step(*a, **kw):
        zero_optimizer.step = original
        before = state_bytes(model, optimizer)
        out = original(*a, **kw)
        after = state_bytes(model, optimizer)
        inner = zero_optimizer.optimizer
        meter.set_states({**after, "grad_bytes": before["grad_bytes"]}, optimizer_state_devices=sorted(
            {str(t.device) for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)}))
        return out

    zero_optimizer.step = step


def schedule_the_optimizer_that_steps(model: torch.nn.Module, scheduler: object) -> None:
    """Point the LR scheduler at ZeRO's optimizer, whose param_groups are always those of the optimizer that steps.

    With offload, Accelerate swaps the recipe's AdamW for DeepSpeedCPUAdam, which shares AdamW's param-group dicts,
    so the scheduler (built on AdamW) still reaches it. Loading a checkpoint replaces those dicts: after a resume the
    scheduler wrote to the old ones and the learning rate froze at its checkpointed value (measured: a ZeRO-2 +
    offload run resumed at step 3 of 6 ended 5e-4 away from the uninterrupted one).
    """
    for sched in (getattr(scheduler, "scheduler", scheduler), getattr(model, "lr_scheduler", None)):
        if sched is not None and hasattr(sched, "optimizer"):
            sched.optimizer = model.optimizer


def load_universal_checkpoints(accelerator, model: torch.nn.Module) -> None:
    """Make load_state load a ZeRO checkpoint that shared/tools/reshard.py converted to DeepSpeed's universal form
    (one file per parameter, on any process count), and refuse a plain one of another process count with that fix.
    In DeepSpeedEngine.load_checkpoint itself: Accelerate runs its load hooks only after the engine has loaded."""
    load = model.load_checkpoint

    def load_checkpoint(load_dir: str, tag: str | None = None, **kwargs: object) -> object:
        zero = Path(load_dir) / str(tag)
        universal, saved = (zero / "zero").is_dir(), len(list(zero.glob("*optim_states.pt")))
        model._config.load_universal_checkpoint = universal  # the config's checkpoint.load_universal
        if not universal and saved != accelerator.num_processes:
            raise LaunchError(f"{load_dir} holds the ZeRO slices of {saved} processes, and this run has "
                              f"{accelerator.num_processes}. Convert it to DeepSpeed's universal checkpoint, which "
                              f"loads on any process count: python -m shared.tools.reshard {load_dir}, then resume "
                              f"from {load_dir}_universal (docs/resharding.md).")
        return load(load_dir, tag, **kwargs)

    model.load_checkpoint = load_checkpoint


def deepspeed_summary(accelerator, model: torch.nn.Module) -> dict[str, object]:
    """What DeepSpeed really ran with, for results.json; the resolved config is logged on the main process. With
    NVMe offload, the swap files this run wrote are removed when each process exits (remove_swap_files)."""
    config = accelerator.deepspeed_config  # after prepare(): every "auto" filled
    zero = config.get("zero_optimization", {})
    logger.info("resolved DeepSpeed config:\n%s", json.dumps(config, indent=1, default=str))
    swap = {Path(block["nvme_path"]) / "zero_stage_3" for block in (zero.get("offload_param"), zero.get(
        "offload_optimizer")) if block and block.get("device") == "nvme" and block.get("nvme_path")}
    if swap:  # DeepSpeed leaves its swap files behind (368 MB from one small ZeRO-3 run): gone when the run ends
        atexit.register(remove_swap_files, sorted(swap), accelerator.process_index)
    return {
        "zero_stage": model.zero_optimization_stage(),
        "offload_optimizer_device": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_param_device": (zero.get("offload_param") or {}).get("device", "none"),
        "param_device": str(accelerator.device),
        "deepspeed_gradient_accumulation_steps": model.gradient_accumulation_steps(),
        "deepspeed_gradient_clipping": model.gradient_clipping(),
        "deepspeed_micro_batch_size": model.train_micro_batch_size_per_gpu(),
        "deepspeed_bf16": model.bfloat16_enabled(),
        "deepspeed_fp16": model.fp16_enabled(),
        # The JSON's optimizer and scheduler where it has them (json_optimizer_and_scheduler), else the recipe's.
        "deepspeed_optimizer": (config.get("optimizer") or {}).get("type", "the recipe's AdamW"),
        "deepspeed_scheduler": (config.get("scheduler") or {}).get("type", "the recipe's (lr_scheduler says which)"),
        "deepspeed_settings_from": config.get(SOURCES, {}),
    }


def remove_swap_files(swap_dirs: list[Path], rank: int) -> None:
    """The swap folders DeepSpeed made for this process (DIR/zero_stage_3/{optimizer,<dtype>params}/rank<N>: its own,
    cleared or rewritten when a run starts), then the folders above them where empty (the last process to end
    removes them). Nothing else in the NVMe directory is touched."""
    for base in swap_dirs:
        mine = sorted(base.glob(f"*/rank{rank}"))
        files = [f for d in mine for f in d.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        for d in mine:
            shutil.rmtree(d, ignore_errors=True)
        for d in [*(d.parent for d in mine), base]:
            with contextlib.suppress(OSError):  # not empty: another process's files, or not DeepSpeed's
                d.rmdir()
        if files:
            logger.info("removed the %d NVMe swap files (%.1f MiB) this process's DeepSpeed wrote under %s",
                        len(files), size / 2**20, base)


def gathered_parameters(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """A context in which a ZeRO-3 model's parameters are whole on every process (a collective: all must enter).

    Why: under ZeRO-3 transformers builds even a preset model partitioned (size-0 tensors on each process), and
    save_pretrained would write those. Elsewhere: nothing happens.
    """
    if not any(hasattr(p, "ds_id") for p in model.parameters()):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def deepspeed_sharding(ds_config: dict) -> tuple[str, str]:
    """(sharding, offload) of a resolved DeepSpeed config."""
    zero = ds_config.get("zero_optimization", {})
    return f"zero{zero.get('stage', 0)}", rules.zero_offload(zero)


def agreed(ds_config: dict, batch: int, accumulation: int, clipping: float, learning_rate: float
           ) -> tuple[str, str, str, int, int, float, float, str | None]:
    """What resolve_launch runs with under a resolved config (resolve_deepspeed_config): its sharding and offload, the
    precision, micro-batch, accumulation, clipping and learning rate every source agreed on (the values given where
    the config leaves one out), and where the precision came from, for the rule table's messages."""
    precision = "fp16" if ds_config["fp16"]["enabled"] else "bf16" if ds_config["bf16"]["enabled"] else "no"
    stated_lr = (ds_config.get("optimizer") or {}).get("params", {}).get("lr", "auto")
    return (*deepspeed_sharding(ds_config), precision,
            int(ds_config.get("train_micro_batch_size_per_gpu", batch)),
            int(ds_config.get("gradient_accumulation_steps", accumulation)),
            float(ds_config.get("gradient_clipping", clipping)),
            learning_rate if stated_lr == "auto" else float(stated_lr),  # the JSON's optimizer runs
            ds_config.get(SOURCES, {}).get("mixed_precision"))


def check_installed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise LaunchError("This run uses DeepSpeed, which is not installed. "
                          "`pip install -r requirements.txt` (deepspeed==0.19.8).") from None


def configure_process() -> None:
    """One process without a launcher (plain `accelerate launch` or `python`): DeepSpeed still needs a process group,
    and Accelerate only creates one when the launcher's variables are set."""
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RECIPES_OWN_RENDEZVOUS="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))


@dataclass(frozen=True)
class Steps:
    """What the spine runs for a DeepSpeed launch: resolve_launch reads the agreed settings of the recipe's resolved
    config and checks that DeepSpeed is installed, configure_process gives a lone process its rendezvous."""

    agreed: Callable[[dict, int, int, float, float], tuple[str, str, str, int, int, float, float, str | None]]
    check_installed: Callable[[], None]
    configure_process: Callable[[], None]


STEPS = Steps(agreed=agreed, check_installed=check_installed, configure_process=configure_process)

_ZERO = ("zero1", "zero2", "zero3")
RULES = (
    Rule(lambda r: r.sharding in ("zero1", "zero2") and r.offload == "nvme",
         # DeepSpeed 0.19's stage 1/2 optimizer treats any offload device as CPU memory: nothing would reach NVMe.
         lambda r: f"optimizer offload to nvme under ZeRO stage {r.sharding[-1]}: stages 1 and 2 keep offloaded "
                   "optimizer state in CPU memory whatever the device says",
         lambda r: "use ZeRO-3 for NVMe offload (accelerate_configs/zero3_nvme.yaml), or offload to cpu"),
    # One rule whichever source asked for fp16: the fix names that source (run.flags["precision"]: a DeepSpeed
    # JSON's fp16 block, through resolve_launch, is changed in the JSON, not by a flag that would then disagree).
    Rule(lambda r: r.sharding.startswith("zero") and r.precision == "fp16" and not r.on_accelerator,
         lambda r: f"fp16 ({r.flags.get('precision', '--mixed_precision fp16')}) under DeepSpeed needs a GPU: on "
                   "CPU DeepSpeed refuses it ('Type fp16 is not supported on your device')",
         lambda r: ('set "fp16": {"enabled": "auto"} (or false) in the DeepSpeed JSON, then --mixed_precision bf16 '
                    "or no" if "DeepSpeed JSON" in r.flags.get("precision", "") else
                    "use --mixed_precision bf16 (or no)")),
    # DeepSpeed's ZeRO optimizers keep fp32 partitions of 16-bit weights (measured: bf16 weights, fp32 masters and
    # moments): pure bf16 would not be what ran.
    Rule(lambda r: r.weights == "bf16" and r.sharding in _ZERO,
         lambda r: f"--weights_dtype bf16 (pure bf16) under {launch_words(r)}: it keeps fp32 master weights of its "
                   "own, so the weights would not train in bf16",
         lambda r: "pass --weights_dtype fp32 (fp32 masters, which this sharding keeps anyway)"),
)
rules.register(*RULES)
