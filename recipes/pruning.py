"""Gradual magnitude pruning: while fine-tuning, the smallest weights of the transformer blocks' Linear layers are
zeroed step by step until --target_sparsity, then the masks are folded into the weights (a plain model is saved).

Sparsity follows the cubic schedule of Zhu & Gupta (2017): s_t = s_f * (1 - (1 - (t - t0) / (t1 - t0))^3), pruning
fast while many redundant weights remain and slowly near the target, so the network recovers between steps.
--pruning_structure unstructured  single weights (L1 magnitude)
                    rows          whole output rows (L2 norm): the layer could be made physically smaller
                    heads         whole attention heads: their query/key/value rows (L2 norm); grouped-query
                                  attention (Llama): whole groups, a key/value head with the query heads it serves
--pruning_scope     layer         each layer to the target; global: one threshold over all layers, so layers with
                                  many small weights lose more
Zeros alone save nothing in a dense model file or matmul; they pay off with sparse kernels, by slicing pruned rows
or heads out, or by compressing the file. The recipe measures sparsity and the metric, not a speed-up.
    accelerate launch recipes/pruning.py --target_sparsity 0.5 --pruning_scope global
"""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.nn.utils import prune
from transformers.pytorch_utils import Conv1D

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import COUNT, number, parse_args
from shared.core.checkpoint import Preemption, maybe_save_checkpoint, resume
from shared.core.data import endless_batches
from shared.core.errors import LaunchError
from shared.core.guard import DivergenceGuard
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.meter import Meter
from shared.core.models import transformer_layers
from shared.core.optim import optimizer_and_scheduler, total_steps
from shared.core.preflight import stop_if_preflight
from shared.core.results import finish
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.quant import check_linear_only

RECIPE = "pruning"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(instead="a single process or DDP (accelerate_configs/multi_cpu.yaml, multi_gpu.yaml)")
QKV = ("query", "key", "value", "q_proj", "k_proj", "v_proj", "c_attn")


def add_args(p):
    p.add_argument("--target_sparsity", type=number(float, low=0, below=1), default=0.5,
                   help="Fraction of the pruned weights set to 0.")
    p.add_argument("--pruning_scope", default="global", choices=("global", "layer"))
    p.add_argument("--pruning_structure", default="unstructured", choices=("unstructured", "rows", "heads"))
    p.add_argument("--pruning_start_step", type=number(int, low=0), default=0)
    p.add_argument("--pruning_end_step", type=COUNT, default=None, help="Default: 70%% of the training steps.")
    p.add_argument("--pruning_frequency", type=COUNT, default=None, help="Steps between prunings; default: 10 rounds.")


def prunable(model, structure):
    """(name, module, output dim) of the Linear layers in the transformer blocks (GPT-2's Conv1D stores W^T)."""
    found = []
    for i, block in enumerate(transformer_layers(model)):
        for name, m in block.named_modules():
            if isinstance(m, (torch.nn.Linear, Conv1D)) and (structure != "heads" or name.endswith(QKV)):
                found.append((f"{i}.{name}", m, 1 if isinstance(m, Conv1D) else 0))
    return found


