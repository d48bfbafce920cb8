"""The recipe's loop against what a user would run instead: a plain PyTorch loop and the HF Trainer.

    python benchmarks/overhead.py                      # GPT-2 and BERT base presets, 1 process, 3 repeats
    python benchmarks/overhead.py --steps 10 --repeats 5
    python benchmarks/overhead.py --processes 2        # 2-process DDP (gloo on CPU): each system launched as such

The same model (the base preset, same seed), the same batches (the recipes' own data and collator), torch AdamW with
the same groups and schedule, fp32. Each system runs in its own fresh process, the three interleaved per repeat (the
machine's drift hits all alike); seconds per step leave out the first (warm-up) step; the table gives the median and
the spread over repeats. Writes docs/results/overhead.json and prints the table of docs/overhead.md.

With --processes N: the recipe under `accelerate launch` (accelerate_configs/multi_cpu.yaml), the plain loop and the
Trainer under torchrun; the plain loop wraps the model in torch's DDP and each process takes every N-th batch, the
Trainer does its own DDP. Batch per process as in 1 process (the global batch is N x --batch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from shared.core.launch import free_port  # noqa: E402

SYSTEMS = ("recipe", "plain", "trainer")


def _task(task: str, batch: int, seq: int):
    """The recipes' own model, data and collator, built as recipes/baseline.py builds them (1 process)."""
    from accelerate import Accelerator

    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.core.tasks import load_task

    args = parse_args(["--task", task, "--model_preset", "base", "--per_device_train_batch_size", str(batch),
                       "--max_seq_length", str(seq), "--disable_dropout", "--report_to", "none"])
    launch = resolve_launch(args, "baseline")
    return launch, load_task(launch, Accelerator(cpu=True))


def _world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def run_plain(task: str, batch: int, seq: int, steps: int) -> float:
    """A plain PyTorch loop: no Accelerate, no meter, no guard (and torch's DDP when launched with several)."""
    import itertools

    import torch
    import torch.distributed as dist

    from shared.core.optim import optimizer_and_scheduler

    rank, world = _world()
    if world > 1:
        dist.init_process_group("gloo")
    launch, t = _task(task, batch, seq)
    torch.manual_seed(launch.args.seed)
    optimizer, scheduler = optimizer_and_scheduler(launch, t.model, steps)
    t.model.train()
    model = torch.nn.parallel.DistributedDataParallel(t.model) if world > 1 else t.model
    batches = itertools.islice(itertools.cycle(t.train_dataloader), rank, None, world)  # every world-th batch
    times = []
    for _ in range(steps):
        start = time.perf_counter()  # the batch's loading counted, as in the recipe's timing
        b = next(batches)
        loss = t.loss(model, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), launch.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.mean(times[1:])


