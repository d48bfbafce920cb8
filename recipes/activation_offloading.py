"""Activation offloading: the tensors autograd saves for backward move to host memory in forward and come back in
backward (torch's saved-tensor hooks; on CUDA pinned memory and a side stream, so the copies overlap compute).
Device memory then holds the weights, the optimizer state and the small tensors; the activations wait on the host.

--offload_mode all           every saved tensor of at least --offload_min_bytes
--offload_mode checkpointed  on top of HF activation checkpointing (non-reentrant): only the blocks' inputs, the
                             one tensor per block that checkpointing keeps (--offload_to disk: to files in
                             --offload_dir, removed once read back)
results.json reports the ledger: bytes left on the device and moved to the host, counted on live tensors (peak),
and the copies' host time. On a CPU-only machine host and device are the same memory: the figures say what would
leave a GPU, and nothing is saved here (docs/activation_offloading.md).
    accelerate launch recipes/activation_offloading.py --task causal-lm --offload_mode checkpointed
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/activation_offloading.py
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import number, parse_args
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
from shared.techniques import fsdp_launch
from shared.techniques.activation_offload import MIN_BYTES, ActivationOffloader

RECIPE = "activation_offloading"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# Saved-tensor hooks around forward: one process, DDP and FSDP2 run (tests/test_activation_offloading.py).
SUPPORT = Support(fsdp=fsdp_launch.STEPS,  # an FSDP launch: its settings checked, FSDP2 on CPU
                  shardings=("none", "ddp", "fsdp"),
                  instead="one process, accelerate_configs/multi_cpu.yaml (DDP) or fsdp.yaml",
                  why_not="its saved-tensor hooks have not been run with DeepSpeed's engine here")


def add_args(p):
    p.add_argument("--offload_mode", default="all", choices=("all", "checkpointed"),
                   help="all: every saved tensor; checkpointed: HF checkpointing on, only the blocks' inputs move.")
    p.add_argument("--offload_min_bytes", type=number(int, low=0), default=MIN_BYTES,
                   help="Saved tensors smaller than this stay on the device (the copy would cost more than it frees).")
    p.add_argument("--offload_to", default="cpu", choices=("cpu", "disk"), help="Host memory, or files (checkpointed).")
    p.add_argument("--offload_dir", default=None, help="With --offload_to disk: where the files go.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, activation_offload=args.offload_mode,
                            activation_offload_to=args.offload_to, activation_offload_dir=bool(args.offload_dir),
                            flags={"activation_offload": f"--offload_mode {args.offload_mode}"})
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
        fsdp_plugin=launch.fsdp_plugin,  # an FSDP launch config's settings, checked (shared/techniques/fsdp_launch.py)
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)
    if args.offload_mode == "checkpointed":  # checkpointing keeps each block's input only: that is what moves
        task.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    offloader = ActivationOffloader(accelerator.unwrap_model(model), args.offload_mode, args.offload_min_bytes,
                                    args.offload_to, args.offload_dir)  # hooks on the model's blocks and inputs
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        # Normalize by the items (target tokens or samples) of the global batch: gradients are averaged over
        # processes, and each process's own mean would weigh a token differently from one big batch.
        num_items = accelerator.reduce(task.count_items(batch), "sum") / accelerator.num_processes
        with offloader:  # what forward saves for backward goes to the host; backward brings it back
            loss = task.loss(model, batch, num_items)
        accelerator.backward(loss)
        if launch.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss or a collapsed fp16 loss scale: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps)

    offloader.close()  # hooks off, no file left
    return finish(accelerator, launch, task, model, eval_dl, meter, extras={
        **offloader.ledger.summary(), "offload_mode": args.offload_mode, "offload_to": args.offload_to,
        "offload_min_bytes": args.offload_min_bytes, "host_is_device": not torch.cuda.is_available()})


if __name__ == "__main__":
    main()
