"""What a checkpoint costs the training, written synchronously or in the background (--async_checkpoint).

    python benchmarks/async_checkpoint.py                  # GPT-2 small (base preset), FSDP2 on 2 processes
    python benchmarks/async_checkpoint.py --repeats 3 --steps 11 --every 4 --seq 128

recipes/fsdp.py under accelerate_configs/fsdp.yaml, three runs per repeat, interleaved so the machine's drift hits
all alike: no checkpoints, checkpoints every --every steps written synchronously, and the same with
--async_checkpoint. Same seed, batches and model. In each run (this file as `--worker`, around the recipe's own
main) the main process notes the wall time at every step boundary and inside each checkpoint call:
  - blocked_s: the time the loop stood still in a periodic checkpoint call (sync: the whole write; async: the
    copy of the state into host memory, plus any wait for the previous write);
  - window_s: steps 2 .. N-1 with their checkpoint calls (the last step's checkpoint, written synchronously in both
    runs, is left out), and cost_s = (window_s - window_s without checkpoints) / periodic checkpoints: all a
    checkpoint costs, the background write's competition with training for the CPU included. written_in_window
    says whether the last background write had finished by then (else part of its cost fell outside).
Medians over the repeats. Writes docs/results/async_checkpoint.json and prints the table of docs/async_checkpoint.md.
"""

from __future__ import annotations

import argparse
import importlib.util
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
MODES = ("none", "sync", "async")


def worker(notes: Path, argv: list[str]) -> None:
    """recipes/fsdp.py's main with each checkpoint call timed (this process: one of the launched ones)."""
    import shared.core.checkpoint as checkpoint

    marks: list[dict] = []
    real = checkpoint.maybe_save_checkpoint

    def timed(accelerator, launch, step, micro_batches, max_steps, writes=None):
        start = time.perf_counter()
        in_flight = bool(writes and writes.in_flight())
        real(accelerator, launch, step, micro_batches, max_steps=max_steps, writes=writes)
        marks.append({"step": step, "before": start, "after": time.perf_counter(), "in_flight_before": in_flight})

    checkpoint.maybe_save_checkpoint = timed  # before the recipe imports it
    spec = importlib.util.spec_from_file_location("recipe_fsdp", ROOT / "recipes" / "fsdp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)
    if os.environ.get("RANK", "0") == "0":
        notes.write_text(json.dumps(marks))


def one_run(mode: str, args, out: Path) -> dict:
    from shared.core.launch import free_port

    notes = out / f"{mode}.marks.json"
    flags = ["--task", "causal-lm", "--model_preset", "base", "--max_train_steps", str(args.steps),
             "--per_device_train_batch_size", str(args.batch), "--max_seq_length", str(args.seq),
             "--max_train_samples", str(max(64, 2 * args.batch * args.steps)), "--max_eval_samples", "4",
             "--disable_dropout", "--report_to", "none", "--no_save_model", "--logging_steps", "1",
             "--output_dir", str(out / mode), "--overwrite_output_dir"]
    if mode != "none":
        flags += ["--checkpointing_steps", str(args.every), "--save_total_limit", "2"]
    if mode == "async":
        flags.append("--async_checkpoint")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "accelerate_configs" /
           "fsdp.yaml"), "--main_process_port", str(free_port()), __file__, "--worker", str(notes), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    marks = json.loads(notes.read_text())
    at = {m["step"]: m for m in marks}
    last = args.steps
    periodic = [s for s in at if mode != "none" and s % args.every == 0 and s != last]
    steps = [at[s]["before"] - at[s - 1]["after"] for s in range(2, last + 1)]
    return {
        "window_s": at[last]["before"] - at[1]["after"],
        "blocked_s": [at[s]["after"] - at[s]["before"] for s in periodic],
        "step_s": statistics.median(steps),
        "final_save_s": at[last]["after"] - at[last]["before"],
        "written_in_window": not at[last]["in_flight_before"],
        "checkpoints_in_window": len(periodic),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=11)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", default="/tmp/async_checkpoint_bench")
    p.add_argument("--json", default=str(ROOT / "docs" / "results" / "async_checkpoint.json"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            runs[mode].append(one_run(mode, args, out))
            print(f"repeat {repeat + 1} {mode}: {runs[mode][-1]}", flush=True)
    summary = {}
    for mode in MODES:
        rs = runs[mode]
        row = {"window_s": statistics.median(r["window_s"] for r in rs),
               "step_s": statistics.median(r["step_s"] for r in rs)}
        if mode != "none":
            costs = [(r["window_s"] - n["window_s"]) / r["checkpoints_in_window"] for r, n in zip(rs, runs["none"],
                                                                                                   strict=True)]
            row.update(cost_s=statistics.median(costs), costs_s=costs,
                       blocked_s=statistics.median(b for r in rs for b in r["blocked_s"]),
                       final_save_s=statistics.median(r["final_save_s"] for r in rs),
                       written_in_window=all(r["written_in_window"] for r in rs))
        summary[mode] = row
    state_bytes = sum(f.stat().st_size for f in (out / "sync" / "checkpoints").glob("step_*/**/*.distcp"))
    checkpoints = len(list((out / "sync" / "checkpoints").glob("step_*")))
    result = {
        "machine": "2 CPU cores, no GPU, torch 2.13 CPU, gloo; shared with other jobs while measured",
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "torch": __import__("torch").__version__,
        "setup": {"recipe": "recipes/fsdp.py", "config": "accelerate_configs/fsdp.yaml", "processes": 2,
                  "model": "GPT-2 small (--model_preset base, causal-lm)", **vars(args)},
        "dcp_bytes_per_checkpoint": state_bytes // max(1, checkpoints),
        "summary": summary, "runs": runs,
    }
    Path(args.json).write_text(json.dumps(result, indent=1))
    print("\n| mode | blocked per checkpoint (s) | cost per checkpoint (s) | step (s) |\n|---|---|---|---|")
    for mode in MODES:
        s = summary[mode]
        print(f"| {mode} | {s.get('blocked_s', 0):.2f} | {s.get('cost_s', 0):.2f} | {s['step_s']:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3:])
    else:
        main()
