"""Data parallel (DDP) through Accelerate: a full copy of the model in every process, each process a different slice
of the global batch, gradients averaged (all-reduce) before every optimizer step. The reference for the other
parallel recipes.

Reports each process's throughput and, given a 1-process run of the same settings, the scaling against it.
    accelerate launch recipes/data_parallel.py --output_dir outputs/dp1                  # 1 process: the reference
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/data_parallel.py \
        --compare_to outputs/dp1/results.json                                            # N GPUs
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/data_parallel.py   # 2 procs, gloo
    ... data_parallel.py --comm_hook bf16 | power_sgd, or --local_sgd_steps 8: fewer bytes sent (docs/comm_reduction.md)
Global batch = per_device_train_batch_size x processes x gradient_accumulation_steps.
"""

import json
import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.local_sgd import LocalSGD
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, gather_object

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, number, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.errors import LaunchError
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.comm_reduction import HOOKS, AllreduceBytes, powersgd_options

RECIPE = "data_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(compiles=True, reshards=True, instead="recipes/zero.py (ZeRO), recipes/fsdp.py (FSDP) or "
                  "recipes/combined.py (this technique with sharding)")


def add_args(p):
    p.add_argument("--compare_to", default=None,
                   help="results.json of a 1-process run with the same flags: report the speed-up against it.")
    p.add_argument("--bucket_cap_mb", type=COUNT, default=25,
                   help="DDP all-reduces gradients in buckets of this size, overlapped with the backward pass.")
    p.add_argument("--comm_hook", default="no", choices=HOOKS,
                   help="DDP communication hook: gradients sent in fp16 / bf16, or PowerSGD-compressed (low rank).")
    p.add_argument("--powersgd_rank", type=COUNT, default=1, help="PowerSGD's matrix_approximation_rank.")
    p.add_argument("--powersgd_start_iter", type=number(int, low=2), default=10,
                   help="PowerSGD sends plain fp32 gradients before this step (torch's minimum: 2).")
    p.add_argument("--local_sgd_steps", type=COUNT, default=None,
                   help="LocalSGD: no gradient all-reduce; the parameters averaged every K steps.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    reference = None
    if args.compare_to:
        if not Path(args.compare_to).is_file():
            raise LaunchError(f"--compare_to {args.compare_to!r} does not exist. Pass the results.json of a "
                              "1-process run of this recipe, or leave it unset.")
        reference = json.loads(Path(args.compare_to).read_text())
        if reference.get("num_processes") != 1 or reference.get("recipe") != RECIPE:
            raise LaunchError(f"--compare_to {args.compare_to!r} is a {reference.get('num_processes')}-process "
                              f"{reference.get('recipe')} run; pass the results.json of a 1-process {RECIPE} run.")
    ddp = DistributedDataParallelKwargs(  # how DDP averages the gradients, and what it sends: the hook's dtype or rank
        bucket_cap_mb=args.bucket_cap_mb, comm_hook=DDPCommunicationHookType(args.comm_hook),  # a str: silently none
        comm_state_option=powersgd_options(args.comm_hook, args.powersgd_rank, args.powersgd_start_iter))
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, comm_hook=args.comm_hook, local_sgd_steps=args.local_sgd_steps or 0,
                            powersgd_start=args.powersgd_start_iter, train_steps=args.max_train_steps or 0,
                            powersgd_typed=" ".join(sorted(f"--{f}" for f in args.explicit_flags if "powersgd" in f)),
                            checkpoints=bool(args.checkpointing_steps or args.resume_from_checkpoint))
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    sent = AllreduceBytes(ddp)  # counts the bytes the hook (or LocalSGD) all-reduces
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        kwargs_handlers=[*launch.kwargs_handlers, ddp],  # a timeout for collectives; gloo on a CPU-only machine
        dynamo_plugin=launch.dynamo_plugin,  # --torch_compile: applied in prepare(), after DDP / FSDP / checkpointing
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    # prepare() wraps the model in DistributedDataParallel and gives each process its own slice of every batch.
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    sent.watch(model)  # plain DDP: torch's allreduce_hook (the same all-reduce, in Python), so it is counted too
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    # --local_sgd_steps K: DDP's all-reduce off (no_sync), the parameters averaged every K steps and on leaving.
    with LocalSGD(accelerator, model, args.local_sgd_steps or 1, enabled=bool(args.local_sgd_steps)) as local_sgd:
        for step in meter.steps(start_step, max_steps):
            batch = next(batches)
            # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
            # processes, and each process's own mean would weigh a token differently from one big batch.
            num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
            loss = task.loss(model, batch, num_items)
            accelerator.backward(loss)  # DDP all-reduces (averages) the gradients during backward
            if launch.max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
            optimizer.step()
            scheduler.step()
            meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
            guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
            optimizer.zero_grad(set_to_none=True)
            local_sgd.step()  # every K-th step: the parameters averaged over the processes
            preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
            maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    # Throughput of each process on its own slice, and of all of them together against one process.
    per_process = gather_object([meter.samples / meter.elapsed if meter.elapsed else None])
    extras = {"ddp_wrapped": type(model).__name__ == "DistributedDataParallel",
              "global_batch_size": launch.per_device_train_batch_size * accelerator.num_processes
              * launch.gradient_accumulation_steps,
              "per_process_samples_per_second": per_process, **sent.summary(model, accelerator.num_processes)}
    if reference is not None:
        speedup = meter.summary()["train_samples_per_second"] / reference["train_samples_per_second"]
        extras.update(scaling_vs_1_process=speedup, scaling_efficiency=speedup / accelerator.num_processes)
        accelerator.print(f"{accelerator.num_processes} processes: {speedup:.2f}x the samples/s of 1 process "
                          f"({100 * speedup / accelerator.num_processes:.0f}% scaling efficiency)")
    return finish(accelerator, launch, task, model, eval_dl, meter, extras)

if __name__ == "__main__":
    main()
