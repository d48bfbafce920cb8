"""DeepSpeed ZeRO for the recipes: one resolved config, conflicts stopped before training, state counted right.

A setting can come from four places: the recipe's own defaults, a flag on the command line, the accelerate config
(`accelerate launch` turns its YAML into ACCELERATE_* environment variables) and a DeepSpeed JSON. Left alone they
disagree silently: Accelerate warns and takes DeepSpeed's accumulation steps, fills an "auto" clipping with 1.0
whatever --max_grad_norm says, and drops the YAML's NVMe paths. Here every value the user set explicitly must agree;
the agreed value (or the recipe's default) is written into the config AND back into args, so the Accelerator,
the training loop and DeepSpeed all run on the same numbers.
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
from pathlib import Path

import torch

from ..core.errors import LaunchError
from ..core.measure import state_bytes

logger = logging.getLogger("recipes")

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
}
_TRAINING = ("gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu", "mixed_precision")
_FLAG_TYPES = {"max_grad_norm": float, "gradient_accumulation_steps": int, "per_device_train_batch_size": int}


def add_deepspeed_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--deepspeed_config", default=None,
                       help="A DeepSpeed JSON; overrides the recipe's settings. Values set to \"auto\" are filled "
                            "from the flags; explicit values must agree with the flags and the accelerate config.")
    group.add_argument("--nvme_path", default=None,
                       help="Directory for NVMe offload (swap files go there; removed when the run ends).")


def _get(config: dict, key: str) -> object:
    node: object = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, key: str, value: object) -> None:
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _normalize(key: str, value: object) -> object:
    if value is None or value == "auto":
        return None
    if key in ("gradient_clipping",):
        return float(value)
    if key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "zero_optimization.stage"):
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


def launched_deepspeed_config(args: argparse.Namespace) -> dict | None:
    """For recipes whose launch config picks the sharding: the DeepSpeed settings when it chose DeepSpeed (stage and
    offload from it), resolved and checked as recipes/zero.py's; None when it chose anything else."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    return resolve_deepspeed_config(args, zero_config(int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 2))))


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
    if json_file:
        if not Path(json_file).is_file():
            raise LaunchError(f"DeepSpeed JSON {json_file!r} does not exist. Pass an existing file.")
        user_json = json.loads(Path(json_file).read_text())
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
        else:
            _set(config, key, _FLAG_TYPES.get(SETTINGS[key][0], lambda v: v)(value))
    for key in ("train_batch_size",):  # a global batch stated in the JSON must agree with the resolved pieces
        stated = _normalize("gradient_accumulation_steps", config.get(key))
        if stated is not None:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            micro, accumulation = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
            product = micro * accumulation * world
            if stated != product:
                raise LaunchError(f"train_batch_size {stated} in the DeepSpeed JSON {json_file} != micro-batch "
                                  f"{micro} x accumulation {accumulation} x {world} processes = {product}. "
                                  "Set it to \"auto\".")

    zero = config.setdefault("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise LaunchError(f"ZeRO stage {stage}: these recipes run stage 1, 2 or 3.")
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
        zero["stage3_gather_16bit_weights_on_model_save"] = True

    # Accelerate refuses a config dict beside YAML DeepSpeed fields ("will be ignored"): they were merged and
    # checked against each other above, so that refusal no longer applies.
    os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
    logger.info("DeepSpeed settings: %s", "; ".join(f"{k}={v} (from {s})" for k, (v, s) in chosen.items()))
    return config


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
