"""Mixed precision: fp16 with dynamic loss scaling, or bf16. Matmuls run in 16 bits, master weights stay fp32.

fp16 has a narrow exponent range, so small gradients underflow: the loss is multiplied by a scale before backward,
gradients are unscaled before the step, and a step whose gradients overflowed (inf/nan) is skipped and the scale
halved; after `growth_interval` clean steps it doubles. bf16 has fp32's range and needs no scaler.
The recipe reports the steps skipped and the final scale. On a CPU-only machine fp16 runs for real (torch's CPU
autocast and GradScaler, see shared/core/launch.py), never silently fp32.
    accelerate launch recipes/mixed_precision.py                              # fp16 (the default here)
    accelerate launch recipes/mixed_precision.py --mixed_precision bf16
    accelerate launch --config_file accelerate_configs/bf16.yaml recipes/mixed_precision.py --task causal-lm
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import GradScalerKwargs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, number, parse_args
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

RECIPE = "mixed_precision"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(compiles=True, instead="recipes/zero.py (ZeRO), recipes/fsdp.py (FSDP) or "
                  "recipes/combined.py (this technique with sharding)")


def add_args(p):
    p.add_argument("--init_loss_scale", type=number(float, above=0), default=2.0**16,
                   help="fp16: the first loss scale.")
    p.add_argument("--loss_scale_growth_interval", type=COUNT, default=2000,
                   help="fp16: clean steps before the scale doubles.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # fp16 unless the flag or the accelerate config says otherwise; the scaler settings apply to fp16 only.
    scaler = GradScalerKwargs(init_scale=args.init_loss_scale, growth_interval=args.loss_scale_growth_interval)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, default_mixed_precision="fp16")
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        kwargs_handlers=[*launch.kwargs_handlers, scaler],  # a timeout for collectives; gloo on a CPU-only machine
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
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    skipped = 0
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
        optimizer.step()  # with fp16: unscales, and skips the update if any gradient overflowed
        skipped += int(optimizer.step_was_skipped)
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
    return finish(accelerator, launch, task, model, eval_dl, meter,
                  extras={"skipped_steps": skipped, "final_loss_scale": scale})


if __name__ == "__main__":
    main()
