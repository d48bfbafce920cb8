"""Ray Train: a recipe's main() on N Ray workers. TorchTrainer starts the workers and their process group (gloo on
CPU, NCCL on GPUs) and sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR, which the recipe's Accelerator joins as it
joins torchrun's: the same loop, checkpoints and results.json as under `accelerate launch`.
    pip install -r examples/ray/requirements.txt
    python examples/ray/train_ray.py --num_workers 2 recipes/data_parallel.py --output_dir /shared/run  # CPU
    python examples/ray/train_ray.py --num_workers 16 --use_gpu recipes/data_parallel.py --output_dir /shared/run
--output_dir: a path every worker sees (an absolute one; on a cluster, shared storage). On a running cluster set
RAY_ADDRESS (or `ray start` first); without one Ray starts a local one. Recipes whose launch config carries the
technique (FSDP, DeepSpeed: accelerate_configs/) need `accelerate launch`; those that set it in code run here.
Resuming: the recipe's own --checkpointing_steps / --resume_from_checkpoint latest (Ray's checkpoints are not used).
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path


def train_loop_per_worker(config: dict) -> None:
    """In every Ray worker: the recipe's main() with its own flags."""
    spec = importlib.util.spec_from_file_location("recipe", config["recipe"])
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    recipe.main(config["argv"])


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num_workers", type=int, default=2, help="Ray workers: one training process each.")
    p.add_argument("--use_gpu", action="store_true", help="One GPU per worker, NCCL (else CPU workers, gloo).")
    p.add_argument("recipe", help="recipes/<recipe>.py")
    p.add_argument("recipe_args", nargs=argparse.REMAINDER, help="the recipe's own flags")
    args = p.parse_args(argv)

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"recipe": str(Path(args.recipe).resolve()), "argv": args.recipe_args},
        scaling_config=ScalingConfig(num_workers=args.num_workers, use_gpu=args.use_gpu),
        torch_config=TorchConfig(backend="nccl" if args.use_gpu else "gloo"),
        run_config=RunConfig(name=f"recipes-{Path(args.recipe).stem}"),
    )
    return trainer.fit()


if __name__ == "__main__":
    main()
