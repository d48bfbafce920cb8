"""Build the Accelerator. Each launch snag of this stack is handled here, once, with the reason beside it."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed

logger = logging.getLogger("recipes")


def has_accelerator() -> bool:
    return torch.accelerator.is_available()


def launched_world_size() -> int:
    """Processes started by `accelerate launch` / torchrun (1 under plain `python`)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def resolve_mixed_precision(args: argparse.Namespace, recipe_default: str) -> str:
    """The flag wins, then the accelerate config (which `accelerate launch` passes as an env var), then the recipe."""
    if args.mixed_precision:
        return args.mixed_precision
    from_config = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return from_config if from_config != "no" else recipe_default


def build_accelerator(
    args: argparse.Namespace,
    recipe: str,
    default_mixed_precision: str = "no",
    **accelerator_kwargs: object,
) -> Accelerator:
    """An Accelerator that really does what the launch config asks, on GPUs and on CPU-only machines alike.

    Fills args.output_dir and args.mixed_precision with the resolved values. Extra keyword arguments go to the
    Accelerator (a recipe passes its DeepSpeed or FSDP plugin this way, in plain sight).
    """
    args.output_dir = args.output_dir or str(Path("outputs") / f"{recipe}-{args.task}")
    args.mixed_precision = resolve_mixed_precision(args, default_mixed_precision)
    world = launched_world_size()
    on_cpu = not has_accelerator()

    # Two processes on two cores with torch's default thread count oversubscribe the CPU: a 3 s run took 83 s.
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    kwargs_handlers = list(accelerator_kwargs.pop("kwargs_handlers", []))
    uses_deepspeed = _env_true("ACCELERATE_USE_DEEPSPEED") or "deepspeed_plugin" in accelerator_kwargs
    uses_fsdp = _env_true("ACCELERATE_USE_FSDP") or "fsdp_plugin" in accelerator_kwargs
    cpu = False
    if uses_deepspeed and "LOCAL_RANK" not in os.environ:
        # One process without a launcher (plain `accelerate launch` or `python`): DeepSpeed still needs a process
        # group, and Accelerate only creates one when the launcher's variables are set.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(_free_port())))
    if on_cpu and uses_deepspeed:
        # Without GPUs Accelerate counts one process under DeepSpeed unless the process group is gloo.
        kwargs_handlers.append(InitProcessGroupKwargs(backend="gloo"))
    elif on_cpu and world > 1:
        if uses_fsdp:
            # On CPU Accelerate never enables FSDP: the replicas would train unsynced. Refuse rather than pretend.
            raise SystemExit(
                "FSDP on a CPU-only machine is not enabled by Accelerate (the replicas would train unsynced). "
                "Use recipes/fsdp.py, which handles it, or run on GPUs."
            )
        else:
            # A MULTI_GPU config with `use_cpu: true` gives real gloo DDP only with cpu=True in the script;
            # without it every process reports DistributedType.NO and trains its own unsynced copy.
            cpu = True

    if args.report_to in ("none", "", None):
        log_with = None
    else:
        log_with = [t.strip() for t in args.report_to.split(",") if t.strip()]
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=args.mixed_precision,
        # Sync every k-th micro-batch, counted across epoch ends: the recipes draw whole windows of k batches from
        # an endless iterator, and Accelerate's default (also sync at the end of a dataloader) would step the
        # optimizer mid-window and shift every later window.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        log_with=log_with,
        project_dir=args.output_dir,
        # The scheduler is stepped once per optimizer step, in the recipe. Left to Accelerate, it steps
        # num_processes times per optimizer step.
        step_scheduler_with_optimizer=False,
        # Shuffling seeded by (seed, epoch): a resumed run sees the same batches as an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=kwargs_handlers,
        **accelerator_kwargs,
    )
    if accelerator.num_processes != world:
        raise SystemExit(
            f"{world} processes were launched but Accelerate sees {accelerator.num_processes} "
            f"(distributed_type={accelerator.distributed_type}): the processes would train unsynced copies. "
            "On a CPU-only machine use accelerate_configs/multi_cpu.yaml (MULTI_GPU with use_cpu: true)."
        )
    if uses_deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        # `use_cpu: true` in the accelerate config turns DeepSpeed off: the run would not be the one asked for.
        raise SystemExit(
            f"This recipe runs DeepSpeed, but Accelerate resolved distributed_type={accelerator.distributed_type}. "
            "Use a DeepSpeed accelerate config (accelerate_configs/zero*.yaml, `use_cpu: false`) or none."
        )
    if (
        accelerator.mixed_precision == "fp16"
        and accelerator.device.type == "cpu"
        and accelerator.distributed_type != DistributedType.DEEPSPEED
    ):
        _enable_cpu_fp16(accelerator)

    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if accelerator.is_main_process else logging.WARNING,
    )
    set_seed(args.seed)
    if log_with:
        config = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in vars(args).items()}
        accelerator.init_trackers(recipe, config=config)
    logger.info(
        "%s: task=%s distributed_type=%s processes=%d device=%s mixed_precision=%s output_dir=%s",
        recipe, args.task, accelerator.distributed_type.value, accelerator.num_processes,
        accelerator.device, accelerator.mixed_precision, args.output_dir,
    )
    return accelerator


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enable_cpu_fp16(accelerator: Accelerator) -> None:
    # Accelerate leaves fp16 on CPU silently fp32 (no autocast, no scaler): the losses are bit-identical to fp32.
    # torch's CPU fp16 autocast and GradScaler("cpu") do work (overflow skips and back-off observed), so we turn
    # on what Accelerate does on GPUs. It must happen before prepare(): prepare_model wraps forward in autocast
    # when native_amp is set, and prepare_optimizer hands the scaler to the optimizer wrapper.
    accelerator.native_amp = True
    kwargs = accelerator.scaler_handler.to_kwargs() if accelerator.scaler_handler is not None else {}
    accelerator.scaler = torch.amp.GradScaler("cpu", **kwargs)
