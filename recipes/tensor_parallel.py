"""Tensor parallel with torch.distributed.tensor.parallel: every block's attention and MLP matrices are split over
the processes (Megatron's layout: the first of each pair column-wise, the second row-wise, one all-reduce after each
pair in forward and one in backward); embeddings, norms and the head are replicated. Each process holds 1/N of the
block weights, their gradients and their AdamW moments, and all processes compute on the same batch.

GPT-2, BERT and ViT models; the processes form one tensor-parallel group on a 1-D device mesh (gloo on CPU).
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/tensor_parallel.py --task causal-lm
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/tensor_parallel.py --model_preset base
Every process reads the same whole batch: the global batch is --per_device_train_batch_size. Saves one consolidated
model.safetensors (each shard gathered with full_tensor()) that from_pretrained loads in one process.
"""

import sys
from pathlib import Path

from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import GradientAccumulationPlugin, gather_object
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.args import parse_args
from shared.data import endless_batches
from shared.guard import DivergenceGuard
from shared.launch import entrypoint, resolve_launch, start_run
from shared.meter import Meter
from shared.models import transformer_layers
from shared.optim import optimizer_and_scheduler, total_steps
from shared.preflight import stop_if_preflight
from shared.results import collect_results, write_results
from shared.tasks import load_task
from shared.tensor_parallel import (
    PLANS,
    check_flags,
    clip_grad_norm,
    family_of,
    local_param_counts,
    prepare_blocks,
    save_consolidated,
)

RECIPE = "tensor_parallel"


def add_args(p):
    """This recipe's own flags (none: the tensor-parallel degree is the number of processes)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/compat.py).
    launch = resolve_launch(args, RECIPE)
    check_flags(args)  # what this first version does not do yet (fp16, checkpoints), with the way round it
    accelerator = Accelerator(
        cpu=launch.cpu,  # gloo DDP on a CPU-only machine; else each process would train its own copy
        mixed_precision=args.mixed_precision,
        # Sync every k-th micro-batch, counted across epoch ends (not also at each dataloader end).
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,  # stepped once per optimizer step below, not once per process
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),  # resumed runs see the same batches
        log_with=launch.log_with,
        project_dir=args.output_dir,
        kwargs_handlers=launch.kwargs_handlers,  # a timeout for collectives; gloo on a CPU-only machine
        dynamo_plugin=launch.dynamo_plugin,  # --torch_compile: applied in prepare(), after DDP / FSDP / checkpointing
    )
    start_run(accelerator, args, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    world, device = accelerator.num_processes, accelerator.device
    task = load_task(args, accelerator)  # the same seed on every process: each starts from the same whole model
    model = task.model.to(device)

    # ---- the technique: one mesh dimension over all processes, and each block's matrices split over it
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))
    family = family_of(model, world)
    prepare_blocks(model, world)  # GPT-2: Conv1D -> nn.Linear, its fused qkv grouped per process, heads per process
    plan = {name: ColwiseParallel() if style == "colwise" else RowwiseParallel()
            for name, style in PLANS[family].items()}
    for block in transformer_layers(model):
        parallelize_module(block, mesh, plan)  # the weights become DTensors: this process keeps its shard
    # Not accelerator.prepare(model): DDP would all-reduce gradients that are already complete on every process.
    # The data is not split over the processes either: all of them read the same batches, as one process would.
    train_dl, eval_dl = (prepare_data_loader(dl, device, num_processes=1, process_index=0, use_seedable_sampler=True)
                         for dl in (task.train_dataloader, task.eval_dataloader))

    max_steps = total_steps(args, accelerator, train_dl, already_split=True)  # this process's own batches
    optimizer, scheduler = optimizer_and_scheduler(args, model, max_steps)
    batches = endless_batches(accelerator, train_dl)
    stop_if_preflight(accelerator, args, task, model, optimizer)  # --preflight: print the resolved run, stop
    meter = Meter(accelerator, args, task, model, optimizer)
    guard = DivergenceGuard(meter)  # ends a diverging run, its state saved (shared/guard.py)

    model.train()
    for step in meter.steps(0, max_steps):
        batch = next(batches)
        with accelerator.autocast():
            loss = task.loss(model, batch)  # the same whole batch on every process: its own item count
        loss.backward()
        norm = clip_grad_norm(model, args.max_grad_norm)  # sharded gradients' squares summed over the processes
        meter.extras.setdefault("first_step_grad_norm", norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch if accelerator.is_main_process else [])  # the batch counts once
        guard.check(step)  # a non-finite loss: stop
        optimizer.zero_grad(set_to_none=True)

    with accelerator.autocast():
        metrics = task.evaluate(model, eval_dl, accelerator)
    extras = {"tensor_parallel_size": world, "tp_plan": PLANS[family],
              "local_param_counts": gather_object([local_param_counts(model)])}  # per process: its shards + the rest
    results = collect_results(accelerator, args, RECIPE, task, meter, metrics, extras)
    if not args.no_save_model:
        save_consolidated(accelerator, model, task, args.output_dir)
    return write_results(accelerator, args, results)


if __name__ == "__main__":
    main()
