"""Model parallel (layers split over devices): one process drives several devices; the model's blocks are cut into
stages, stage s lives on device s, and each block's inputs are moved to its device as the forward reaches it
(autograd moves the gradients back). A model too big for one device fits in several; only one device works at a
time (recipes/pipeline_parallel.py keeps them all busy).

    accelerate launch recipes/model_parallel.py --task causal-lm                    # one stage per GPU (2 or more)
    accelerate launch recipes/model_parallel.py --num_stages 2 --layers_per_stage 1,3 --model_preset base
On a machine with fewer than 2 GPUs the same code places every stage on the CPU, and says so: the split and the
activation hand-offs run, but nothing is spread over memories.
"""

import functools
import logging
import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import send_to_device

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core import rules
from shared.core.args import COUNT, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import transformer_layers
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.pipeline_stages import checkpoint_per_process, split_layers

RECIPE = "model_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(shardings=("none",), max_processes=1,
                  instead="recipes/data_model_parallel.py for stages with data-parallel replicas",
                  no_compile="its model is left out of accelerator.prepare() (it places the blocks over the devices "
                             "itself), so nothing would compile it")
logger = logging.getLogger("recipes")


def add_args(p):
    p.add_argument("--num_stages", type=COUNT, default=None,
                   help="Unset: one stage per visible GPU; on a machine with fewer than 2 GPUs, 2 stages on the CPU.")
    p.add_argument("--layers_per_stage", default=None, help="Blocks per stage, e.g. 1,3. Unset: an even split.")


def stage_devices(num_stages: int | None) -> list[torch.device]:
    count = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    if count >= 2:
        kind = torch.accelerator.current_accelerator().type
        n = num_stages or count
        rules.check_built(stages=n, devices=count, device_kind=kind, flags={"stages": "--num_stages"})
        return [torch.device(kind, i) for i in range(n)]
    n = num_stages or 2
    logger.warning("Fewer than 2 GPUs: placing all %d stages on the CPU (the same code; no memory is split).", n)
    return [torch.device("cpu")] * n


def _inputs_to(device, module, args, kwargs):
    return send_to_device(args, device), send_to_device(kwargs, device)


def place_stages(model: torch.nn.Module, layer_ranges: list[range], devices: list[torch.device]) -> None:
    """Blocks of stage s on devices[s]; embeddings, final norm and head on devices[0] (GPT-2's head is its
    embedding matrix). A pre-forward hook moves each module's inputs to the device of its weights."""
    model.to(devices[0])
    blocks = transformer_layers(model)
    for layers, device in zip(layer_ranges, devices, strict=True):
        for i in layers:
            blocks[i].to(device)
            blocks[i].register_forward_pre_hook(functools.partial(_inputs_to, device), with_kwargs=True)
    in_blocks = {id(p) for p in blocks.parameters()}
    for module in model.modules():  # after the last block: activations come back to the head's device
        own = [p for p in module.parameters(recurse=False) if id(p) not in in_blocks]
        if own:
            module.register_forward_pre_hook(functools.partial(_inputs_to, own[0].device), with_kwargs=True)


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT)
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
    devices = stage_devices(args.num_stages)
    task = load_task(launch, accelerator)
    blocks = transformer_layers(task.model)
    layer_ranges = split_layers(len(blocks), len(devices), args.layers_per_stage)
    place_stages(task.model, layer_ranges, devices)
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    # The model is left out of prepare(): Accelerate would move all of it to one device.
    optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    model = task.model
    # Left out of prepare(), the model is left out of save_state() too: its checkpoints save and load it here.
    checkpoint_per_process(accelerator, model, optimizer, scheduler)
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        with accelerator.autocast():  # the model is not prepared, so mixed precision is turned on here
            loss = task.loss(model, batch)
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

    in_blocks = {id(p) for p in blocks.parameters()}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)  # embeddings and head: stage 0
    counts = [sum(p.numel() for i in r for p in blocks[i].parameters()) + (rest if s == 0 else 0)
              for s, r in enumerate(layer_ranges)]
    extras = {"stage_devices": [str(d) for d in devices], "stages_on_cpu": all(d.type == "cpu" for d in devices),
              "stage_layers": [[r.start, r.stop] for r in layer_ranges], "stage_param_count": counts,
              "param_devices": sorted({str(p.device) for p in model.parameters()})}
    return finish(accelerator, launch, task, model, eval_dl, meter, extras)


if __name__ == "__main__":
    main()
