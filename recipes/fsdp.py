"""FSDP2 (fully sharded data parallel) through Accelerate: each process keeps 1/N of the parameters, gradients and
optimizer state, and gathers one transformer block's parameters at a time for its forward and backward.

Full shard, optional CPU offload, one FSDP unit per transformer block, sharded checkpoints that resume, and one
consolidated safetensors model at the end.
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/fsdp.py
    accelerate launch --config_file accelerate_configs/fsdp_offload.yaml recipes/fsdp.py --task causal-lm
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/fsdp.py --checkpointing_steps 50
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/fsdp.py --resume_from_checkpoint latest
On a CPU-only machine the same configs run over gloo (shared/techniques/fsdp_launch.py makes Accelerate shard there).
HSDP, --dp_replicate_size R or --dp_shard_size S (R = nodes, S = GPUs per node): Accelerate's ParallelismConfig
mesh, each block sharded inside a group of S processes and replicated over the R groups (docs/hsdp.md):
    accelerate launch --config_file accelerate_configs/hsdp.yaml recipes/fsdp.py --dp_replicate_size 2   # 2 x 2
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, parse_args
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
from shared.techniques.async_checkpoint import async_checkpoints
from shared.techniques.fsdp_launch import STEPS, fsdp_plugin_kwargs, launch_fsdp_settings
from shared.techniques.hsdp import hsdp_report, parallelism_config

RECIPE = "fsdp"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(fsdp=STEPS,  # the launch config's FSDP settings checked, FSDP2 on CPU, one unit per block
                  shardings=("fsdp",), min_processes=2, instead="accelerate_configs/fsdp.yaml or fsdp_offload.yaml "
                  "(hsdp.yaml: HSDP)", async_checkpoint=True, reshards=True)  # SHARDED_STATE_DICT: DCP reshards


def add_args(p):
    p.add_argument("--cpu_offload", action="store_true", default=None,
                   help="Keep parameter shards, gradients and the optimizer step in host memory. Unset: the "
                        "accelerate config's fsdp_offload_params.")
    p.add_argument("--dp_replicate_size", type=COUNT, default=None,
                   help="HSDP: replicas of the model (the nodes), each sharded over processes / R. Unset: 1.")
    p.add_argument("--dp_shard_size", type=COUNT, default=None,
                   help="HSDP: processes each replica is sharded over (the GPUs of a node). Unset: processes / R.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # The recipe's settings; each fsdp_* setting of the launch config replaces its own, or is refused (fsdp_launch.py).
    launched = launch_fsdp_settings()
    fsdp_plugin = FullyShardedDataParallelPlugin(**fsdp_plugin_kwargs(
        args, launched,
        fsdp_version=2,
        reshard_after_forward=True,                 # full shard: parameters are freed again after each block's use
        auto_wrap_policy="transformer_based_wrap",  # one FSDP unit (one all-gather) per transformer block
        state_dict_type="SHARDED_STATE_DICT",       # checkpoints: each process writes and reads only its shard
        cpu_offload=args.cpu_offload,               # None: fsdp_offload_params from the accelerate config
    ))
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, fsdp_plugin=fsdp_plugin,
                            dp_replicate_size=args.dp_replicate_size or 0, dp_shard_size=args.dp_shard_size or 0)
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
        fsdp_plugin=fsdp_plugin,
        # HSDP: ParallelismConfig(dp_replicate_size, dp_shard_size), the 2-D mesh prepare() gives fully_shard
        parallelism_config=parallelism_config(launch.run, fsdp_plugin),  # None without the flags: FSDP over all
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    # FSDP2 needs the model and its optimizer in the same prepare() call: it swaps the parameters for shards.
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_step, consumed = resume(accelerator, launch, max_steps)
    writes = async_checkpoints(args)  # --async_checkpoint: written while training goes on
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps, writes)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps, writes)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        loss = task.loss(model, batch, num_items)
        accelerator.backward(loss)  # gradients are reduce-scattered: each process keeps its shard's
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps, writes=writes)

    extras = {
        "fsdp_version": fsdp_plugin.fsdp_version,
        "reshard_after_forward": fsdp_plugin.reshard_after_forward,
        "cpu_offload": isinstance(fsdp_plugin.cpu_offload, CPUOffloadPolicy),
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "wrapped_block_class": fsdp_plugin.transformer_cls_names_to_wrap[0],
        "state_dict_type": fsdp_plugin.state_dict_type.name,
        "fsdp_settings_from": {k: source for k, (_, source) in launched.items()},  # else the recipe's
        **hsdp_report(accelerator, model, optimizer),  # HSDP: the mesh, and each process's shard digest
    }
    # finish() gathers the shards into one consolidated safetensors model (a collective on every process).
    return finish(accelerator, launch, task, model, eval_dl, meter, extras)


if __name__ == "__main__":
    main()