def head_masks(model, targets, sparsity, scope):
    """Masks that zero the query/key/value rows of the lowest-norm heads (per block, or over all blocks)."""
    cfg = model.config
    n_heads = cfg.num_attention_heads if hasattr(cfg, "num_attention_heads") else cfg.n_head
    n_heads = getattr(cfg, "num_key_value_heads", None) or n_heads  # GQA: a key/value head and its query heads
    heads = []  # (norm, block, head)
    for name, m, dim in targets:
        w = m.weight.detach().transpose(0, dim)  # output features first
        groups = w.reshape(-1, n_heads, w.shape[0] // (n_heads * (3 if name.endswith("c_attn") else 1)), w.shape[1])
        for h, sq in enumerate(groups.pow(2).sum(dim=(0, 2, 3))):
            heads.append([sq.item(), name.split(".")[0], h])
    scores = {}
    for sq, block, h in heads:
        scores[(block, h)] = scores.get((block, h), 0.0) + sq
    keys = sorted(scores, key=scores.get)
    if scope == "global":
        dropped = set(keys[:round(sparsity * len(keys))])
    else:
        blocks = sorted({b for b, _ in keys})
        dropped = {k for b in blocks for k in [k for k in keys if k[0] == b][:round(sparsity * n_heads)]}
    masks = []
    for name, m, dim in targets:
        mask = torch.ones_like(m.weight.transpose(0, dim).contiguous())  # output features first
        view = mask.reshape(-1, n_heads, mask.shape[0] // (n_heads * (3 if name.endswith("c_attn") else 1)),
                            mask.shape[1])
        for block, h in dropped:
            if block == name.split(".")[0]:
                view[:, h] = 0
        masks.append(mask.transpose(0, dim).contiguous())
    return masks


def apply_sparsity(model, targets, sparsity, args) -> None:
    """Prune to `sparsity` from the current weights. Zeros from earlier rounds have the smallest magnitude, so they
    stay pruned; the previous masks are folded in first so each round starts from plain weights."""
    for _, m, _ in targets:
        if prune.is_pruned(m):
            prune.remove(m, "weight")
    if args.pruning_structure == "unstructured" and args.pruning_scope == "global":
        prune.global_unstructured([(m, "weight") for _, m, _ in targets], prune.L1Unstructured, amount=sparsity)
    elif args.pruning_structure == "unstructured":
        for _, m, _ in targets:
            prune.l1_unstructured(m, "weight", amount=sparsity)
    elif args.pruning_structure == "rows" and args.pruning_scope == "layer":
        for _, m, dim in targets:
            prune.ln_structured(m, "weight", amount=sparsity, n=2, dim=dim)
    elif args.pruning_structure == "rows":  # one threshold on row norms per weight (rows differ in length)
        rows = [m.weight.detach().norm(dim=1 - dim) / m.weight.shape[1 - dim] ** 0.5 for _, m, dim in targets]
        sizes = torch.cat([torch.full_like(r, m.weight.shape[1 - dim])
                           for r, (_, m, dim) in zip(rows, targets, strict=True)])
        order = torch.cat(rows).argsort()
        cut = int((sizes[order].cumsum(0) <= sparsity * sizes.sum()).sum())  # rows to drop, weighted by size
        keep = torch.ones(len(order))
        keep[order[:cut]] = 0
        for (_, m, dim), k in zip(targets, keep.split([len(r) for r in rows]), strict=True):
            mask = k.view(-1, 1).expand_as(m.weight.transpose(0, dim)).transpose(0, dim).contiguous()
            prune.custom_from_mask(m, "weight", mask)
    else:
        for (_, m, _), mask in zip(targets, head_masks(model, targets, sparsity, args.pruning_scope), strict=True):
            prune.custom_from_mask(m, "weight", mask)


def cubic_sparsity(step: int, args, end_step: int) -> float:
    t = min(max(step - args.pruning_start_step, 0) / max(1, end_step - args.pruning_start_step), 1.0)
    return args.target_sparsity * (1 - (1 - t) ** 3)


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
    task = load_task(launch, accelerator)
    check_linear_only(task.model, RECIPE, "prunes")  # refuses experts that are not nn.Linear
    max_steps = total_steps(launch, accelerator, task.train_dataloader)
    end_step = args.pruning_end_step or max(args.pruning_start_step + 1, int(0.7 * max_steps))
    frequency = args.pruning_frequency or max(1, (end_step - args.pruning_start_step) // 10)
    if not args.pruning_start_step < end_step <= max_steps:
        raise LaunchError(f"Need --pruning_start_step < --pruning_end_step <= training steps ({max_steps}); got "
                          f"{args.pruning_start_step} and {end_step}. Adjust them or --max_train_steps.")
    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    targets = prunable(accelerator.unwrap_model(model), args.pruning_structure)
    for _, m, _ in targets:  # masks from the start (all ones): every checkpoint holds them, so any one resumes
        prune.identity(m, "weight")
    start_step, consumed = resume(accelerator, launch, max_steps)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    stop_if_preflight(accelerator, launch, task, model, optimizer, max_steps)  # --preflight: print the run, stop
    meter = Meter(accelerator, launch, task, model, optimizer)
    guard = DivergenceGuard(accelerator, launch, optimizer, max_steps)  # ends a diverging run, its state saved
    preemption = Preemption(accelerator, launch, max_steps)  # SIGTERM, SIGINT, SIGHUP, SIGUSR1: saved, exits

    model.train()
    for step in meter.steps(start_step, max_steps):
        # The technique: at each pruning step, re-prune to the schedule's sparsity (same weights on every process).
        if step <= end_step and (step - args.pruning_start_step) % frequency == 0:
            apply_sparsity(accelerator.unwrap_model(model), targets, cubic_sparsity(step, args, end_step), args)
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

    # Make it permanent: the final masks are folded into the weights and the pruning hooks removed.
    apply_sparsity(accelerator.unwrap_model(model), targets, args.target_sparsity, args)
    for _, m, _ in targets:
        prune.remove(m, "weight")
    zeros = {name: (m.weight == 0).sum().item() for name, m, _ in targets}
    sizes = {name: m.weight.numel() for name, m, _ in targets}
    extras = {"target_sparsity": args.target_sparsity, "pruning_scope": args.pruning_scope,
              "pruning_structure": args.pruning_structure,
              "achieved_sparsity": sum(zeros.values()) / sum(sizes.values()),
              "sparsity_per_layer": {name: zeros[name] / sizes[name] for name in zeros},
              "pruned_weights": sum(zeros.values())}
    return finish(accelerator, launch, task, model, eval_dl, meter, extras=extras)


if __name__ == "__main__":
    main()
