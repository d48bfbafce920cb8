"""Model FLOPs utilization of a recipe run: its steady-state throughput times the model's training FLOPs per token
(shared/core/flops.py, PaLM / torchtitan convention), over the device's dense bf16 peak. Every results.json carries
these figures (`model_flops_per_token`, `achieved_flops_per_device`, `mfu`); this script makes the runs comparable.

    python benchmarks/mfu.py --task causal-lm --mixed_precision bf16                        # GPT-2 124M, 1024 tokens
    python benchmarks/mfu.py --task causal-lm --mixed_precision bf16 -- --torch_compile regional
    python benchmarks/mfu.py --task text-classification --mixed_precision bf16 --seq 512    # BERT-base
    python benchmarks/mfu.py --recipe fp8 --task causal-lm                                  # FP8 (its own precision)

Each run is a fresh `accelerate launch` of the recipe (one process) on the base preset; arguments after `--` go to
the recipe. Text classification reads a generated CSV of long reviews, so that every sample fills --seq tokens (the
built-in reviews are ~20 tokens, which would measure padding, not the model). Throughput leaves out the first step
(warm-up, and compilation under --torch_compile: the meter's clock starts after it). Appends one JSON line per run
to --out; on a CPU (no peak in the table) MFU is null and the achieved FLOP/s are still reported.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def long_reviews(path: Path, rows: int, words: int, seed: int = 0) -> Path:
    """A CSV of `rows` reviews of `words` words each, labelled by which of two word sets dominates."""
    rng = random.Random(seed)
    good = ["good", "great", "fine", "lovely", "superb", "warm", "bright", "clever"]
    bad = ["bad", "dull", "poor", "weak", "grim", "cold", "flat", "slow"]
    filler = [f"w{i}" for i in range(2000)]
    lines = ["text,label"]
    for _ in range(rows):
        label = rng.randrange(2)
        pool = (good, bad)[label]
        text = " ".join(rng.choice(pool) if rng.random() < 0.2 else rng.choice(filler) for _ in range(words))
        lines.append(f"{text},{label}")
    path.write_text("\n".join(lines) + "\n")
    return path


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="baseline")
    ap.add_argument("--task", default="causal-lm",
                    choices=("causal-lm", "text-classification", "image-classification"))
    ap.add_argument("--model_preset", default="base", choices=("tiny", "base"))
    ap.add_argument("--mixed_precision", default="bf16", choices=("no", "bf16", "fp16", "fp8"))
    ap.add_argument("--seq", type=int, default=1024, help="Tokens per sample (text tasks).")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--label", default=None, help="The row's name in the table (default: recipe + extra flags).")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "mfu.jsonl"))
    ap.add_argument("--timeout", type=int, default=900)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    work = Path(args.out).parent / f"mfu-{args.recipe}-{args.task}-{int(time.time() * 1000)}"
    work.mkdir(parents=True, exist_ok=True)
    recipe_args = ["--task", args.task, "--model_preset", args.model_preset, "--max_train_steps", str(args.steps),
                   "--per_device_train_batch_size", str(args.batch), "--max_eval_samples", str(args.batch),
                   "--per_device_eval_batch_size", str(args.batch), "--logging_steps", str(args.steps),
                   "--no_save_model", "--report_to", "none", "--overwrite_output_dir", "--output_dir", str(work)]
    if args.mixed_precision != "fp8" and args.recipe != "fp8":
        recipe_args += ["--mixed_precision", args.mixed_precision]
    if args.task != "image-classification":
        recipe_args += ["--max_seq_length", str(args.seq)]
    if args.task == "text-classification":
        data = long_reviews(work / "reviews.csv", rows=max(64, 2 * args.batch * args.steps), words=2 * args.seq)
        recipe_args += ["--train_file", str(data), "--text_column", "text", "--label_column", "label",
                        "--max_train_samples", str(args.batch * (args.steps + 1))]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / "single_process.yaml"), str(ROOT / "recipes" / f"{args.recipe}.py"),
           *recipe_args, *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    r = json.loads((work / "results.json").read_text())

    from shared.core.flops import peak_flops

    seq = args.seq if args.task != "image-classification" else None
    # The run's own figures (shared/core/flops.py on its live model: its real vocabulary, LoRA layers and all).
    per_token, achieved = r["model_flops_per_token"], r["achieved_flops_per_device"]
    device = device_name()
    peak = peak_flops(device)
    row = {"label": args.label or " ".join([args.recipe, *extra]).strip(), "recipe": args.recipe, "task": args.task,
           "preset": args.model_preset, "precision": r["mixed_precision"], "compute_dtype": r.get("compute_dtype"),
           "batch": args.batch, "seq": seq, "steps": args.steps, "extra": extra, "device": device,
           "tokens_per_second": r["train_tokens_per_second"], "seconds_per_step": r["seconds_per_step"],
           "flops_per_token": per_token, "achieved_flops": achieved, "peak_flops": peak,
           "mfu": achieved / peak if peak else None, "train_loss": r["train_loss"],
           **{k: r[k] for k in ("compile_s", "steady_step_s", "torch_compile") if k in r}}
    with open(args.out, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a (no peak for this device)"
    print(f"{row['label']} [{args.task} {args.model_preset} {row['precision']}] on {device}: "
          f"{row['tokens_per_second']:,.0f} tokens/s, {achieved / 1e12:.2f} TFLOP/s, MFU {mfu}")
    return row


if __name__ == "__main__":
    main()
