"""Build the Accelerator. Each launch snag of this stack is handled here, once, with the reason beside it."""

from __future__ import annotations

import argparse
import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs, set_seed

from .checkpoint import install_preemption_handler
from .fsdp_cpu import force_fsdp_on_cpu
from .preflight import check_environment

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
    accumulates: bool = False,
    **accelerator_kwargs: object,
) -> Accelerator:
    """An Accelerator that really does what the launch config asks, on GPUs and on CPU-only machines alike.

    Fills args.recipe, args.output_dir and args.mixed_precision with the resolved values. `accumulates`: the
    recipe's loop uses accelerator.accumulate; other recipes refuse --gradient_accumulation_steps > 1, since
    Accelerate would still divide every loss by it. Extra keyword arguments go to the Accelerator (a recipe passes
    its DeepSpeed or FSDP plugin this way, in plain sight).
    """
    if args.gradient_accumulation_steps > 1 and not accumulates:
        raise SystemExit(f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: recipes/{recipe}.py does "
                         "not accumulate gradients. Use recipes/gradient_accumulation.py, or drop the flag.")
    args.recipe = recipe
    args.output_dir = args.output_dir or str(Path("outputs") / f"{recipe}-{args.task}")
    args.mixed_precision = resolve_mixed_precision(args, default_mixed_precision)
    world = launched_world_size()
    on_cpu = not has_accelerator()

    # Two processes on two cores with torch's default thread count oversubscribe the CPU: a 3 s run took 83 s.
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    kwargs_handlers = list(accelerator_kwargs.pop("kwargs_handlers", []))
    # A process that dies or hangs makes the others fail after this long instead of waiting forever.
    process_group = InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout))
    kwargs_handlers.append(process_group)
    uses_deepspeed = _env_true("ACCELERATE_USE_DEEPSPEED") or "deepspeed_plugin" in accelerator_kwargs
    uses_fsdp = _env_true("ACCELERATE_USE_FSDP") or "fsdp_plugin" in accelerator_kwargs
    check_environment(args, uses_deepspeed)
    cpu = False
    if uses_deepspeed and "LOCAL_RANK" not in os.environ:
        # One process without a launcher (plain `accelerate launch` or `python`): DeepSpeed still needs a process
        # group, and Accelerate only creates one when the launcher's variables are set.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    if on_cpu and uses_deepspeed:
        # Without GPUs Accelerate counts one process under DeepSpeed unless the process group is gloo.
        process_group.backend = "gloo"
    elif on_cpu and world > 1:
        if uses_fsdp:
            # Accelerate never enables FSDP without GPUs (the replicas would train unsynced): start a gloo group
            # here and force FSDP2 once the Accelerator exists (shared/fsdp_cpu.py).
            process_group.backend = "gloo"
        else:
            # A MULTI_GPU config with `use_cpu: true` gives real gloo DDP only with cpu=True in the script;
            # without it every process reports DistributedType.NO and trains its own unsynced copy.
            cpu = True

    log_with = _trackers(args.report_to)
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
    if on_cpu and world > 1 and uses_fsdp and not uses_deepspeed:
        force_fsdp_on_cpu(accelerator, accelerator_kwargs.get("fsdp_plugin"))
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

    install_preemption_handler()
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


def _trackers(report_to: str | None) -> list[str] | None:
    """The trackers named by --report_to; Accelerate would drop a missing one with a mere warning."""
    if report_to in ("none", "", None):
        return None
    from accelerate.tracking import _available_trackers

    names = [t.strip() for t in report_to.split(",") if t.strip()]
    available = {str(t.value) for t in _available_trackers}
    missing = [n for n in names if n != "all" and n not in available]
    if missing:
        raise SystemExit(f"--report_to {','.join(missing)}: not installed. `pip install {' '.join(missing)}`, "
                         f"or pick from the installed trackers {sorted(available)} or 'none'.")
    return names


def free_port() -> int:
    """A TCP port nothing listens on now, for a process group's rendezvous."""
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
