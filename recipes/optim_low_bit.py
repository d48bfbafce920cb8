"""Low-bit AdamW in place of torch AdamW: the two moments in 4 bits or FP8 (torchao), or in 8 bits (torchao or
bitsandbytes), with block-wise scales, for the same update rule. Optimizer state per parameter, counted on the live
tensors (docs/quantization.md): 8 bytes for fp32 AdamW, about 2 for the 8-bit and FP8 ones, about 1.1 for 4-bit.

--optim adamw_torchao_4bit | adamw_torchao_fp8 | adamw_torchao_8bit: torchao.optim.AdamW4bit / AdamWFp8 / AdamW8bit,
whose step is compiled (the first step compiles it: tens of seconds on a CPU, cached on disk afterwards).
adamw_bnb_8bit: bitsandbytes' AdamW8bit.
Small tensors keep 32-bit state: torchao quantizes a tensor only if it has >= 4096 elements and a multiple of its
block size (128 for 4-bit, 256 for 8-bit and FP8), judged on each process's shard under FSDP2; bitsandbytes from
4096 elements (min_8bit_size). results.json counts the tensors of each kind.
One process, DDP or FSDP2 (with or without CPU offload): the launch config decides. ZeRO is refused: the optimizer
would step DeepSpeed's flat partitions, often silently in 32 bits. Measured: docs/results/compat.md.
    accelerate launch recipes/optim_low_bit.py --optim adamw_torchao_4bit --task causal-lm
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/optim_low_bit.py --optim adamw_torchao_fp8
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import one_of, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support, offload_of, sharding_of
from shared.core.tasks import load_task
from shared.techniques import fsdp_launch
from shared.techniques.optim_low_bit import compile_each_shard_apart
from shared.techniques.probes import quantized_state_counts

RECIPE = "optim_low_bit"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# torchao's optimizers train under DDP and FSDP2 (benchmarks/compat_sweep.py); ZeRO: a rule of optim_low_bit.py.
SUPPORT = Support(fsdp=fsdp_launch.STEPS,  # an FSDP launch: its settings checked, FSDP2 on CPU
                  shardings=("none", "ddp", "fsdp"), instead="accelerate_configs/multi_cpu.yaml (DDP), fsdp.yaml or "
                  "fsdp_offload.yaml (FSDP2)")
OPTIMIZERS = {"adamw_torchao_4bit": "AdamW4bit", "adamw_torchao_fp8": "AdamWFp8",  # torchao.optim
              "adamw_torchao_8bit": "AdamW8bit", "adamw_bnb_8bit": "AdamW8bit"}  # bitsandbytes.optim


def add_args(p):
    p.add_argument("--optim", default="adamw_torchao_4bit", **one_of(*OPTIMIZERS),
                   help="adamw_torchao_4bit / _fp8 / _8bit: torchao; adamw_bnb_8bit: bitsandbytes.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, optimizer=args.optim, flags={"optimizer": f"--optim {args.optim}"})
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
    # The technique's library, imported once the launch is known to be valid: --help and a refused launch
    # need not wait for its import (seconds).
    if args.optim == "adamw_bnb_8bit":
        import bitsandbytes.optim as library
    else:
        import torchao.optim as library
        if launch.run.sharding == "fsdp":
            compile_each_shard_apart()  # else a rank may run the other's cached step graph
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    # The technique: a low-bit AdamW, same hyperparameters and parameter groups as torch AdamW.
    optim_cls = getattr(library, OPTIMIZERS[args.optim])
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps, optimizer_cls=optim_cls)

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

    # What was really quantized (small tensors keep 32-bit state), under which sharding.
    extras = {"sharding": sharding_of(accelerator), "offload": offload_of(accelerator),
              **quantized_state_counts(optimizer)}
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
