"""ZeRO-3 with offload: parameters, gradients and optimizer state sharded, and offloaded to CPU memory (default) or
NVMe (`--offload nvme --nvme_path DIR`). The optimizer step runs on the CPU (DeepSpeedCPUAdam).

The recipe carries its own DeepSpeed settings, so it runs with no config file, on a CPU-only machine as on GPUs;
an accelerate config or a DeepSpeed JSON given by the user overrides them.
    accelerate launch recipes/zero3_offload.py                                  # as many processes as GPUs (or 1)
    accelerate launch --config_file accelerate_configs/zero3_offload.yaml recipes/zero3_offload.py   # 2 processes
    accelerate launch --config_file accelerate_configs/zero3_nvme.yaml recipes/zero3_offload.py --nvme_path /nvme
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DeepSpeedPlugin, GradientAccumulationPlugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.optim import total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.deepspeed_setup import (
    STEPS,
    add_deepspeed_args,
    deepspeed_summary,
    json_optimizer_and_scheduler,
    patch_zero_step_to_count_states,
    resolve_deepspeed_config,
    schedule_the_optimizer_that_steps,
    zero3_init,
    zero_config,
)

RECIPE = "zero3_offload"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(deepspeed=STEPS, shardings=("zero1", "zero2", "zero3"), accumulates=True, needs_offload=True,
                  instead="accelerate_configs/zero3_offload.yaml, zero2_offload.yaml or zero3_nvme.yaml",
                  no_compile="under DeepSpeed, Accelerate compiles the engine's module in place (engine.compile), "
                            "which has not been run on this stack")


def add_args(group):
    group.add_argument("--offload", default="cpu", choices=("cpu", "nvme", "none"),
                       help="Where parameters and optimizer state live between uses.")
    add_deepspeed_args(group)


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # The recipe's DeepSpeed settings; "auto" ones are filled from the flags. An accelerate config or a DeepSpeed
    # JSON overrides them, and explicit values that disagree stop the run here, before anything is built.
    ds_config = zero_config(3, offload=args.offload)  # optimizer state and parameters offloaded
    if args.offload == "nvme":
        zero = ds_config["zero_optimization"]
        # NVMe buffers: DeepSpeed's default (1e8 elements x 5) costs ~2.5 GB of RAM per process. Each buffer must
        # hold the largest parameter partition: raise buffer_size for large embeddings.
        zero["offload_optimizer"]["buffer_count"] = 4
        zero["offload_param"].update(buffer_count=5, buffer_size=int(2e7), max_in_cpu=0)
        # DeepSpeed's NVMe I/O (async_io): 1 MiB blocks, a queue deep enough for a local SSD.
        ds_config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    ds_config = resolve_deepspeed_config(args, ds_config)
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config,
                             # ZeRO-3: build the model under zero.Init, so no process ever holds all of it.
                             zero3_init_flag=zero3_init(ds_config))
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, deepspeed_config=ds_config)
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
        deepspeed_plugin=plugin,
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)  # after the Accelerator: ZeRO-3 partitions the model as it is built
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    # With offload Accelerate swaps this AdamW for DeepSpeedCPUAdam (same update, run on the CPU copies).
    # AdamW and the --lr_scheduler_type schedule; a DeepSpeed JSON's "optimizer" / "scheduler" block runs instead.
    optimizer, scheduler = json_optimizer_and_scheduler(ds_config, launch, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    schedule_the_optimizer_that_steps(model, scheduler)  # else, after a resume with offload, the learning rate freezes
    start_step, consumed = resume(accelerator, launch, max_steps)
    k = launch.gradient_accumulation_steps  # resolved: the flag, the launch config or the DeepSpeed JSON
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits
    meter.extras.update(deepspeed_summary(accelerator, model))
    patch_zero_step_to_count_states(meter, model, optimizer)  # ZeRO frees gradients inside its own step

    model.train()
    for step in meter.steps(start_step, max_steps):
        window = [next(batches) for _ in range(k)]
        # Items (tokens or samples) in the whole accumulated batch, summed over all processes.
        num_items = accelerator.reduce(sum(task.count_items(b) for b in window), "sum")
        # DeepSpeed divides by k and averages over processes: scale so each item weighs 1/num_items.
        divisor = num_items / (k * accelerator.num_processes)
        step_loss = 0.0
        for batch in window:
            with accelerator.accumulate(model):
                loss = task.loss(model, batch, num_items=divisor)
                # DeepSpeed's engine: backward, and at the k-th micro-batch clipping (gradient_clipping from the
                # resolved config), the optimizer step on the offloaded state, the scheduler step and zero_grad.
                accelerator.backward(loss)
            step_loss += loss.detach() / k
        optimizer.step()  # no-ops under DeepSpeed, kept so the loop reads like every other recipe
        scheduler.step()
        meter.record(step, step_loss, window)
        guard.check(step, step_loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=(step + 1) * k)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=(step + 1) * k, max_steps=max_steps)

    return finish(accelerator, launch, task, model, eval_dl, meter)


if __name__ == "__main__":
    main()
