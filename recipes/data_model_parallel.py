"""Data + model parallel on a 2-D device mesh: the processes form `data_parallel` replicas of a
`pipeline_stages`-stage pipeline (4 processes = 2 replicas x 2 stages). Inside a replica the model is cut into
stages (torch.distributed.pipelining); across replicas each stage's gradients are averaged with the same stage of
the other replicas, which train on other slices of the global batch.

    accelerate launch --config_file accelerate_configs/data_model_parallel.yaml recipes/data_model_parallel.py
    accelerate launch --config_file accelerate_configs/data_model_parallel.yaml --num_processes 8 \
        recipes/data_model_parallel.py --pipeline_stages 4 --model_preset base       # 2 replicas x 4 stages
Mesh (replica, stage) -> rank = replica * stages + stage. Global batch = per_device_train_batch_size x replicas.
Accelerate's ParallelismConfig (tensor parallel + FSDP) is the other 2-D layout on GPUs; it refuses CPU distributed
types at validation (Accelerate 1.15), so this recipe builds the mesh itself and runs on both.
--checkpointing_steps: every process saves its own stage (each replica's copy); resume with the same mesh.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather_object
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import transformer_layers
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import collect_results, write_results
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.pipeline_stages import (
    Stage,
    checkpoint_per_process,
    clip_global_grad_norm,
    evaluate,
    pad_to_length,
    save_stage_shards,
    split_layers,
    stage_inputs,
    stage_loss,
    tied_weight,
)

RECIPE = "data_model_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(shardings=("ddp",), min_processes=4, instead="accelerate_configs/data_model_parallel.yaml",
                  own_attention_mask=True,
                  no_compile="its stages run through torch.distributed.pipelining, outside accelerator.prepare(), so "
                             "nothing would compile them")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}  # classes of torch.distributed.pipelining


def add_args(p):
    p.add_argument("--pipeline_stages", type=COUNT, default=2, help="Stages per replica; replicas = processes / this.")
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--n_microbatches", type=COUNT, default=2, help="Micro-batches per batch; must divide it.")
    p.add_argument("--layers_per_stage", default=None, help="Blocks per stage, e.g. 1,3. Unset: an even split.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, stages_per_replica=args.pipeline_stages,
                            microbatches=args.n_microbatches, batch_size=args.per_device_train_batch_size,
                            flags={"stages_per_replica": "--pipeline_stages"})
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
    from torch.distributed import pipelining
    world, device = accelerator.num_processes, accelerator.device
    stages = args.pipeline_stages
    replicas = world // stages
    mesh = init_device_mesh(device.type, (replicas, stages), mesh_dim_names=("dp", "pp"))
    dp_rank, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    task = load_task(launch, accelerator)  # the same seed everywhere: all replicas start identical

    # The stages of a replica read the same whole batch; replicas read different slices of the global batch.
    pad_id = getattr(task.tokenizer, "pad_token_id", 0) or 0
    loaders = []
    for dl, shuffle in ((task.train_dataloader, True), (task.eval_dataloader, False)):
        fixed = DataLoader(dl.dataset, batch_size=args.per_device_train_batch_size, shuffle=shuffle, drop_last=True,
                           collate_fn=pad_to_length(dl.collate_fn, args.max_seq_length, pad_id),
                           generator=torch.Generator().manual_seed(args.seed))
        loaders.append(prepare_data_loader(fixed, device, num_processes=replicas, process_index=dp_rank,
                                           use_seedable_sampler=True))
    train_dl, eval_dl = loaders

    layers = split_layers(len(transformer_layers(task.model)), stages, args.layers_per_stage)[pp_rank]
    stage = Stage(task.model, layers, is_first=pp_rank == 0, is_last=pp_rank == stages - 1).to(device)
    pipe = pipelining.PipelineStage(stage, pp_rank, stages, device, group=pp_group)
    item_count = {}
    loss_fn = stage_loss(task)  # yours (Task.loss_fn), or the task's cross-entropy
    schedule_cls = getattr(pipelining, SCHEDULES[args.schedule])
    schedule = schedule_cls(pipe, n_microbatches=args.n_microbatches, scale_grads=False,
                            loss_fn=lambda out, y: loss_fn(out, y) / item_count["n"])
    tied = tied_weight(stage)
    tie_groups = [dist.new_group([int(mesh.mesh[d, 0]), int(mesh.mesh[d, -1])]) for d in range(replicas)]

    max_steps = total_steps(launch, accelerator, train_dl, already_split=True)  # this process's own batches
    optimizer, scheduler = optimizer_and_scheduler(launch, stage, max_steps)
    checkpoint_per_process(accelerator, stage, optimizer, scheduler)  # each process saves its own stage
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, stage, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, stage, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    stage.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        x, mask = stage_inputs(batch)
        # The loss is over the global batch: divide by its items, counted over the replicas.
        count = task.count_items(batch).to(device)
        dist.all_reduce(count, group=dp_group)
        item_count["n"] = count
        losses = []
        if stage.is_first:
            schedule.step(x, **mask)
        elif stage.is_last:
            schedule.step(**mask, target=batch["labels"], losses=losses, return_outputs=False)
        else:
            schedule.step(**mask)
        # Data parallel across replicas: sum each stage's gradients with the same stage of the other replicas.
        for p in stage.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dp_group)
        if tied is not None:
            dist.all_reduce(tied.grad, group=tie_groups[dp_rank])
        clip_global_grad_norm(stage, launch.max_grad_norm, pp_group, skip=tied if stage.is_last else None)
        optimizer.step()
        scheduler.step()
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
        dist.all_reduce(loss, group=dp_group)  # each replica's share of the global loss
        dist.broadcast(loss, src=int(mesh.mesh[dp_rank, -1]), group=pp_group)
        meter.record(step, loss, batch if stage.is_last else [])  # each sample counted once
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    flat = torch.cat([p.detach().reshape(-1) for p in stage.parameters()])
    mean = flat.clone()
    dist.all_reduce(mean, group=dp_group)
    spread = (flat - mean / replicas).abs().max()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    extras = {"data_parallel_replicas": replicas, "pipeline_stages": stages, "schedule": args.schedule,
              "mesh": mesh.mesh.tolist(), "global_batch_size": launch.per_device_train_batch_size * replicas,
              "stage_index": gather_object([pp_rank]), "stage_layers": gather_object([[layers.start, layers.stop]]),
              "stage_param_count": gather_object([sum(p.numel() for p in stage.parameters())]),
              "max_param_diff_between_replicas": spread.item()}
    last = int(mesh.mesh[dp_rank, -1])
    meter.summary()  # measured before the save, which comes first: an interrupted evaluation leaves the model
    if not args.no_save_model:  # one replica saves: they are identical
        save_stage_shards(accelerator, launch.output_dir, task, stage, pp_rank, stages, tied, write=dp_rank == 0)
    metrics = evaluate(task, schedule, stage, eval_dl, item_count, last, pp_group=pp_group, dp_group=dp_group)
    results = collect_results(accelerator, launch, task, meter, metrics, extras)
    return write_results(accelerator, launch, results)


if __name__ == "__main__":
    main()
