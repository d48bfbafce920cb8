"""Expert parallel for a mixture of experts, with Transformers' own plan (config.base_model_ep_plan): each process
holds 1/N of every MoE layer's experts, whole, and each token goes to the process of the experts its router picked
by all-to-all (transformers' AllToAllEP: the tokens there, the outputs back), on its own batch. The other weights
(attention, router, norms, embeddings, head) are FSDP2-sharded over the same N processes: data parallel over them.
Each process holds 1/N of the experts, of the rest, of their gradients and of their AdamW moments.
The router's load-balancing loss is the global batch's (its route counts and probabilities summed over the
processes): loss and gradients are one process's on the whole batch (fp32, measured in tests/test_expert_parallel.py).
Models whose config has a base_model_ep_plan (Mixtral, Qwen-MoE, ...; run: --model_preset tiny-moe); gloo on CPU.
    accelerate launch --config_file accelerate_configs/multi_cpu.yaml recipes/expert_parallel.py
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/expert_parallel.py \
        --model_name_or_path mistralai/Mixtral-8x7B-v0.1 --mixed_precision bf16
Global batch = --per_device_train_batch_size x processes; the experts per layer must split over the processes.
results.json: tokens per expert (load balance), each process's expert and dense parameters, and its bytes.
--checkpointing_steps: each process writes its shards (torch.distributed.checkpoint); resume on as many processes.
Saves one consolidated model.safetensors that from_pretrained loads in one process.
"""

import sys
from pathlib import Path

import torch.distributed as dist
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather_object

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import model_config
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques import expert_parallel as ep
from shared.techniques.async_checkpoint import async_checkpoints
from shared.techniques.tensor_parallel import checkpoint_dtensors, clip_grad_norm

RECIPE = "expert_parallel"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
# The experts split over all processes, tokens sent to them by all-to-all, the dense weights FSDP2-sharded over
# the same processes, each reading its own batches.
SUPPORT = Support(shardings=("ddp",), min_processes=2, async_checkpoint=True,
                  no_fp16="its loss scaler is not wired to the sharded gradients",
                  instead="accelerate_configs/multi_cpu.yaml or multi_gpu.yaml (2 or more processes: the "
                          "expert-parallel degree, a divisor of the experts per layer)",
                  no_compile="its model is distributed by Transformers' expert-parallel and FSDP2 plans outside "
                             "accelerator.prepare(), so nothing would compile it (all-to-all dispatch under "
                             "inductor was not run here)")


def add_args(p):
    """This recipe's own flags (none: the experts split over all processes, each reading its own batches)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__, task="causal-lm", model_preset="tiny-moe")
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
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    ep.check_config(model_config(args), world)  # from the config, before the weights: a plan, experts that split
    task = load_task(launch, accelerator)  # the same seed on every process: each starts from the same whole model
    model = task.model.to(device)

    # ---- the technique: the model's expert-parallel plan (experts split over all processes, tokens dispatched by
    # all-to-all), then FSDP2 over the same processes for every other weight; both from Transformers
    ep.distribute(model, world)
    held = ep.local_param_counts(model)  # at rest, before a forward gathers any shard
    ep.global_router_loss(model)  # the load-balancing loss of the global batch, as one process would compute it
    load = ep.ExpertLoad(model)  # tokens per expert, counted from the router's choices
    # Not accelerator.prepare(model): DDP would all-reduce gradients that FSDP2 and the all-to-all already reduce.
    train_dl, eval_dl = (prepare_data_loader(dl, device, num_processes=world, process_index=rank,
                                             use_seedable_sampler=True)
                         for dl in (task.train_dataloader, task.eval_dataloader))

    max_steps = total_steps(launch, accelerator, train_dl, already_split=True)  # this process's own batches
    optimizer, scheduler = optimizer_and_scheduler(launch, model, max_steps)
    checkpoint_dtensors(accelerator, model, optimizer, scheduler, {"ep": world, "fsdp": world})  # each its shards
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
        # Normalize by the global batch's items: FSDP2 averages the processes' gradients, the experts' too.
        num_items = task.count_items(batch).to(device)
        dist.all_reduce(num_items)
        with accelerator.autocast():
            loss = task.loss(model, batch, num_items / world)
            loss.backward()
        clip_grad_norm(model, launch.max_grad_norm)  # sharded gradients' squares summed over the processes
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        guard.check(step, loss)  # a non-finite loss: stop, state saved
        optimizer.zero_grad(set_to_none=True)
        preemption.check(step + 1, micro_batches=step + 1)  # agreed at logging steps; saved, exits
        maybe_save_checkpoint(accelerator, launch, step + 1, micro_batches=step + 1, max_steps=max_steps, writes=writes)

    extras = {"expert_parallel_size": world, "data_parallel_size": world, "ep_plan": model.config.base_model_ep_plan,
              "experts_per_process": ep.num_experts(model.config) // world,
              "global_batch_size": launch.per_device_train_batch_size * world, **load.report(world),
              "local_param_counts": gather_object([held])}  # per process: its shards
    with accelerator.autocast():  # the model is not Accelerate's: its evaluation autocasts here
        return finish(accelerator, launch, task, model, eval_dl, meter, extras, save=ep.save_consolidated)


if __name__ == "__main__":
    main()
