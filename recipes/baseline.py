"""Baseline: plain fp32 fine-tuning with Accelerate, the reference every other recipe is measured against.

One process, DDP on several GPUs, or DDP over gloo on a CPU-only machine: the launch config decides.
    accelerate launch recipes/baseline.py                                  # tiny BERT on built-in data
    accelerate launch recipes/baseline.py --task causal-lm                 # tiny GPT-2
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/baseline.py \
        --task image-classification --model_name_or_path google/vit-base-patch16-224-in21k --train_dir data/
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.args import parse_args
from shared.checkpoint import maybe_save_checkpoint, resume
from shared.data import endless_batches
from shared.launch import build_accelerator
from shared.meter import Meter
from shared.optim import optimizer_and_scheduler, total_steps
from shared.results import finish
from shared.tasks import load_task

RECIPE = "baseline"


def main(argv=None) -> dict:
    args = parse_args(argv, description=__doc__)
    accelerator = build_accelerator(args, RECIPE)
    task = load_task(args, accelerator)
    max_steps = total_steps(args, accelerator, task.train_dataloader)
    optimizer, scheduler = optimizer_and_scheduler(args, task.model, max_steps)

    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        task.model, optimizer, task.train_dataloader, task.eval_dataloader, scheduler
    )
    start_step, consumed = resume(accelerator, args)
    batches = endless_batches(accelerator, train_dl, start_batch=consumed)
    meter = Meter(accelerator, args, task, model, optimizer)

    model.train()
    for step in meter.steps(start_step, max_steps):
        batch = next(batches)
        loss = task.loss(model, batch)
        accelerator.backward(loss)
        if args.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        meter.record(step, loss, batch)  # before zero_grad: the gradients are counted too
        optimizer.zero_grad(set_to_none=True)
        maybe_save_checkpoint(accelerator, args, step + 1, micro_batches=step + 1)

    return finish(accelerator, args, RECIPE, task, model, eval_dl, meter)


if __name__ == "__main__":
    main()
