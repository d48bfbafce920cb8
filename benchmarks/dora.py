"""DoRA beside LoRA: trainable parameters and step time as ratios, on the same 4-bit model, data and steps.

    python benchmarks/dora.py            # a width-256 GPT-2 (2 blocks), 4-bit NF4, 30 steps, 3 runs of each

Runs recipes/qlora.py with and without --use_dora, alternating (LoRA, DoRA, LoRA, ...) so that the machine's drift
hits both alike, and reports the median of each. Writes docs/results/dora.json and prints the table of docs/dora.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def model_dir(root: Path, hidden: int) -> Path:
    """A randomly initialised GPT-2 of this width, saved as a pretrained checkpoint (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from shared.core import data

    tokenizer = data.build_word_tokenizer(data.builtin_split("causal-lm", "train")["text"], "causal-lm")
    config = GPT2Config(n_embd=hidden, n_layer=2, n_head=hidden // 64, n_positions=128, vocab_size=len(tokenizer),
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    out = root / f"gpt2-h{hidden}"
    GPT2LMHeadModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run(model: Path, out: Path, steps: int, dora: bool) -> dict:
    cmd = [sys.executable, str(ROOT / "recipes" / "qlora.py"), "--task", "causal-lm", "--model_name_or_path",
           str(model), "--max_train_steps", str(steps), "--per_device_train_batch_size", "8", "--lora_dropout", "0",
           "--learning_rate", "3e-3", "--report_to", "none", "--no_save_model",
           "--overwrite_output_dir", "--output_dir", str(out),
           *(["--use_dora"] if dora else [])]
    subprocess.run(cmd, check=True, capture_output=True, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                                              "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    return json.loads((out / "results.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=str(ROOT / "docs" / "results" / "dora.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), args.hidden)
        runs: dict[str, list[dict]] = {"lora": [], "dora": []}
        for i in range(args.repeats):
            for kind in ("lora", "dora"):
                runs[kind].append(run(model, Path(tmp) / f"{kind}{i}", args.steps, kind == "dora"))
    # train_runtime leaves out the first (warm-up) step: seconds per step over the other steps.
    step_s = {k: statistics.median(r["train_runtime"] / (args.steps - 1) for r in rs) for k, rs in runs.items()}
    first = {k: rs[0] for k, rs in runs.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, "
                   f"torch {__import__('torch').__version__}",
        "model": f"GPT-2, hidden {args.hidden}, 2 blocks, 4-bit NF4 base, LoRA r=8 on all linear layers",
        "steps": args.steps, "repeats": args.repeats,
        "trainable_params": {k: r["trainable_params"] for k, r in first.items()},
        "trainable_ratio": first["dora"]["trainable_params"] / first["lora"]["trainable_params"],
        "step_seconds": step_s,
        "step_time_ratio": step_s["dora"] / step_s["lora"],
        "train_loss": {k: statistics.median(r["train_loss"] for r in rs) for k, rs in runs.items()},
        "eval_loss": {k: statistics.median(r["eval_loss"] for r in rs) for k, rs in runs.items()},
        # results.json holds the peak of each process (one here)
        "peak_memory_bytes": {k: max(max(r["peak_memory_bytes"]) for r in rs) for k, rs in runs.items()},
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"Machine: {result['machine']}. {result['model']}, {args.steps} steps, median of {args.repeats} runs.\n")
    print("| | LoRA | DoRA | DoRA / LoRA |\n|---|---|---|---|")
    t = result["trainable_params"]
    print(f"| trainable parameters | {t['lora']:,} | {t['dora']:,} | {result['trainable_ratio']:.3f} |")
    print(f"| seconds per step | {step_s['lora']:.4f} | {step_s['dora']:.4f} | {result['step_time_ratio']:.2f} |")
    m = result["peak_memory_bytes"]
    print(f"| peak memory (MiB) | {m['lora'] / 2**20:.0f} | {m['dora'] / 2**20:.0f} | {m['dora'] / m['lora']:.2f} |")
    loss = result["train_loss"]
    print(f"| train loss | {loss['lora']:.4f} | {loss['dora']:.4f} | |")
    ev = result["eval_loss"]
    print(f"| eval loss | {ev['lora']:.4f} | {ev['dora']:.4f} | |")


if __name__ == "__main__":
    main()
