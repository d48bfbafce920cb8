"""Ulysses sequence parallelism for a causal LM on long sequences: each process holds 1/N of every sequence.

Every process reads the same batch and keeps its chunk of each sequence: outside attention its activations are 1/N
of one process's (measured: 0.52x at 256 to 2048 tokens, 2 processes, docs/sequence_parallel.md). Around attention
DeepSpeed's DistributedAttention swaps sequence for heads with one all-to-all per q, k, v and output, so each
process attends over the whole sequence for heads/N. The weights are replicated, their gradients averaged by DDP.
The labels are shifted over the whole sequence before it is split, and each chunk keeps its global positions: the
loss and gradients are one process's on the whole sequence (fp32: 1.4e-7 and 3.1e-6 relative, measured).
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/sequence_parallel.py --task causal-lm
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/sequence_parallel.py --task causal-lm \
        --model_name_or_path gpt2 --max_seq_length 1024
The global batch is --per_device_train_batch_size (the processes split sequences, not samples); --max_seq_length
must be a multiple of the process count, and the heads too. Evaluation is data parallel, whole sequences.
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader

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
from shared.techniques import ulysses as sp

RECIPE = "sequence_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# Ulysses sequence parallel over all processes: each holds a chunk of every sequence.
SUPPORT = Support(shardings=("ddp",), min_processes=2, splits_sequence=True,
                  instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: the "
                          "sequence-parallel degree)")


def add_args(p):
    """This recipe's own flags (none: the sequence-parallel degree is the number of processes)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, task="causal-lm")
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, task=args.task, seq_len=args.max_seq_length)
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
    rank, world = accelerator.process_index, accelerator.num_processes
    sp.enable(task.model, world)  # attention through DeepSpeed's all-to-all (refuses heads that do not split)
    # Every process reads the same whole batches (and keeps its chunk of each sequence in the loop).
    train_dl = prepare_data_loader(task.train_dataloader, accelerator.device, num_processes=1, process_index=0,
                                   use_seedable_sampler=True)
    max_steps = total_steps(launch, accelerator, train_dl, already_split=True)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    # DDP: the replicated weights' gradients, each process's share of the sum, averaged over the processes.
    model, optimizer, eval_dl, scheduler = accelerator.prepare(task.model, optimizer, task.eval_dataloader, scheduler)
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)  # the whole batch, the same on every process
        # The global batch's target tokens, over the processes: DDP's mean of the gradients then weighs every
        # token as one process on the whole sequence would.
        num_items = task.count_items(batch) / world
        chunk = sp.shard(batch, rank, world)  # this process's part of each sequence, labels shifted before the cut
        loss = sp.loss(model, chunk, num_items, task)  # task: a mixture of experts' router loss too
        accelerator.backward(loss)
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        # Each process's loss is its share of the whole batch's: the meter's one logging collective averages them into
        # that loss (no collective of its own per step). The batch counts once.
        meter.record(step, loss, batch if accelerator.is_main_process else [])
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    return finish(accelerator, launch, task, model, eval_dl, meter, extras={"sequence_parallel_size": world})


if __name__ == "__main__":
    main()
