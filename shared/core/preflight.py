"""--preflight: the run as resolved (every start-up check run, data and model loaded and prepared, DeepSpeed's "auto"
values filled), printed and saved to preflight.json, stopped before the first step. The planner's memory estimate
is the repository's tool, never on the training path: `python -m shared.tools.preflight` runs this and adds it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .measure import stepping_optimizer
from .results import end_run
from .rules import offload_of, offload_params_of, sharding_of

if TYPE_CHECKING:
    from .launch import Launch

REPORT_LINE = "preflight report:"  # the report's last line names its file (shared/tools/preflight.py reads it)


def stop_if_preflight(accelerator, launch: Launch, task, model, optimizer: object | None,
                      max_steps: int | None = None) -> None:
    """With --preflight: report the resolved run and end it before its first step. Otherwise nothing.

    Called by the recipe after prepare() (DeepSpeed fills its "auto" values there) and resume() (a checkpoint that
    cannot be loaded is refused by the preflight too).
    """
    if launch.args.preflight:
        report(accelerator, launch, task, model, optimizer, max_steps)


def _available_bytes(accelerator) -> int:
    if accelerator.device.type == "cuda":
        return int(torch.cuda.mem_get_info(accelerator.device)[0])
    import psutil

    return int(psutil.virtual_memory().available // accelerator.num_processes)


def report(accelerator, launch: Launch, task, model, optimizer, max_steps: int | None = None) -> None:
    """Print and save the resolved configuration, then end the run before its first step (exit code 0)."""
    args, recipe = launch.args, launch.recipe
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ds_config = getattr(getattr(accelerator.state, "deepspeed_plugin", None), "deepspeed_config", None)
    resolved = {
        "recipe": recipe,
        "task": args.task,
        "model": task.model_id,
        "data": task.data_source,
        "train_examples": len(task.train_dataloader.dataset),
        "distributed_type": accelerator.distributed_type.value,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "fp16_path": ("torch CPU autocast + GradScaler" if accelerator.mixed_precision == "fp16"
                      and accelerator.device.type == "cpu" and accelerator.scaler is not None else None),
        "gradient_accumulation_steps": launch.gradient_accumulation_steps,
        "per_device_train_batch_size": launch.per_device_train_batch_size,
        # (sequence parallel: the processes split each sequence, not the samples)
        "global_batch_size": launch.per_device_train_batch_size * launch.gradient_accumulation_steps
        * (1 if launch.run.support.splits_sequence else accelerator.num_processes),
        "max_train_steps": max_steps,
        "learning_rate": launch.learning_rate,
        "optimizer": None if optimizer is None else type(stepping_optimizer(optimizer)).__name__,  # None: PTQ
        "trainable_parameters_this_process": trainable,
        "deepspeed_config": ds_config,
        "fsdp_plugin": repr(getattr(accelerator.state, "fsdp_plugin", None)),
        # What the planner's estimate needs (shared/tools/preflight.py): the run as launched, and this machine.
        "sharding": sharding_of(accelerator),
        "offload": offload_of(accelerator),
        "offload_params": offload_params_of(accelerator),
        "flags": {**vars(args), **launch.resolved()},
        # (a pipeline stage has no config of its own: the whole model's)
        "model_config": getattr(accelerator.unwrap_model(model, keep_torch_compile=False), "config",
                                task.model.config).to_dict(),
        "available_bytes_per_process": _available_bytes(accelerator),
    }
    if accelerator.is_main_process:
        out = Path(launch.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "preflight.json"
        path.write_text(json.dumps(resolved, indent=2, default=str))
        print(json.dumps({k: v for k, v in resolved.items() if k not in ("flags", "model_config")}, indent=2,
                         default=str))
        print(f"{REPORT_LINE} {path.resolve()}", flush=True)
    accelerator.wait_for_everyone()
    end_run(accelerator)  # the same exit as a finished run (a gloo exit deadlock otherwise)
    raise SystemExit(0)  # --preflight asked for the report alone: a clean exit, not an error
