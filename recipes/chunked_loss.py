"""Chunked cross-entropy: a causal LM's loss computed from its hidden states a chunk of tokens at a time, the lm_head
matmul inside each chunk and the chunk recomputed in backward, so the batch x sequence x vocabulary logits never
exist at once. Same loss and gradients as baseline.py; what it saves: docs/chunked_loss.md.

One process, DDP, ZeRO-1/2/3 or FSDP2: the launch config decides (the head module's own hooks gather its weight).
    accelerate launch recipes/chunked_loss.py                                            # tiny GPT-2
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/chunked_loss.py --loss_chunk_size 512
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/chunked_loss.py \
        --model_name_or_path meta-llama/Llama-3.2-1B --mixed_precision bf16
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DeepSpeedPlugin

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
from shared.core.rules import SHARDINGS, Support, sharding_of
from shared.core.tasks import load_task
from shared.techniques import deepspeed_setup, fsdp_launch
from shared.techniques.chunked_loss import ChunkedLoss
from shared.techniques.deepspeed_setup import (
    add_deepspeed_args,
    launched_deepspeed_config,
    zero3_init,
)

RECIPE = "chunked_loss"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# The head module's own hooks gather it (tests/test_chunked_loss.py).
SUPPORT = Support(fsdp=fsdp_launch.STEPS,  # an FSDP launch: its settings checked, FSDP2 on CPU
                  deepspeed=deepspeed_setup.STEPS,  # a DeepSpeed launch: its agreed settings
                  shardings=SHARDINGS)


def add_args(p):
    p.add_argument("--loss_chunk_size", type=COUNT, default=1024,
                   help="Tokens per chunk. A chunk's fp32 logits take chunk x vocabulary x 4 bytes (196 MiB at GPT-2's "
                        "50257); smaller chunks save a little more and make more head calls (under ZeRO-3, each one "
                        "gathers the head's weight).")
    add_deepspeed_args(p)


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, task="causal-lm")
    ds_config = launched_deepspeed_config(args)  # the launch config chose DeepSpeed: its stage and offload, checked
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config, zero3_init_flag=zero3_init(ds_config)
                             ) if ds_config else None
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, deepspeed_config=ds_config, chunked_loss=True, task=args.task,
                            flags={"chunked_loss": "recipes/chunked_loss.py"})  # a causal LM's vocabulary only
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
        deepspeed_plugin=plugin,  # None: the launch config's sharding (DDP, FSDP) or none
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
    chunked_loss = ChunkedLoss(args.loss_chunk_size, task=task,  # a mixture of experts: its router's loss is added
                               max_tokens=launch.per_device_train_batch_size * args.max_seq_length)
    measured, batches = chunked_loss.measure_first_batch(accelerator, model, batches)  # plain vs chunked bytes

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        # The head runs outside the model's forward here, where Accelerate's autocast does not reach.
        with accelerator.autocast():
            loss = chunked_loss(model, batch, num_items)
        accelerator.backward(loss)  # each chunk's logits are rebuilt here, one chunk at a time
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    extras = {"sharding": sharding_of(accelerator), "loss_chunk_size": args.loss_chunk_size,
              "loss_chunks": chunked_loss.num_chunks, **measured}
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
