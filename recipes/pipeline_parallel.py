"""Pipeline parallel with torch.distributed.pipelining: the model's blocks are cut into one stage per process;
each global batch is split into micro-batches that flow through the stages, so all stages work at once
(GPipe: all forwards then all backwards; 1F1B: alternate, keeping fewer micro-batches' activations alive).

Each process builds and keeps only its stage's parameters. GPT-2, BERT and ViT models.
    accelerate launch --config_file accelerate_configs/pipeline.yaml recipes/pipeline_parallel.py --task causal-lm
    torchrun --nproc_per_node 2 recipes/pipeline_parallel.py --schedule gpipe --n_microbatches 8
    accelerate launch --config_file accelerate_configs/pipeline.yaml --num_processes 4 \
        recipes/pipeline_parallel.py --model_preset base --layers_per_stage 2,4,4,2
Every process reads the same whole batch (the first stage needs the inputs, the last the labels). Text is padded to
--max_seq_length: stages exchange fixed-shape tensors.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.utils import gather_object
from safetensors.torch import save_file
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils.data import DataLoader

from shared.args import parse_args
from shared.data import endless_batches
from shared.launch import build_accelerator
from shared.meter import Meter
from shared.models import transformer_layers
from shared.optim import optimizer_and_scheduler, total_steps
from shared.pipeline_stages import Stage, pad_to_length, split_layers, stage_inputs, summed_loss, tied_weight
from shared.results import collect_results, write_results
from shared.tasks import load_task

RECIPE = "pipeline_parallel"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def add_args(p):
    p.add_argument("--schedule", default="1f1b", choices=sorted(SCHEDULES))
    p.add_argument("--n_microbatches", type=int, default=4, help="Micro-batches per batch; must divide it.")
    p.add_argument("--layers_per_stage", default=None, help="Blocks per stage, e.g. 1,3. Unset: an even split.")


def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    for flag in ("checkpointing_steps", "resume_from_checkpoint"):
        if getattr(args, flag):
            raise SystemExit(f"--{flag}: this recipe does not checkpoint (each process would save only its stage). "
                             "Use recipes/fsdp.py for resumable sharded training, or drop the flag.")
    if args.per_device_train_batch_size % args.n_microbatches:
        raise SystemExit(f"--per_device_train_batch_size {args.per_device_train_batch_size} is not divisible by "
                         f"--n_microbatches {args.n_microbatches}: pick a batch size that is a multiple of it.")
    if args.gradient_accumulation_steps != 1:
        raise SystemExit("--gradient_accumulation_steps: the micro-batches already accumulate; raise "
                         "--n_microbatches and the batch size instead.")
    args.per_device_eval_batch_size = args.per_device_train_batch_size  # the same micro-batch shape in evaluation
    accelerator = build_accelerator(args, RECIPE)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if world < 2:
        raise SystemExit("A pipeline needs one process per stage: launch 2 or more, e.g. `accelerate launch "
                         "--config_file accelerate_configs/pipeline.yaml recipes/pipeline_parallel.py`.")
    task = load_task(args, accelerator)  # the same seed on every process: each stage starts as the same model

    # Every stage reads the whole batch, in the order a 1-process run would (not a per-process slice).
    pad_id = getattr(task.tokenizer, "pad_token_id", 0) or 0
    loaders = []
    for dl, shuffle in ((task.train_dataloader, True), (task.eval_dataloader, False)):
        fixed = DataLoader(dl.dataset, batch_size=args.per_device_train_batch_size, shuffle=shuffle, drop_last=True,
                           collate_fn=pad_to_length(dl.collate_fn, args.max_seq_length, pad_id),
                           generator=torch.Generator().manual_seed(args.seed))
        loaders.append(prepare_data_loader(fixed, device, num_processes=1, process_index=0, use_seedable_sampler=True))
    train_dl, eval_dl = loaders

    # This process's stage: its blocks (and the embeddings / head at the ends); the rest is dropped here.
    num_layers = len(transformer_layers(task.model))
    layers = split_layers(num_layers, world, args.layers_per_stage)[rank]
    stage = Stage(task.model, layers, is_first=rank == 0, is_last=rank == world - 1).to(device)
    pipe = PipelineStage(stage, rank, world, device)
    item_count = {}
    loss_fn = summed_loss(task.name)
    # Each micro-batch's summed loss is divided by the whole batch's item count, so the micro-batch gradients add
    # up to the batch gradient: scale_grads=False (the default divides them by n_microbatches once more).
    schedule = SCHEDULES[args.schedule](pipe, n_microbatches=args.n_microbatches, scale_grads=False,
                                        loss_fn=lambda out, y: loss_fn(out, y) / item_count["n"])
    # GPT-2's lm_head is its token embedding: the first and last stage each hold a copy, whose gradients are summed.
    tied = tied_weight(stage)
    tie_group = dist.new_group([0, world - 1])  # every process takes part in creating a group

    max_steps = total_steps(args, accelerator, train_dl)
    optimizer, scheduler = optimizer_and_scheduler(args, stage, max_steps)
    batches = endless_batches(accelerator, train_dl)
    meter = Meter(accelerator, args, task, stage, optimizer)

    stage.train()
    for step in meter.steps(0, max_steps):
        batch = next(batches)
        x, mask = stage_inputs(batch)
        item_count["n"] = task.count_items(batch)  # the loss is over the whole batch: divide by all its items
        losses = []
        if stage.is_first:
            schedule.step(x, **mask)
        elif stage.is_last:
            schedule.step(**mask, target=batch["labels"], losses=losses, return_outputs=False)
        else:
            schedule.step(**mask)
        if tied is not None:
            dist.all_reduce(tied.grad, group=tie_group)
        norm = clip_global_grad_norm(stage, args.max_grad_norm, skip=tied if stage.is_last else None)
        meter.extras.setdefault("first_step_grad_norm", norm)
        optimizer.step()
        scheduler.step()
        loss = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
        dist.broadcast(loss, src=world - 1)  # the last stage computed it; every process logs it
        # Each sample passes through every stage once: count it on the last stage only.
        meter.record(step, loss, batch if stage.is_last else [])
        optimizer.zero_grad(set_to_none=True)

    metrics = evaluate(task, schedule, stage, eval_dl, item_count, device, world)
    params = gather_object([sum(p.numel() for p in stage.parameters())])
    extras = {"schedule": args.schedule, "n_microbatches": args.n_microbatches,
              "stage_layers": gather_object([[layers.start, layers.stop]]), "stage_param_count": params,
              "tied_weight_copies": 2 if tied is not None else 0}
    results = collect_results(accelerator, args, RECIPE, task, meter, metrics, extras)
    if not args.no_save_model:
        save_stages(accelerator, args.output_dir, task, stage, tied)
    return write_results(accelerator, args, results)


def clip_global_grad_norm(stage: torch.nn.Module, max_norm: float, skip: torch.Tensor | None) -> float:
    """torch's clip_grad_norm_ over the whole model: each stage sums its squares, the sum is all-reduced.
    Returns the norm before clipping; max_norm 0 only measures it."""
    grads = [p.grad for p in stage.parameters() if p.grad is not None and p is not skip]  # a tied copy counts once
    sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    sq = sq.to(next(stage.parameters()).device)
    dist.all_reduce(sq)
    if max_norm:
        coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
        for p in stage.parameters():
            if p.grad is not None:
                p.grad.mul_(coef)
    return sq.sqrt().item()


@torch.no_grad()
def evaluate(task, schedule, stage, eval_dl, item_count, device, world) -> dict[str, float]:
    """Forward-only through the pipeline; the last stage scores, every process gets the figures."""
    stage.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in eval_dl:
        x, mask = stage_inputs(batch)
        item_count["n"] = 1.0
        if stage.is_first:
            schedule.eval(x, **mask)
        elif stage.is_last:
            losses = []
            logits = schedule.eval(**mask, target=batch["labels"], losses=losses)
            if task.name == "causal-lm":
                total += torch.tensor([torch.stack(losses).sum().item(), task.count_items(batch).item()],
                                      dtype=torch.float64, device=device)
            else:
                hits = (logits.argmax(-1) == batch["labels"]).sum().item()
                total += torch.tensor([hits, batch["labels"].numel()], dtype=torch.float64, device=device)
        else:
            schedule.eval(**mask)
    dist.broadcast(total, src=world - 1)
    stage.train()
    mean = (total[0] / total[1].clamp(min=1)).item()
    if task.name == "causal-lm":
        return {"eval_loss": mean, "eval_perplexity": float(torch.tensor(min(mean, 50.0)).exp())}
    return {"eval_accuracy": mean}


def save_stages(accelerator, output_dir: str, task, stage: Stage, tied: torch.Tensor | None) -> None:
    """Each process writes its stage as one shard of a Hugging Face sharded checkpoint; from_pretrained loads the
    whole model from the shards and the index, and no process ever gathers it."""
    import json

    rank, world = accelerator.process_index, accelerator.num_processes
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    shard = f"model-{rank + 1:05d}-of-{world:05d}.safetensors"
    state = {k: v.detach().cpu().contiguous() for k, v in stage.model.state_dict().items()
             if not (tied is not None and stage.is_last and v.data_ptr() == tied.data_ptr())}
    save_file(state, str(out / shard), metadata={"format": "pt"})
    names = gather_object([(shard, sorted(state))])
    if accelerator.is_main_process:
        weight_map = {name: file for file, keys in names for name in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        task.model.config.save_pretrained(output_dir)
        task.save_preprocessing(output_dir)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