def run_trainer(task: str, batch: int, seq: int, steps: int, out: str) -> float:
    """transformers' Trainer on the same model, data and collator (AdamW torch, linear schedule, clipping 1.0)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    launch, t = _task(task, batch, seq)
    args = launch.args
    times: list[float] = []

    class Clock(TrainerCallback):
        # From one step's end to the next: the batch's loading and the Trainer's own per-step work counted, as in
        # the recipe's and the plain loop's clocks (a clock started in on_step_begin would leave the loading out).
        def on_train_begin(self, *_a, **_k):
            self.last = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            now = time.perf_counter()
            times.append(now - self.last)
            self.last = now

    targs = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
                              learning_rate=launch.learning_rate, weight_decay=args.weight_decay, max_grad_norm=1.0,
                              lr_scheduler_type="linear", optim="adamw_torch", report_to=[], save_strategy="no",
                              logging_strategy="no", use_cpu=True, seed=args.seed, dataloader_num_workers=0,
                              remove_unused_columns=False, disable_tqdm=True,
                              ddp_backend="gloo" if _world()[1] > 1 else None)
    trainer = Trainer(model=t.model, args=targs, train_dataset=t.train_dataloader.dataset,
                      data_collator=t.train_dataloader.collate_fn, callbacks=[Clock()])
    trainer.train()
    if targs.world_size != _world()[1]:  # the Trainer must have run the DDP it was launched for
        raise SystemExit(f"the Trainer ran {targs.world_size} process(es), launched {_world()[1]}")
    return statistics.mean(times[1:])


def run_recipe(task: str, batch: int, seq: int, steps: int, out: str, processes: int = 1) -> float:
    launch = ([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / "multi_cpu.yaml"), "--num_processes", str(processes)]
              if processes > 1 else [sys.executable])
    subprocess.run([*launch, str(ROOT / "recipes" / "baseline.py"), "--task", task, "--model_preset", "base",
                    "--per_device_train_batch_size", str(batch), "--max_seq_length", str(seq), "--disable_dropout",
                    "--max_train_steps", str(steps), "--report_to", "none", "--no_save_model", "--max_eval_samples",
                    "8", "--overwrite_output_dir", "--output_dir", out], check=True, capture_output=True)
    return json.loads((Path(out) / "results.json").read_text())["seconds_per_step"]


def worker(system: str, task: str, batch: int, seq: int, steps: int, out: str) -> float:
    if system == "plain":
        return run_plain(task, batch, seq, steps)
    if system == "trainer":
        return run_trainer(task, batch, seq, steps, out)
    return run_recipe(task, batch, seq, steps, out)


def measure(system: str, task: str, args: argparse.Namespace, out: str, env: dict) -> float:
    """One fresh measurement: the worker in its own process(es)."""
    if system == "recipe" and args.processes > 1:  # accelerate launch starts its own processes
        return run_recipe(task, args.batch, args.seq, args.steps, out, args.processes)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.processes),
               "--master_port", str(free_port())] if args.processes > 1 else [sys.executable])
    cmd = [*launch, __file__, "--worker", f"{system},{task},{out}", "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])["seconds_per_step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="causal-lm,text-classification")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--processes", type=int, default=1, help="DDP processes per system (gloo on CPU).")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # system,task,out: one measurement
    p.add_argument("--output", default=None, help="Default: docs/results/overhead.json (overhead_ddpN.json).")
    args = p.parse_args()
    if args.worker:
        system, task, out = args.worker.split(",")
        seconds = worker(system, task, args.batch, args.seq, args.steps, out)
        if _world()[0] == 0:
            print(json.dumps({"seconds_per_step": seconds}))
        return
    threads = max(1, (os.cpu_count() or 1) // args.processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    output = args.output or str(ROOT / "docs" / "results" / (
        "overhead.json" if args.processes == 1 else f"overhead_ddp{args.processes}.json"))
    results: dict[str, dict[str, list[float]]] = {}
    for task in args.tasks.split(","):
        results[task] = {s: [] for s in SYSTEMS}
        for r in range(args.repeats):
            for system in SYSTEMS:  # interleaved
                out = f"/tmp/overhead-{system}-{task}-{r}"
                results[task][system].append(measure(system, task, args, out, env))
    import torch

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
    summary = {"machine": machine, "batch": args.batch, "seq": args.seq, "steps": args.steps,
               "repeats": args.repeats, "processes": args.processes, "seconds_per_step": results}
    Path(output).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"Machine: {machine}. Base presets, fp32, {args.processes} process(es), batch {args.batch} x {args.seq} "
          "tokens per process, "
          f"{args.steps} steps (the first left out), median (min-max) of {args.repeats} interleaved repeats.\n")
    print("| model | recipe s/step | plain loop s/step | Trainer s/step | recipe / plain | recipe / Trainer |")
    print("|---|---|---|---|---|---|")
    for task, r in results.items():
        med = {s: statistics.median(v) for s, v in r.items()}
        spread = {s: f"{med[s]:.3f} ({min(v):.3f}-{max(v):.3f})" for s, v in r.items()}
        model = {"causal-lm": "GPT-2 124M", "text-classification": "BERT-base"}.get(task, task)
        print(f"| {model} | {spread['recipe']} | {spread['plain']} | {spread['trainer']} | "
              f"{med['recipe'] / med['plain']:.3f} | {med['recipe'] / med['trainer']:.3f} |")


if __name__ == "__main__":
    main()
