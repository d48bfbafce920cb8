"""Activation (gradient) checkpointing: keep only each transformer block's input in forward, recompute the rest
in backward. Activation memory then grows with one block instead of all of them, for about one more forward pass.

--checkpointing_impl hf     HF models: model.gradient_checkpointing_enable(), non-reentrant.
--checkpointing_impl torch  torch.utils.checkpoint around each block: how to do it for any custom nn.Module.
Less recompute for less saving (torch impl only): --checkpoint_every K checkpoints blocks K, 2K, ... (1: all);
--checkpointing_policy selective keeps a checkpointed block's matmul and attention outputs too, and recomputes only
the cheap ops (LayerNorm, GELU, dropout, adds), with torch's create_selective_checkpoint_contexts. The
memory / time curve over K: docs/checkpointing.md. Before training, one step on the same batch with and without
checkpointing measures what it saves and costs: the bytes autograd keeps for backward, the bytes forward leaves
alive for backward, the time ratio, and the largest gradient difference (0 up to float rounding); the probe is
shared/techniques/probes.py's checkpointing_probe.
    accelerate launch recipes/activation_checkpointing.py --task causal-lm --max_seq_length 128
    accelerate launch recipes/activation_checkpointing.py --checkpoint_every 2 --checkpointing_policy selective
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch import nn
from torch.utils.checkpoint import checkpoint

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
from shared.techniques.probes import checkpointing_probe
from shared.techniques.selective_checkpointing import checkpoint_kwargs

RECIPE = "activation_checkpointing"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(compiles=True, instead="recipes/combined.py --gradient_checkpointing")


def add_args(p):
    p.add_argument("--checkpointing_impl", default=None, choices=("hf", "torch"),
                   help="Unset: hf; torch when --checkpoint_every > 1 or --checkpointing_policy selective.")
    p.add_argument("--checkpoint_every", type=COUNT, default=1,
                   help="Checkpoint every K-th block (K, 2K, ...); 1: all. Larger K: less recompute, more memory.")
    p.add_argument("--checkpointing_policy", default="full", choices=("full", "selective"),
                   help="full: a checkpointed block keeps its input only. selective: it keeps its matmul and "
                        "attention outputs too and recomputes the cheap ops.")
    p.add_argument("--no_probe", action="store_true",
                   help="Skip the with/without comparison step (its buffers would raise this run's peak memory).")


class CheckpointedBlock(nn.Module):
    """Runs `block` under torch.utils.checkpoint: in backward its activations are recomputed, not read back."""

    def __init__(self, block: nn.Module, policy: str = "full"):
        super().__init__()
        self.block = block
        # selective: the matmul and attention outputs saved in forward, the rest recomputed; full: all recomputed
        self.context = checkpoint_kwargs(policy)

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to recompute
            return self.block(*args, **kwargs)
        # Non-reentrant (checkpoint_kwargs): keyword arguments, inputs without grad, nesting.
        return checkpoint(self.block, *args, **self.context, **kwargs)


def enable_checkpointing(model: nn.Module, impl: str, every: int = 1, policy: str = "full") -> None:
    if impl == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        layers = transformer_layers(model)
        rules.check_built(checkpoint_every=every, layers=len(layers))  # more than the blocks: none checkpointed
        for i, block in enumerate(layers):
            if (i + 1) % every == 0:  # blocks every, 2*every, ...: torchtitan's ac_freq
                layers[i] = CheckpointedBlock(block, policy)


def disable_checkpointing(model: nn.Module, impl: str) -> None:
    """Back to plain blocks, so the saved model has the original layout."""
    if impl == "hf":
        model.gradient_checkpointing_disable()
    else:
        layers = transformer_layers(model)
        for i, block in enumerate(layers):
            layers[i] = block.block if isinstance(block, CheckpointedBlock) else block


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    per_op_or_layer = args.checkpoint_every > 1 or args.checkpointing_policy == "selective"
    asked = {"checkpoint_impl": args.checkpointing_impl or "", "checkpoint_every": args.checkpoint_every,
             "checkpoint_policy": args.checkpointing_policy}  # HF's switch checkpoints all blocks, whole
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, **asked)
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
        dynamo_plugin=launch.dynamo_plugin,  # --torch_compile: applied in prepare(), after DDP / FSDP / checkpointing
    )
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    task = load_task(launch, accelerator)

    # What checkpointing saves and costs, measured on one batch without and with it (shared/core/meter.py).
    impl = args.checkpointing_impl or ("torch" if per_op_or_layer else "hf")
    every, policy = args.checkpoint_every, args.checkpointing_policy
    probe = {} if args.no_probe else checkpointing_probe(task, accelerator.device, lambda m: enable_checkpointing(
        m, impl, every, policy), lambda m: disable_checkpointing(m, impl))
    enable_checkpointing(task.model, impl, every, policy)
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

    disable_checkpointing(accelerator.unwrap_model(model), impl)
    return finish(accelerator, launch, task, model, eval_dl, meter, extras={
        **probe, "checkpointing_impl": impl, "checkpoint_every": every, "checkpointing_policy": policy})


if __name__ == "__main__":
    main()
