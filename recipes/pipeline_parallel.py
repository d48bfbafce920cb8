"""Pipeline parallel with torch.distributed.pipelining: the model's blocks are cut into one stage per process;
each global batch is split into micro-batches that flow through the stages, so all stages work at once
(GPipe: all forwards then all backwards; 1F1B: alternate, keeping fewer micro-batches' activations alive).
Interleaved (process r holds stages r, r+P) and V schedules (r, 2P-1-r) cut it into 2 stages a process: shorter
fill and drain; zero-bubble ones split backwards to fill the waits. Bubbles: results.json, docs/pipeline_schedules.md.

Each process builds and keeps only its stages' parameters. GPT-2, Llama, BERT and ViT models.
    accelerate launch --config_file accelerate_configs/pipeline.yaml recipes/pipeline_parallel.py --task causal-lm
    torchrun --nproc_per_node 2 recipes/pipeline_parallel.py --schedule zbv --n_microbatches 8 --model_preset base
    accelerate launch --config_file accelerate_configs/pipeline.yaml --num_processes 4 \
        recipes/pipeline_parallel.py --model_preset base --layers_per_stage 2,4,4,2
Every process reads the same whole batch (the first stage needs the inputs, the last the labels). Text is padded to
--max_seq_length: stages exchange fixed-shape tensors. --checkpointing_steps: each process saves its own stages,
optimizer and scheduler (techniques/pipeline_stages.py checkpoint_per_process); resume on the same processes and stages.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather_object
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import collect_results, write_results
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.pipeline_stages import (
    bubble_report,
    build_stages,
    checkpoint_per_process,
    clip_global_grad_norm,
    evaluate,
    pad_to_length,
    process_stages,
    save_stage_shards,
    stage_inputs,
    stage_list,
    stage_loss,
    sum_tied_grads,
    tied_weight,
)

RECIPE = "pipeline_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(shardings=("ddp",), min_processes=2, instead="accelerate_configs/pipeline.yaml",
                  own_attention_mask=True,
                  no_compile="its stages run through torch.distributed.pipelining, outside accelerator.prepare(), so "
                             "nothing would compile them")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",  # classes of torch.distributed.pipelining
             "interleaved_1f1b": "ScheduleInterleaved1F1B", "interleaved_zb": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def add_args(p):
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--n_microbatches", type=COUNT, default=4, help="Micro-batches per batch; must divide it.")
    p.add_argument("--layers_per_stage", default=None, help="Blocks per stage, e.g. 1,3. Unset: an even split.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, microbatches=args.n_microbatches,
                            batch_size=args.per_device_train_batch_size,
                            flags={"schedule": f"--schedule {args.schedule}"})
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    from torch.distributed import pipelining  # the technique's library, once the launch is known to be valid

    # Which stages each process holds, from the schedule's own actions; the rule table refuses a count it cannot run.
    schedule_cls, world = getattr(pipelining, SCHEDULES[args.schedule]), launch.run.num_processes
    owners = process_stages(schedule_cls, launch.run)
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
    rank, device = accelerator.process_index, accelerator.device
    # The same micro-batch shape in evaluation as in training; the same seed on every process: each stage starts as
    # the same model.
    task = load_task(launch, accelerator, eval_batch_size=args.per_device_train_batch_size)

    # Every stage reads the whole batch, in the order a 1-process run would (not a per-process slice).
    pad_id = getattr(task.tokenizer, "pad_token_id", 0) or 0
    loaders = []
    for dl, shuffle in ((task.train_dataloader, True), (task.eval_dataloader, False)):
        fixed = DataLoader(dl.dataset, batch_size=args.per_device_train_batch_size, shuffle=shuffle, drop_last=True,
                           collate_fn=pad_to_length(dl.collate_fn, args.max_seq_length, pad_id),
                           generator=torch.Generator().manual_seed(args.seed))
        loaders.append(prepare_data_loader(fixed, device, num_processes=1, process_index=0, use_seedable_sampler=True))
    train_dl, eval_dl = loaders

    # This process's stages (one, or 2 of 2P): their blocks (and the embeddings / head at the ends); the rest is
    # dropped here. The model needs a block per stage (shared/core/rules.py).
    stage, splits = build_stages(task.model, owners, rank, args.layers_per_stage, f"--schedule {args.schedule}")
    num_stages = len(splits)
    pipes = [pipelining.PipelineStage(s.to(device), i, num_stages, device)
             for s, i in zip(stage_list(stage), owners[rank], strict=True)]
    item_count = {}
    loss_fn = stage_loss(task)  # yours (Task.loss_fn), or the task's cross-entropy
    # Each micro-batch's summed loss is divided by the whole batch's item count, so the micro-batch gradients add
    # up to the batch gradient: scale_grads=False (the default divides them by n_microbatches once more).
    schedule = schedule_cls(pipes if len(pipes) > 1 else pipes[0], n_microbatches=args.n_microbatches,
                            scale_grads=False, loss_fn=lambda out, y: loss_fn(out, y) / item_count["n"])
    # GPT-2's lm_head is its token embedding: the first and last stage each hold a copy, whose gradients are summed.
    tied = [t for t in map(tied_weight, stage_list(stage)) if t is not None]
    tie_group = dist.new_group([r for r, held in owners.items() if {0, num_stages - 1} & set(held)])  # every process
    last_rank = next(r for r, held in owners.items() if num_stages - 1 in held)  # the loss is computed there
    bubble = bubble_report(schedule, splits, world, args.n_microbatches)  # idle share, from its action lists; 1F1B's

    max_steps = total_steps(launch, accelerator, train_dl, already_split=True)  # this process's own batches
    optimizer, scheduler = optimizer_and_scheduler(launch, stage, max_steps)
    checkpoint_per_process(accelerator, stage, optimizer, scheduler)  # each process saves its own stages
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
        item_count["n"] = task.count_items(batch)  # the loss is over the whole batch: divide by all its items
        losses = []
        last = {"target": batch["labels"], "losses": losses, "return_outputs": False} if stage.is_last else {}
        schedule.step(*((x,) if stage.is_first else ()), **mask, **last)  # V: process 0 holds the first and last
        sum_tied_grads(tied, tie_group)
        clip_global_grad_norm(stage, launch.max_grad_norm, skip=tied[-1] if tied and stage.is_last else None)
        optimizer.step()
        scheduler.step()
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=last_rank)  # the last stage computed it; every process logs it
        # Each sample passes through every stage once: count it on the last stage only.
        meter.record(step, loss, batch if stage.is_last else [])
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    meter.summary()  # measured before the save, which comes first: an interrupted evaluation leaves the model
    if not args.no_save_model:
        save_stage_shards(accelerator, launch.output_dir, task, stage, rank, num_stages, tied or None)
    metrics = evaluate(task, schedule, stage, eval_dl, item_count, last_rank=last_rank)
    params = gather_object([sum(p.numel() for p in stage.parameters())])
    extras = {"schedule": args.schedule, "n_microbatches": args.n_microbatches, **bubble,
              "stage_layers": [[r.start, r.stop] for r in splits], "process_stages": gather_object([owners[rank]]),
              "stage_param_count": params, "tied_weight_copies": 2 if tied else 0}
    results = collect_results(accelerator, launch, task, meter, metrics, extras)
    return write_results(accelerator, launch, results)


if __name__ == "__main__":
    main()
