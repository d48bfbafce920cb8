"""FSDP as the launch config asks for it: each `fsdp_*` setting honoured or refused, never silently replaced; the
model's blocks as the FSDP units; and FSDP2 through Accelerate on a machine without GPUs.

A recipe that runs FSDP hands the spine these steps in its SUPPORT (`Support(..., fsdp=fsdp_launch.STEPS)`); a recipe
that never does carries none of it, and the rule table refuses its FSDP launch."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from ..core.errors import LaunchError

logger = logging.getLogger("recipes")

_FROM = "fsdp_{} in the launch config"
# FSDP1's sharding strategies, as FSDP2 spells them (or the recipe that runs them).
_RESHARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
_ELSEWHERE = {"NO_SHARD": "nothing sharded is DDP: recipes/data_parallel.py with accelerate_configs/multi_cpu.yaml",
              "HYBRID_SHARD": "sharded in a node, replicated across nodes is HSDP: recipes/fsdp.py "
                              "--dp_replicate_size R",
              "_HYBRID_SHARD_ZERO2": "HSDP: recipes/fsdp.py --dp_replicate_size R, fsdp_reshard_after_forward: false"}
_FSDP1_ONLY = ("FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES")  # FSDP2 always does what these ask for
# Each FSDP_* variable `accelerate launch` sets from the config (accelerate/utils/launch.py), and what happens to it.
_KNOWN = {"FSDP_VERSION", "FSDP_SHARDING_STRATEGY", "FSDP_RESHARD_AFTER_FORWARD", "FSDP_OFFLOAD_PARAMS",
          "FSDP_MIN_NUM_PARAMS", "FSDP_AUTO_WRAP_POLICY", "FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_BACKWARD_PREFETCH",
          "FSDP_STATE_DICT_TYPE", "FSDP_FORWARD_PREFETCH", "FSDP_CPU_RAM_EFFICIENT_LOADING",
          "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", *_FSDP1_ONLY}


def _true(value: str | None) -> bool:
    return str(value).lower() in ("1", "true", "yes")


def launch_fsdp_settings(env: Mapping[str, str] = os.environ) -> dict[str, tuple[object, str]]:
    """The launch config's FSDP settings as FSDP2 plugin fields, each with where it came from: {} when the launch
    did not ask for FSDP. What these recipes cannot run as written is refused here, before anything loads, with
    the setting and the fix; nothing is dropped. Accelerate itself reads the same variables when it builds the
    plugin; this is the check that they mean the same thing under FSDP2."""
    if not _true(env.get("ACCELERATE_USE_FSDP")):
        return {}
    if unknown := sorted(k for k in env if k.startswith("FSDP_") and k not in _KNOWN):
        raise LaunchError(f"{', '.join(unknown)} (from the launch config or the shell): FSDP settings these recipes "
                          "neither run nor check. Remove them (unset them in the shell).")
    version = env.get("FSDP_VERSION", "1")  # `accelerate launch`'s default when the config has no fsdp_version
    strategy = env.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if version != "2":
        raise LaunchError(
            f"fsdp_version: {version} in the launch config (1 when it says none): these recipes run FSDP2 "
            "(torch's fully_shard; FSDP1 is deprecated in torch and Accelerate, and on CPU it crashes saving). Set "
            "fsdp_version: 2 and write FSDP1's fsdp_sharding_strategy as fsdp_reshard_after_forward (FULL_SHARD: "
            "true, SHARD_GRAD_OP: false); remove fsdp_backward_prefetch, fsdp_forward_prefetch, "
            "fsdp_use_orig_params and fsdp_sync_module_states, which FSDP2 does not take "
            "(accelerate_configs/fsdp.yaml is an FSDP2 config).")
    settings: dict[str, tuple[object, str]] = {"fsdp_version": (2, _FROM.format("version"))}
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD", "true").upper()
    if strategy in _ELSEWHERE or reshard in _ELSEWHERE:
        key, value = ("sharding_strategy", strategy) if strategy in _ELSEWHERE else ("reshard_after_forward", reshard)
        raise LaunchError(f"fsdp_{key}: {value} in the launch config: not a sharding FSDP2 runs here; "
                          f"{_ELSEWHERE[value]}.")
    if reshard in _RESHARD:  # FSDP1's name in FSDP2's key: what it says, said the FSDP2 way
        settings["reshard_after_forward"] = (_RESHARD[reshard], _FROM.format(f"reshard_after_forward: {reshard}"))
    elif reshard in ("TRUE", "FALSE"):
        settings["reshard_after_forward"] = (reshard == "TRUE", _FROM.format("reshard_after_forward"))
    else:
        raise LaunchError(f"fsdp_reshard_after_forward: {reshard.lower()} in the launch config: write true (full "
                          "shard) or false (parameters stay gathered between forward and backward, like ZeRO-2).")
    if strategy != "FULL_SHARD":  # FSDP1's key, which Accelerate ignores under FSDP2: said as FSDP2 says it
        if reshard != "TRUE" and settings["reshard_after_forward"][0] != _RESHARD[strategy]:  # "true": the default
            raise LaunchError(f"fsdp_sharding_strategy: {strategy} and fsdp_reshard_after_forward: {reshard.lower()} "
                              "in the launch config disagree. Keep fsdp_reshard_after_forward (FSDP2's key) only.")
        settings["reshard_after_forward"] = (_RESHARD[strategy], _FROM.format(f"sharding_strategy: {strategy}"))
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise LaunchError(f"fsdp_auto_wrap_policy: {policy} in the launch config: these recipes shard one unit per "
                          "transformer block (their memory figures and checkpoints assume it). Set "
                          "TRANSFORMER_BASED_WRAP; fsdp_transformer_layer_cls_to_wrap names the block if you want "
                          "another one.")
    prefetch = env.get("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE").upper()
    if prefetch != "BACKWARD_PRE":  # FSDP2 always prefetches the next block's gather in backward
        raise LaunchError(f"fsdp_backward_prefetch: {prefetch} in the launch config: FSDP2 always prefetches as "
                          "BACKWARD_PRE does and cannot be told otherwise. Remove the setting.")
    if _true(env.get("FSDP_FORWARD_PREFETCH")):
        raise LaunchError("fsdp_forward_prefetch: true in the launch config: FSDP2 in Accelerate does not implement "
                          "it. Remove the setting (or set it false).")
    if state_dict := env.get("FSDP_STATE_DICT_TYPE"):
        settings["state_dict_type"] = (state_dict.upper(), _FROM.format("state_dict_type"))
    for key in ("offload_params", "cpu_ram_efficient_loading", "activation_checkpointing",
                "activation_checkpointing_offload"):
        if (value := env.get(f"FSDP_{key.upper()}")) is not None:
            field = "cpu_offload" if key == "offload_params" else key
            settings[field] = (_true(value), _FROM.format(key))
    if names := env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        settings["transformer_cls_names_to_wrap"] = (names.split(","), _FROM.format("transformer_layer_cls_to_wrap"))
    return settings


def fsdp_plugin_kwargs(args: object, launched: dict[str, tuple[object, str]], **recipe: object) -> dict[str, object]:
    """A recipe's FSDP2 plugin settings with the launch config's (`launched`: launch_fsdp_settings(), each one
    honoured, or refused there) laid over them, and a flag the recipe has for one of them: they must agree. Logged
    with their sources."""
    chosen = {name: (value, "the recipe") for name, value in recipe.items() if value is not None}
    flags = {"cpu_offload": "--cpu_offload"}
    for name, (value, source) in launched.items():
        flag = flags.get(name)
        if not (flag and flag.lstrip("-") in getattr(args, "explicit_flags", set())):
            chosen[name] = (value, source)
        elif recipe.get(name) != value:
            raise LaunchError(f"{flag} {recipe.get(name)} and {source} ({value}) disagree. Set it in one place.")
    if os.environ.get("RANK", "0") == "0":
        logger.info("FSDP settings: %s", "; ".join(f"{k}={v} (from {s})" for k, (v, s) in chosen.items()))
    return {name: value for name, (value, _) in chosen.items()}


def launch_plugin(args: object) -> FullyShardedDataParallelPlugin:
    """The plugin of a recipe that takes its FSDP settings from the launch config alone (resolve_launch, once the
    rule table let the FSDP launch through)."""
    return FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(args, launch_fsdp_settings()))


def wrap_blocks(accelerator: Accelerator, model: object, layers: Callable[[object], list]) -> None:
    """One FSDP unit per transformer block. Accelerate's default, the model's _no_split_modules, also wraps BERT's
    embeddings, whose parameters fully_shard then meets twice and crashes on (TypeError: Invariant encountered).
    A class the launch config names (fsdp_transformer_layer_cls_to_wrap) is used, or refused if the model has none."""
    if accelerator.distributed_type != DistributedType.FSDP:
        return
    plugin, blocks = accelerator.state.fsdp_plugin, layers(model)
    present = {type(m).__name__ for m in model.modules()}
    if names := plugin.transformer_cls_names_to_wrap:
        if missing := [n for n in names if n not in present]:
            block = type(blocks[0]).__name__ if blocks else "its block class"
            raise LaunchError(f"fsdp_transformer_layer_cls_to_wrap {missing} in the launch config: the model has no "
                              f"such module. Its blocks are {block}: set that, or remove the setting.")
        return
    if blocks:
        plugin.transformer_cls_names_to_wrap = [type(blocks[0]).__name__]


def force_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Turn a gloo-backed Accelerator (distributed_type NO, N processes) into a real FSDP2 one.

    Why: Accelerate resolves FSDP only from a GPU distributed type, so on CPU an `FSDP` config runs every process
    as an unsynced full replica. Forcing the type makes prepare() call fully_shard over the gloo group (measured:
    losses match DDP). Accelerate 1.15, torch 2.13.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()  # from the FSDP_* launch env
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        # The default policy pins host memory, which needs a GPU: offload then fails on a CPU-only machine.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    if accelerator.mixed_precision != "no":
        # Accelerate sets the FSDP mixed-precision policy only on its GPU path; unset, bf16 would silently be fp32.
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@dataclass(frozen=True)
class Steps:
    """What the spine runs for an FSDP launch: resolve_launch builds the checked plugin, start_run forces FSDP2 on a
    CPU-only machine, load_task makes each block an FSDP unit."""

    plugin: Callable[[object], FullyShardedDataParallelPlugin]
    force_on_cpu: Callable[[Accelerator, FullyShardedDataParallelPlugin | None], None]
    wrap_blocks: Callable[[Accelerator, object, Callable[[object], list]], None]


STEPS = Steps(plugin=launch_plugin, force_on_cpu=force_fsdp_on_cpu, wrap_blocks=wrap_blocks)
