"""--task sft learns its built-in instruction set: exact match on held-out prompts, before and after training.

The built-in set (shared/tasks/chat.py reverse_words): a system turn, then "reverse : w1 w2 w3 ..." with 3 to 5 words
of 24; the answer is the words in reverse order, a third of the conversations with a second exchange. The
validation conversations are drawn apart (another seed); the prompts are the turns before the first answer. Greedy
answers (--generate N) are compared to the reference, exactly.

"before": the tiny Llama-style preset as initialised (one step at --learning_rate 1e-9, which changes nothing
measurable: the recipes take no 0-step run); "after": the same run for --steps steps. Writes
docs/results/sft_learns.json and .md.

    python benchmarks/sft_learns.py                  # 300 steps, batch 16, about 10 min on 2 busy CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import run_recipe  # noqa: E402


def one(steps: int, lr: str, prompts: int, batch: int, out: Path) -> dict:
    start = time.perf_counter()
    r = run_recipe("baseline", out, "--task", "sft", "--model_preset", "tiny-llama", "--max_train_steps", steps,
                   "--learning_rate", lr, "--per_device_train_batch_size", batch, "--generate", prompts,
                   "--no_save_model", "--seed", 0)
    return {"steps": steps, "learning_rate": float(lr), "exact_match": r["generated_exact_match"],
            "eval_loss": round(r["eval_loss"], 4), "eval_perplexity": round(r["eval_perplexity"], 3),
            "prompts": r["generated_samples"], "train_target_tokens_per_epoch": r["train_target_tokens"],
            "train_prompt_tokens_per_epoch": r["train_prompt_tokens"], "seconds": round(time.perf_counter() - start),
            "examples": [json.loads(s) for s in (out / "samples.jsonl").read_text().splitlines()[:3]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--learning_rate", default="3e-3")
    p.add_argument("--prompts", type=int, default=100)
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "sft_learns"))
    args = p.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        before = one(1, "1e-9", args.prompts, args.batch, Path(tmp) / "before")
        after = one(args.steps, args.learning_rate, args.prompts, args.batch, Path(tmp) / "after")
    machine = f"{os.cpu_count()} CPU cores ({platform.machine()}, shared with other jobs), torch {torch.__version__}"
    result = {"machine": machine, "model": "preset:tiny-llama", "data": "built-in reverse_words (2000 train, 400 "
              "validation conversations)", "batch": args.batch, "before": before, "after": after}
    Path(args.out + ".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {name} | {r['steps']} | {r['learning_rate']:g} | {100 * r['exact_match']:.0f}% of {r['prompts']} | "
            f"{r['eval_loss']} | {r['seconds']} |" for name, r in (("before", before), ("after", after))]
    example = after["examples"][0]
    Path(args.out + ".md").write_text(
        "# --task sft learns the built-in instruction set\n\n"
        f"Made by `python benchmarks/sft_learns.py` on {machine}: recipes/baseline.py, --task sft, the tiny "
        f"Llama-style preset, batch {args.batch} conversations, per-document packing, greedy answers to the first "
        f"{args.prompts} held-out validation prompts compared exactly with the reference.\n\n"
        "| model | steps | learning rate | exact match | eval loss (answer tokens) | seconds |\n"
        "|---|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n\n"
        f"An answer after training: prompt `{example['prompt']}`, generated `{example['generated']}`, reference "
        f"`{example['reference']}`.\n")
    print(json.dumps({k: {x: v[x] for x in ("exact_match", "eval_loss", "seconds")} for k, v in
                      (("before", before), ("after", after))}))


if __name__ == "__main__":
    main()
