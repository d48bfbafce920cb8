"""Optimizer step in backward: each parameter is updated by its own AdamW inside its post-accumulate-grad hook, and
its gradient freed at once, so the gradients of the whole model never exist together (peak gradient bytes: about
the largest parameter's, not the model's). The same update as one AdamW step after backward (fp32: within 1e-6).

It cannot clip by the global gradient norm, accumulate gradients, scale an fp16 loss, or run data-parallel (the hook
fires before the processes' gradients are averaged): each is refused with the reason. One process; bf16 works.
    accelerate launch recipes/optimizer_in_backward.py                      # tiny BERT on built-in data
    accelerate launch recipes/optimizer_in_backward.py --task causal-lm --mixed_precision bf16
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration

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
from shared.techniques.optim_in_backward import OptimizerInBackward

RECIPE = "optimizer_in_backward"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# One process only (sharding "none" is never launched with more), found by running DDP over gloo with the hooks:
# tests/test_optimizer_in_backward.py.
SUPPORT = Support(
    shardings=("none",),
    instead="one process (`accelerate launch recipes/optimizer_in_backward.py`, accelerate_configs/"
            "single_process.yaml or bf16.yaml); over several processes, recipes/zero.py (ZeRO-2) or "
            "recipes/fsdp.py shard the gradients instead",
    why_not="its hooks step each parameter on this process's own gradient, before DDP's all-reduce has averaged "
            "it (measured on gloo: the replicas differ after one step, and DDP's buckets still hold the whole "
            "model's gradients, so nothing is saved); ZeRO and FSDP reduce gradients their own way, and the hooks "
            "are not wired to them here")


def add_args(p):
    """This recipe's own flags (none: it changes where the optimizer steps, not what it computes)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, max_grad_norm=0.0)  # clipping is refused: off by default
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, optimizer="adamw_in_backward")
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
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    # The technique: one AdamW per parameter (the same groups, hyperparameters and schedule as the baseline's one),
    # each stepped by its parameter's post-accumulate-grad hook, which then frees that gradient.
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps, optimizer_cls=OptimizerInBackward)
    for param in optimizer.params:
        param.register_post_accumulate_grad_hook(optimizer.step_param)

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
        accelerator.backward(loss)  # steps every parameter and frees its gradient: no optimizer.step(), no zero_grad
        scheduler.step()  # the next step's lr, in every per-parameter optimizer
        meter.record(step, loss, batch)
        guard.check(step, loss)  # a non-finite loss: stop, state saved
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    # Gradient bytes at their peak, counted in the hooks, beside the whole model's (what a step after backward holds).
    extras = optimizer.optimizer.grad_bytes_report()
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
