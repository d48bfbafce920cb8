"""Gradient accumulation: the gradient of a large batch from several small ones, when the large one does not fit.

`accelerator.accumulate` skips the gradient all-reduce and the optimizer step until the last micro-batch of a
window of --gradient_accumulation_steps. The loss is normalized by the items of the whole accumulated global batch
(target tokens for a causal LM, samples for classification), not averaged per micro-batch: averaging per
micro-batch weighs a token in a short micro-batch more than one in a long one, and the result differs from the
large batch. The scheduler steps once per optimizer step.
    accelerate launch recipes/gradient_accumulation.py                          # 4 micro-batches per step
    accelerate launch recipes/gradient_accumulation.py --task causal-lm --gradient_accumulation_steps 8
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradientAccumulationPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import parse_args
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

RECIPE = "gradient_accumulation"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# Accumulation keeps one micro-batch's activations at a time; DDP replicas each hold what the baseline holds.
SUPPORT = Support(compiles=True, reshards=True, accumulates=True, instead="recipes/zero.py (ZeRO), recipes/fsdp.py "
                  "(FSDP) or recipes/combined.py (this technique with sharding)")


def add_args(p):
    """This recipe's own flags (none: --gradient_accumulation_steps is common to all, 4 by default here)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, gradient_accumulation_steps=4)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT)
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        # Sync every k-th micro-batch, counted across epoch ends (not also at each dataloader end).
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=launch.gradient_accumulation_steps, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        kwargs_handlers=launch.kwargs_handlers,  # a timeout for collectives; gloo on a CPU-only machine
        dynamo_plugin=launch.dynamo_plugin,  # --torch_compile: applied in prepare(), after DDP / FSDP / checkpointing
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_step, consumed = resume(accelerator, launch, max_steps)
    k = launch.gradient_accumulation_steps  # resolved: the flag, the launch config or the DeepSpeed JSON
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        window = [next(batches) for _ in range(k)]
        # Items (tokens or samples) in the whole accumulated batch, summed over all processes.
        num_items = accelerator.reduce(sum(task.count_items(b) for b in window), "sum")
        # accelerator.backward divides by k and DDP averages over processes: scale so each item weighs 1/num_items.
        divisor = num_items / (k * accelerator.num_processes)
        step_loss = 0.0
        for batch in window:
            with accelerator.accumulate(model):  # no all-reduce, no optimizer step until the k-th micro-batch
                loss = task.loss(model, batch, num_items=divisor)
                accelerator.backward(loss)
            step_loss += loss.detach() / k
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, step_loss, window)  # before zero_grad: the gradients are counted too
        guard.check(step, step_loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=(step + 1) * k)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=(step + 1) * k, max_steps=max_steps)

    return finish(accelerator, launch, task, model, eval_dl, meter)


if __name__ == "__main__":
    main()
