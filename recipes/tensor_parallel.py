"""Tensor parallel with torch.distributed.tensor.parallel: every block's attention and MLP matrices are split over
the processes of a tensor-parallel group (Megatron's layout: the first of each pair column-wise, the second row-wise,
one all-reduce after each pair in forward and one in backward); embeddings, norms and the head are replicated. Each
process holds 1/tp of the block weights, their gradients and their AdamW moments; a group computes on one batch.

--tp_size N: a 2-D mesh (dp, tp) = (processes / N, N). TP inside each group of N, then FSDP2 (fully_shard over
the "dp" dimension) across the groups, in torchtitan's order (TP, activation checkpointing, compile, FSDP); the
groups read different batches. Unset: one group of all processes (a 1-D mesh, no data parallel).
The split follows the model's own plan where its config ships one (base_model_tp_plan: Llama, Qwen, Mistral,
Mixtral ..., the embedding and head split over the vocabulary too), else the plans written here for GPT-2, BERT and
ViT. gloo on CPU.
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/tensor_parallel.py --task causal-lm \
        --model_preset tiny-llama   # or --model_name_or_path <a local Llama / Qwen directory>
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/tensor_parallel.py --task causal-lm
    accelerate launch --config_file accelerate_configs/tp2_dp2.yaml recipes/tensor_parallel.py --tp_size 2
Its own mesh, not Accelerate's ParallelismConfig(tp_size, dp_shard_size): Accelerate takes only a model transformers
already split, and its TP x FSDP2 prepare() imports a class transformers 5.24 lacks (docs/hsdp.md).
Global batch = --per_device_train_batch_size x data-parallel groups. --checkpointing_steps: each process writes its
shards (torch.distributed.checkpoint); resume on any mesh of the same global batch (docs/resharding.md). Saves one
consolidated model.safetensors (each shard gathered with full_tensor()) that from_pretrained loads in one process.
"""

import dataclasses
import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather_object
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import model_config, transformer_layers
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.async_checkpoint import async_checkpoints
from shared.techniques.tensor_parallel import (
    apply_plan,
    checkpoint_dtensors,
    clip_grad_norm,
    family_of,
    local_param_counts,
    mesh_shape,
    plain,
    prepare_blocks,
    save_consolidated,
    shard_vocab,
    vocab_loss,
)

RECIPE = "tensor_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# One TP group of all processes, or --tp_size N groups with FSDP2 across them on a (dp, tp) mesh it builds itself;
# the launch is a plain multi-process one.
SUPPORT = Support(shardings=("ddp",), min_processes=2, async_checkpoint=True, reshards=True,
                  no_fp16="its loss scaler is not wired to the sharded gradients",
                  instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: the "
                          "tensor-parallel degree), or tp2_dp2.yaml with --tp_size 2 (TP x FSDP2)",
                  no_compile="its blocks are split with parallelize_module outside accelerator.prepare(), so "
                             "nothing would compile them (DTensor blocks under inductor were not run here)")


def add_args(p):
    p.add_argument("--tp_size", type=COUNT, default=None,
                   help="Processes per tensor-parallel group; FSDP2 across the groups. Unset: all processes.")
    p.add_argument("--shard_vocab", action="store_true",
                   help="Causal LM: the embedding and head split over the vocabulary too, the loss on sharded logits.")
    p.add_argument("--gradient_checkpointing", action="store_true",
                   help="HF non-reentrant activation checkpointing of each block, applied after TP and before FSDP2.")


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, tensor_parallel_size=args.tp_size or 0, shard_vocab=args.shard_vocab,
                            task=args.task, flags={"tensor_parallel_size": "--tp_size"})
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
    from torch.distributed.fsdp import fully_shard
    device = accelerator.device
    dp, tp = mesh_shape(accelerator.num_processes, args.tp_size)
    launch = dataclasses.replace(launch, data_parallel_size=dp)  # the global batch kept on another mesh (reshard)
    # The model's own plan or ours; refused from its config (no plan, heads that do not split) before weights load.
    family = family_of(model_config(args), tp, args.shard_vocab)
    task = load_task(launch, accelerator)  # the same seed on every process: each starts from the same whole model
    model = task.model.to(device)

    # ---- the technique: a (dp, tp) mesh, rank = dp_rank * tp + tp_rank; each block's matrices split over "tp"
    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    prepare_blocks(model, tp)  # GPT-2: Conv1D -> nn.Linear, its fused qkv grouped per process, heads per process
    plan = apply_plan(model, family, mesh["tp"])  # the weights become DTensors: this process keeps its shard
    if args.shard_vocab:
        shard_vocab(model, mesh["tp"])  # GPT-2's tied embedding and head: Shard(0) of one [vocab, hidden] matrix
    if args.gradient_checkpointing:  # then activation checkpointing (compile would come next)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if dp > 1:  # then FSDP2 across the groups: each block, then the root (embeddings, head); gradients averaged
        for block in transformer_layers(model):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    # Not accelerator.prepare(model): DDP would all-reduce gradients that TP (and FSDP2) already made whole.
    # The processes of a group read the same batches; the groups read different ones.
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh.get_group("dp")
    train_dl, eval_dl = (prepare_data_loader(dl, device, num_processes=dp, process_index=dp_rank,
                                             use_seedable_sampler=True)
                         for dl in (task.train_dataloader, task.eval_dataloader))

    max_steps = total_steps(launch, accelerator, train_dl, already_split=True)  # this process's own batches
    optimizer, scheduler = optimizer_and_scheduler(launch, model, max_steps)
    checkpoint_dtensors(accelerator, model, optimizer, scheduler, {"dp": dp, "tp": tp})  # each process its shards
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
        # Normalize by the global batch's items: FSDP2 averages the groups' gradients (dp = 1: this batch's).
        num_items = task.count_items(batch).to(device)
        dist.all_reduce(num_items, group=dp_group)
        with accelerator.autocast(), vocab_loss(args.shard_vocab):  # --shard_vocab: the loss on sharded logits
            loss = task.loss(model, batch, num_items / dp)
            loss.backward()
        loss = plain(loss)
        clip_grad_norm(model, launch.max_grad_norm)  # sharded gradients' squares summed over the processes
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch if mesh["tp"].get_local_rank() == 0 else [])  # each batch counts once
        guard.check(step, loss)  # a non-finite loss: stop
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps, writes=writes)

    extras = {"tensor_parallel_size": tp, "data_parallel_size": dp, "mesh": mesh.mesh.tolist(),
              "global_batch_size": launch.per_device_train_batch_size * dp, "tp_plan": plan,
              "local_param_counts": gather_object([local_param_counts(model)])}  # per process: its shards + the rest
    with accelerator.autocast():  # the model is not Accelerate's: its evaluation autocasts here
        return finish(accelerator, launch, task, model, eval_dl, meter, extras,
                      save=lambda acc, m, t, out: save_consolidated(acc, m, t, out, tp))  # one whole model


if __name__ == "__main__":
    main()
