"""--torch_compile off / regional / full: the cold-start compile time and the steady-state step time, on one recipe.

    python benchmarks/compile.py                     # tiny GPT-2 (2 blocks, width 64), 20 steps, batch 8 x 128
    python benchmarks/compile.py --model_preset base --steps 8   # GPT-2 124M dimensions

Runs recipes/baseline.py in a fresh process per mode, each with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR in
a new temporary directory): the compile time is the cold start a fresh machine pays. Reads compile_s (the first
step's wall time less the steady step time) and steady_step_s (the median of the later steps) from results.json.
Writes docs/results/compile_<preset>.json and prints the table of docs/compile.md. CPU figures say little about a
GPU, where inductor emits Triton kernels and the step is far shorter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("off", "regional", "full")


def run(mode: str, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(ROOT / "recipes" / "baseline.py"), "--task", "causal-lm", "--model_preset",
           args.model_preset, "--max_train_steps", str(args.steps), "--per_device_train_batch_size", "8",
           "--max_seq_length", "128", "--max_eval_samples", "8", "--per_device_eval_batch_size", "8",
           "--disable_dropout", "--report_to", "none", "--no_save_model",
           "--overwrite_output_dir", "--output_dir", str(out / "run"),
           *(["--torch_compile", mode] if mode != "off" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")}
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=ROOT)
    r = json.loads((out / "run" / "results.json").read_text())
    r["process_s"] = time.perf_counter() - start  # the whole process: imports, data, train, the eval recompile
    r["load_average_1min"] = os.getloadavg()[0]  # a shared machine's other work slows every figure: say how much
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_preset", default="tiny", choices=("tiny", "base"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default=None)
    args = p.parse_args()
    rows = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory() as tmp:
            r = run(mode, Path(tmp), args)
        rows[mode] = {k: r[k] for k in ("compile_s", "first_step_s", "steady_step_s", "seconds_per_step",
                                        "compiled_modules", "initial_loss", "train_loss", "process_s",
                                        "load_average_1min")}
    import torch

    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"{args.threads} threads, torch {torch.__version__}",
              "model": f"GPT-2 {args.model_preset} preset", "steps": args.steps, "batch": "8 x 128 tokens",
              "modes": rows}
    out = Path(args.output or ROOT / "docs" / "results" / f"compile_{args.model_preset}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"Machine: {result['machine']}. {result['model']}, {args.steps} steps, batch {result['batch']}.\n")
    print("| --torch_compile | compile_s | steady_step_s (ms) | vs off | compiled modules | train_loss | process (s) "
          "| load avg |")
    print("|---|---|---|---|---|---|---|---|")
    off = rows["off"]["steady_step_s"]
    for mode, r in rows.items():
        print(f"| {mode} | {r['compile_s']:.1f} | {r['steady_step_s'] * 1e3:.1f} | {off / r['steady_step_s']:.2f}x | "
              f"{r['compiled_modules']} | {r['train_loss']:.4f} | {r['process_s']:.0f} | "
              f"{r['load_average_1min']:.1f} |")


if __name__ == "__main__":
    main()
