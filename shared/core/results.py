"""The end of every run: evaluation, results.json (the contract tests and benchmarks read), the saved model."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import rundir

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")


def finish(accelerator, launch: Launch, task, model: torch.nn.Module, eval_dataloader, meter,
           extras: dict | None = None, save: bool | Callable = True) -> dict:
    """Save the model as safetensors (unless --no_save_model, or `save=False` for a recipe that saved another form
    itself), then evaluate, write results.json, close the trackers. Returns the results. Every recipe ends here, so
    the model is saved before the final evaluation. `save` may be the recipe's own way to write one consolidated
    model, `save(accelerator, model, task, output_dir)` (tensor / expert parallel shards)."""
    writer = save if callable(save) else save_model
    save = bool(save) and not launch.args.no_save_model
    meter.summary()  # measured before the save adds to the memory peak (results.json reads it below)
    if save:  # first: an evaluation that fails or is interrupted (Ctrl-C, a grace period's end) leaves the model
        try:
            writer(accelerator, model, task, launch.output_dir)
        except Exception as err:
            full = rundir.disk_full(err, Path(launch.output_dir), "the trained model", "--resume_from_checkpoint "
                                    "latest then writes it from the last checkpoint (with --checkpointing_steps).")
            if full:
                raise full from err
            raise
    try:
        metrics = task.evaluate(model, eval_dataloader, accelerator)
    except KeyboardInterrupt:
        kept = "--no_save_model: no model was saved" if launch.args.no_save_model else (
            f"the trained model was saved to {launch.output_dir} before it")
        logger.error("interrupted during the final evaluation: %s; results.json is not written", kept)
        raise SystemExit(128 + signal.SIGINT) from None  # a process exit, as Ctrl-C's: not a refusal to catch
    results = collect_results(accelerator, launch, task, meter, metrics, extras)
    return write_results(accelerator, launch, results)


def collect_results(accelerator, launch: Launch, task, meter, metrics: dict, extras: dict | None = None) -> dict:
    """The results.json fields: the run, the meter's measurements (before saving adds to the memory peak), metrics;
    the flags as typed and the values the launch resolved from them."""
    from .checkpoint import lineage, resume_changes
    from .flops import run_flops
    from .meter import log_metrics
    from .optim import stepped_schedule

    args = launch.args

    measured = meter.summary()
    # keep_torch_compile=False: the plain model (a regionally compiled DDP model would unwrap to its DDP wrapper).
    flops = run_flops(accelerator.unwrap_model(meter.model, keep_torch_compile=False), args.max_seq_length,
                      measured["train_tokens_per_second"], accelerator.num_processes, accelerator.device)
    results = {
        "recipe": launch.recipe,
        "task": task.name,
        "model": task.model_id,
        "model_type": getattr(getattr(task.model, "config", None), "model_type", None),  # what was built: llama ...
        "data": task.data_source,
        "num_processes": accelerator.num_processes,
        "device": str(accelerator.device),
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "torch_compile": launch.torch_compile,  # none | regional | full (shared/core/launch.py)
        "max_train_steps": meter.max_steps,
        "gradient_accumulation_steps": launch.gradient_accumulation_steps,
        "per_device_train_batch_size": launch.per_device_train_batch_size,
        "learning_rate": launch.learning_rate,
        "lr_scheduler": stepped_schedule(accelerator, args),  # the scheduler the loop stepped, not the flag alone
        "flags": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                  for k, v in sorted(vars(args).items()) if k != "explicit_flags"},  # as parsed, defaults too
        "explicit_flags": sorted(getattr(args, "explicit_flags", ())),  # what was typed
        "resolved": {**launch.resolved(), "max_train_steps": meter.max_steps},  # what ran
        "resume_changes": resume_changes(),  # what a resume changed from the checkpoint's run, applied
        "lineage": lineage(),  # this run's branch, its parent's, and the step and checkpoint it started from
        **measured,
        **flops,  # model FLOPs per token and MFU (shared/core/flops.py); MFU only on a GPU in its peak table
        **metrics,
        **getattr(task, "stats", {}),  # what the training data holds (shared/core/datastats.py)
        **meter.extras,
        **(extras or {}),
    }
    log_metrics(accelerator, {f"eval/{k.removeprefix('eval_')}": v for k, v in metrics.items()}, meter.max_steps)
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in results.items()}


def write_results(accelerator, launch: Launch, results: dict) -> dict:
    """Write results.json (main process, atomically) and close the trackers. Recipes that evaluate and save in
    their own way (a pipeline, whose whole model no process holds) call collect_results and this directly."""
    if accelerator.is_main_process:
        out = Path(launch.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(results, indent=2))
        os.replace(tmp, out / "results.json")
        metrics = ("train_loss", "eval_accuracy", "eval_loss", "eval_perplexity")
        logger.info("results: %s", {k: results[k] for k in metrics if k in results})
        logger.info("wrote %s", out / "results.json")
    end_run(accelerator)
    return results


def end_run(accelerator) -> None:
    """Close the trackers before the process exits (a finished run, or a preflight that stops before training)."""
    accelerator.end_training()
    if accelerator.num_processes > 1:
        # torch 2.13 + gloo: a worker thread may still be freeing a finished collective's tensors (which takes the
        # GIL) when the DDP reducer drops the process group, whose destructor joins that thread holding the GIL: a
        # deadlock at exit, seen in 1 of 8 two-process runs (pytorch/pytorch#56297). Sleeping releases the GIL so
        # the thread finishes first.
        time.sleep(0.2)


def save_model(accelerator, model: torch.nn.Module, task, output_dir: str,
               plain: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """One consolidated model in safetensors that `from_pretrained` loads, whatever held the shards. `plain`: each
    tensor as save_pretrained can read it, for weights a technique wraps (techniques/fp8.py save_fp8_model)."""
    accelerator.wait_for_everyone()
    from accelerate.utils.other import has_compiled_regions, is_compiled_module

    if is_compiled_module(model) or has_compiled_regions(model):
        # --torch_compile: save the module that was compiled, which holds the same parameters. A compiled module
        # names them `_orig_mod.<name>`, which from_pretrained would not know, and unwrap_model keeping the compiled
        # regions of a DDP model returns the DDP wrapper (Accelerate 1.15): `module.` names.
        model = accelerator.unwrap_model(model, keep_torch_compile=False)
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 / FSDP shards; a collective on all processes
    unwrapped = accelerator.unwrap_model(model)
    # A gathered FSDP state dict holds tied weights (GPT-2's lm_head = wte) as separate copies, and save_pretrained
    # drops only ties that share storage: keep the source, as an unsharded save does.
    for target in getattr(unwrapped, "all_tied_weights_keys", None) or {}:  # {target: source}, ties in effect
        if state_dict is not None:
            state_dict.pop(target, None)
    if state_dict is not None and plain is not None:
        state_dict = {name: plain(t) for name, t in state_dict.items()}
    if accelerator.is_main_process:  # the gathered state is the main process's: ZeRO-3 hands the others None, on
        # which save_pretrained would read their empty partitions (a mixture of experts' fused experts then fail
        # transformers' reverse weight conversion: "chunk expects chunks to be greater than 0")
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, save_function=accelerator.save,
                                  safe_serialization=True)
        task.save_preprocessing(output_dir)
        logger.info("saved model to %s", output_dir)
    accelerator.wait_for_everyone()
