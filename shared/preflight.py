"""Preflight: the effective configuration of a run, checked against this machine, without training.

    python -m shared.preflight [--config_file accelerate_configs/X.yaml] recipes/Y.py [recipe args]

It launches the recipe as `accelerate launch` would, with --preflight: the recipe parses its flags, builds the
Accelerator (every start-up check of shared/launch.py runs), loads data and model, and prepares them (DeepSpeed
fills its "auto" values there), then prints the resolved configuration and the planner's memory estimate against
the memory available, writes preflight.json in the output directory, and stops before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .compat import RECIPES
from .meter import stepping_optimizer
from .results import end_run

if TYPE_CHECKING:
    from .plan import Technique


def _technique(recipe: str, accelerator, args: argparse.Namespace) -> Technique | None:
    """The planner's model of this run, if it has one: the technique of this recipe whose sharding and offload are
    what the built Accelerator runs (shared/compat.py reads them), and whose flags (e.g. --bits) the run has."""
    from .compat import offload_of, sharding_of
    from .plan import TECHNIQUES, compat_run

    # Accumulating or data-parallel runs hold what the baseline holds for one micro-batch.
    recipe = {"gradient_accumulation": "baseline", "data_parallel": "baseline"}.get(recipe, recipe)
    launched = (sharding_of(accelerator), offload_of(accelerator))

    def runs_as_launched(t: Technique) -> bool:
        run = compat_run(t, "fp32", accelerator.num_processes)
        return (run.sharding, run.offload) == launched

    candidates = [t for t in TECHNIQUES if t.recipe == recipe and runs_as_launched(t)]
    if launched == ("zero3", "cpu"):  # ZeRO-3 may offload the optimizer alone; the planner models both offloaded
        param = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].get("offload_param") or {}
        candidates = [t for t in candidates if (t.offload == "all") == (param.get("device", "none") != "none")]

    def has_flags(t: Technique) -> bool:
        words, i = list(t.args), 0
        while i < len(words):
            name = words[i].lstrip("-")
            if i + 1 < len(words) and not words[i + 1].startswith("--"):  # a flag and its value
                if str(getattr(args, name, words[i + 1])) != words[i + 1]:
                    return False
                i += 2
            else:  # a switch (store_true), e.g. --use_dora
                if not getattr(args, name, False):
                    return False
                i += 1
        return True

    # The most specific row whose flags the run has: tensor_parallel_fsdp (--tp_size 2) before tensor_parallel.
    ranked = sorted(candidates, key=lambda t: -len(t.args))
    return next((t for t in ranked if has_flags(t)), candidates[0] if candidates else None)


def _memory_estimate(recipe: str, accelerator, args, model) -> dict:
    from .plan import CPU_RUNTIME_BYTES, fmt, model_spec, predict

    tech = _technique(recipe, accelerator, args)
    if tech is None:
        return {"estimate": f"the planner has no model of recipes/{recipe}.py under this launch"}
    spec = model_spec(accelerator.unwrap_model(model, keep_torch_compile=False).config, args.task, "run")
    seq = None if args.task == "image-classification" else args.max_seq_length
    precision = "bf16" if args.mixed_precision in ("bf16", "fp16") else "fp32"
    on_gpu = accelerator.device.type == "cuda"
    p = predict(spec, tech, precision, accelerator.num_processes, args.per_device_train_batch_size, seq,
                kernels="cuda" if on_gpu else "cpu")
    if on_gpu:
        free, _ = torch.cuda.mem_get_info(accelerator.device)
        need = p.device_peak
    else:
        import psutil

        free = psutil.virtual_memory().available // accelerator.num_processes
        need = p.device_peak + p.host + CPU_RUNTIME_BYTES
    return {"technique": tech.name, "predicted_peak_per_process": fmt(need), "available_per_process": fmt(free),
            "predicted_peak_bytes_per_process": int(need), "available_bytes_per_process": int(free),
            "fits": bool(need <= free)}


def stop_if_preflight(accelerator, args, task, model, optimizer: object | None) -> None:
    """With --preflight: report the resolved run and end it before its first step. Otherwise nothing.

    Called by the recipe after prepare() (DeepSpeed fills its "auto" values there) and resume() (a checkpoint that
    cannot be loaded is refused by the preflight too). The planner is imported by the report only, never in training.
    """
    if args.preflight:
        report(accelerator, args, task, model, optimizer)


def report(accelerator, args, task, model, optimizer) -> None:
    """Print and save the resolved configuration, then end the run before its first step (exit code 0, or 3 when
    the memory estimate does not fit)."""
    recipe = args.recipe
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
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
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        # (sequence parallel: the processes split each sequence, not the samples)
        "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
        * (1 if recipe in RECIPES and RECIPES[recipe].splits_sequence else accelerator.num_processes),
        "max_train_steps": args.max_train_steps,
        "learning_rate": args.learning_rate,
        "optimizer": None if optimizer is None else type(stepping_optimizer(optimizer)).__name__,  # None: PTQ
        "trainable_parameters_this_process": trainable,
        "deepspeed_config": getattr(getattr(accelerator.state, "deepspeed_plugin", None), "deepspeed_config", None),
        "fsdp_plugin": repr(getattr(accelerator.state, "fsdp_plugin", None)),
        "memory": _memory_estimate(recipe, accelerator, args, model),
    }
    if accelerator.is_main_process:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "preflight.json").write_text(json.dumps(resolved, indent=2, default=str))
        print(json.dumps(resolved, indent=2, default=str))
        if resolved["memory"].get("fits") is False:
            m = resolved["memory"]
            print(f"WARNING: the predicted peak, {m['predicted_peak_per_process']} per process, exceeds the "
                  f"{m['available_per_process']} available: run `python -m shared.plan` with this model and "
                  "hardware for the combinations that fit (docs/planner.md).")
    accelerator.wait_for_everyone()
    end_run(accelerator)  # the same exit as a finished run (a gloo exit deadlock otherwise)
    raise SystemExit(3 if resolved["memory"].get("fits") is False else 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_args: list[str] = []
    while argv and not argv[0].endswith(".py"):
        launch_args.append(argv.pop(0))
    if not argv:
        raise SystemExit(__doc__)
    recipe, *recipe_args = argv
    if not Path(recipe).exists():
        raise SystemExit(f"{recipe!r} does not exist. Name a recipe, e.g. recipes/baseline.py.")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, recipe, *recipe_args, "--preflight"]
    return subprocess.call(cmd, env={**os.environ})


if __name__ == "__main__":
    sys.exit(main())
