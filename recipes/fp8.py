"""FP8 training: the inner Linears run their matmuls in float8 (torchao's Float8Linear), through Accelerate.

Accelerate's mixed_precision="fp8" with the torchao backend (AORecipeKwargs) swaps every nn.Linear for a Float8Linear
in prepare(), except the first and last Linear and any whose dims are not multiples of 16
(shared/techniques/fp8.py names the rule; results.json lists what was converted and what was kept). Each
converted matmul casts its inputs to e4m3 (gradients e5m2) with one dynamic scale per tensor and calls
torch._scaled_mm; everything else runs in bf16 autocast.
It pays only on a GPU with FP8 tensor cores (H100, Ada) and large matmuls: at small sizes the casts cost more than
the faster matmul saves (docs/fp8.md). On a CPU it runs, for checking, at no gain.
    accelerate launch recipes/fp8.py                                       # tiny BERT on built-in data
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/fp8.py
    accelerate launch recipes/fp8.py --task image-classification         # tiny ViT
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import AORecipeKwargs

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
from shared.techniques.fp8 import check_fp8_launch_config, check_fp8_resolved, fp8_summary, save_fp8_model

RECIPE = "fp8"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# Accelerate's fp8 with torchao: one process and DDP over gloo measured (tests/test_fp8.py). FSDP2 (float8
# all-gather of DTensor shards) and DeepSpeed were not run on this stack: refused rather than assumed.
SUPPORT = Support(precision="fp8", instead="one process or DDP (accelerate_configs/single_process.yaml, "
                  "multi_cpu.yaml, multi_gpu.yaml)",
                  why_not="FP8 under FSDP2 or DeepSpeed has not been run here (torchao's float8 all-gather of "
                          "FSDP2 shards is the route to try on a GPU)")


def add_args(p):
    """This recipe's own flags (none: Accelerate's default Float8LinearConfig, tensorwise scaling)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    # The precision is this recipe's own: fp8 (args.py's --mixed_precision offers no fp8; other values refused).
    check_fp8_launch_config()  # a launch config's fp8_config: torchao's backend (AO), or refused before anything loads
    launch = resolve_launch(args, RECIPE, SUPPORT, default_mixed_precision="fp8")
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=launch.mixed_precision,
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=launch.output_dir,
        # torchao's float8 (imported by AORecipeKwargs, after resolve_launch has silenced its load noise):
        # the default filter keeps the first/last Linear and dims not multiple of 16 in high precision.
        kwargs_handlers=[*launch.kwargs_handlers, AORecipeKwargs()],  # + a timeout for collectives
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    check_fp8_resolved(accelerator)  # Accelerate turns fp8 into fp16 on an older GPU: stop instead
    task = load_task(launch, accelerator)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )  # prepare() converts the Linears to Float8Linear in place (same Parameters: the optimizer still holds them)
    fp8 = fp8_summary(accelerator, model)  # what was converted and kept; stops if nothing was
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

    return finish(accelerator, launch, task, model, eval_dl, meter, extras=fp8, save=save_fp8_model)


if __name__ == "__main__":
    main()
