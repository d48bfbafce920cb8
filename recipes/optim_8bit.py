"""8-bit AdamW (bitsandbytes) in place of torch AdamW: the two moments are stored in 8 bits with block-wise scales,
so optimizer state takes about a quarter of its 32-bit size, for the same update rule.

bitsandbytes keeps 8-bit state only for tensors of at least --min_8bit_size elements (4096, its default); smaller
ones (biases, norms) keep 32-bit state. results.json reports how many of each, and the state bytes on live tensors.
--paged uses PagedAdamW8bit: its state sits in CUDA unified memory and is evicted to CPU RAM under GPU memory
pressure instead of failing with out-of-memory. It needs a CUDA device: elsewhere the recipe refuses rather than
fall back to plain memory the way bitsandbytes does.
    accelerate launch recipes/optim_8bit.py                          # tiny BERT on built-in data
    accelerate launch recipes/optim_8bit.py --task causal-lm --paged  # on a CUDA GPU
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import number, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.optim_8bit import check_paged

RECIPE = "optim_8bit"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(instead="recipes/combined.py --optim adamw_bnb_8bit (ZeRO-1/2 without offload)")


def add_args(p):
    p.add_argument("--paged", action="store_true",
                   help="PagedAdamW8bit: state in CUDA unified memory, paged to CPU RAM under memory pressure.")
    p.add_argument("--min_8bit_size", type=number(int, low=0), default=4096,
                   help="Tensors with fewer elements keep 32-bit state (bitsandbytes' default).")
    p.add_argument("--percentile_clipping", type=number(int, low=1, high=100), default=100,
                   help="Clip gradients at this percentile of the last 100 gradient norms (100: off).")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, optimizer="adamw_bnb_8bit",
                            flags={"optimizer": "the 8-bit optimizer"})
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        kwargs_handlers=launch.kwargs_handlers,  # a timeout for collectives; gloo on a CPU-only machine
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    # The technique's library, imported once the launch is known to be valid: --help and a refused launch
    # need not wait for its import (seconds).
    import bitsandbytes as bnb
    check_paged(args.paged, accelerator.device.type)  # --paged needs CUDA's unified memory
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    # The technique: bitsandbytes' 8-bit AdamW, same hyperparameters and parameter groups as torch AdamW.
    optim_cls = bnb.optim.PagedAdamW8bit if args.paged else bnb.optim.AdamW8bit
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps, optimizer_cls=optim_cls)
    for group in optimizer.param_groups:
        group["min_8bit_size"] = args.min_8bit_size
        group["percentile_clipping"] = args.percentile_clipping

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        loss = task.loss(model, batch, num_items)
        accelerator.backward(loss)
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    # What was really 8-bit: state1 is uint8 for 8-bit tensors, float32 for the small ones.
    states = [s for s in optimizer.optimizer.state.values() if "state1" in s]
    extras = {
        "tensors_with_8bit_state": sum(s["state1"].dtype == torch.uint8 for s in states),
        "tensors_with_32bit_state": sum(s["state1"].dtype != torch.uint8 for s in states),
        "paged_state_buffers": sum(getattr(s["state1"], "is_paged", False) for s in states),
    }
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
