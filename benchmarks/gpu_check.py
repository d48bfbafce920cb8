"""The GPU check: on one CUDA GPU, in under 10 minutes, what a CPU cannot show.

    bash benchmarks/gpu_check.sh                 # on the GPU machine: writes docs/results/gpu_check.md and .json
    python benchmarks/gpu_check.py --print       # the commands, without running them
    python benchmarks/gpu_check.py --cpu_smoke   # the CPU-runnable part (tiny models, 2 steps): what CI runs

1. every recipe that trains in one process, 5 steps on the GPU (4 at a time): it finishes on `cuda` and computes in
   the dtype asked for;
2. MFU (benchmarks/mfu.py) of GPT-2 124M (1024 tokens x 8) and BERT-base (512 x 16) in bf16, without and with
   --torch_compile (regional, and full for GPT-2); goal on an H100 / H200: >= 40% for GPT-2 bf16 with compile;
3. FP8 (recipes/fp8.py, torchao Float8Linear) against bf16 on the same GPT-2 run: the speed ratio;
4. fp16 with CUDA's GradScaler (recipes/mixed_precision.py): finite loss, the scale and skipped steps reported;
5. bitsandbytes' CUDA paths: 8-bit AdamW paged (optim_8bit.py --paged), 4-bit and 8-bit QLoRA bases;
6. activation offloading (benchmarks/activation_offloading.py): GPT-2 124M bf16, 8 x 1024, without and with it
   (all; checkpointing + checkpointed): the device's real peak, the host bytes, the step time against none's, and
   the round trip per byte through the hooks (pinned memory, side stream) that sets --offload_min_bytes on a GPU.
Each check's verdict is read from its results.json, not from an exit code alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEPS = 5


def one_process_recipes() -> list[str]:
    """Every recipe the rule table lets run as `accelerate launch recipes/<r>.py` in one process, no flags."""
    from shared.core.rules import refusals
    from shared.tools.catalogue import recipe_run, recipes_support  # every technique's rules; each recipe's SUPPORT

    return sorted(r for r, support in recipes_support().items() if not refusals(
        recipe_run(recipe=r, sharding="none", launched="none", precision=support.precision or "no")))


def recipe_checks(device_steps: int, tiny: bool) -> list[dict]:
    """(1), (4), (5): name, recipe, flags, and what results.json must show."""
    preset = ["--model_preset", "tiny"] if tiny else []
    common = ["--max_train_steps", str(device_steps), "--max_train_samples", "64", "--max_eval_samples", "16",
              "--no_save_model", "--report_to", "none", *preset]
    checks = [{"name": f"recipe {r}", "recipe": r, "args": common, "expect": {}} for r in one_process_recipes()]
    checks += [  # DeepSpeed on one GPU: its configs, one process
        {"name": f"recipe {r} {config}", "recipe": r, "args": common, "expect": {}, "config": config}
        for r, config in (("zero", "zero3.yaml"), ("zero3_offload", "zero3_offload.yaml"))]
    checks += [
        {"name": "fp16 GradScaler", "recipe": "mixed_precision", "args": [*common, "--mixed_precision", "fp16"],
         "expect": {"compute_dtype": "float16", "final_loss_scale": "positive"}},
        {"name": "bnb 8-bit AdamW, paged", "recipe": "optim_8bit", "args": [*common, "--paged"],
         "expect": {"optimizer_class": "PagedAdamW8bit"}, "cuda_only": True},
        {"name": "bnb 4-bit QLoRA", "recipe": "qlora", "args": [*common, "--load_in", "4bit"],
         "expect": {"quantized_layers": "positive"}},
        {"name": "bnb 8-bit QLoRA", "recipe": "qlora", "args": [*common, "--load_in", "8bit"],
         "expect": {"quantized_layers": "positive"}},
    ]
    return checks


def mfu_checks(tiny: bool) -> list[list[str]]:
    """(2), (3): benchmarks/mfu.py argument lists."""
    if tiny:  # the same script end to end, on shapes a CPU runs in seconds
        base = ["--model_preset", "tiny", "--steps", "3", "--batch", "2", "--seq", "64"]
        return [[*base, "--task", "causal-lm", "--label", "GPT-2 tiny fp32", "--mixed_precision", "no"],
                [*base, "--task", "text-classification", "--label", "BERT tiny fp32", "--mixed_precision", "no"]]
    gpt = ["--task", "causal-lm", "--seq", "1024", "--batch", "8", "--steps", "40"]
    bert = ["--task", "text-classification", "--seq", "512", "--batch", "16", "--steps", "40"]
    return [
        [*gpt, "--label", "GPT-2 124M bf16"],
        [*gpt, "--label", "GPT-2 124M bf16 compile regional", "--", "--torch_compile", "regional"],
        [*gpt, "--label", "GPT-2 124M bf16 compile full", "--", "--torch_compile", "full"],
        [*gpt, "--recipe", "fp8", "--label", "GPT-2 124M fp8"],
        [*gpt, "--recipe", "fp8", "--label", "GPT-2 124M fp8 compile regional", "--", "--torch_compile", "regional"],
        [*bert, "--label", "BERT-base bf16"],
        [*bert, "--label", "BERT-base bf16 compile regional", "--", "--torch_compile", "regional"],
    ]


def offload_args(tiny: bool) -> list[str]:
    """(6): benchmarks/activation_offloading.py's arguments."""
    return ["--preset", "tiny", "--batch", "2", "--seq", "64", "--steps", "2"] if tiny else []


def offload_problem(result: dict, cuda: bool) -> str | None:
    """On CUDA the offloaded settings must peak lower than the ones they offload from."""
    by = {r["setting"]: r for r in result["steps"]}
    if not cuda:
        return None if by["all"]["host_peak_bytes"] > 0 else "nothing offloaded"
    for off, plain in (("all", "none"), ("checkpointing + checkpointed", "checkpointing")):
        if not by[off]["peak_above_start"] < by[plain]["peak_above_start"]:
            return f"{off} peaked at {by[off]['peak_above_start']:,} B, not below {plain}'s"
    return None


def verdict(check: dict, results: dict | None, cuda: bool) -> str | None:
    """None when the run did what it says; else what went wrong."""
    if results is None:
        return "no results.json"
    if cuda and not str(results.get("device")).startswith("cuda"):
        return f"ran on {results.get('device')}"
    loss = results.get("train_loss")
    if loss is None or not math.isfinite(loss):
        return f"loss {loss}"
    for key, want in check["expect"].items():
        got = results.get(key)
        if want == "positive" and not (isinstance(got, int | float) and got > 0):
            return f"{key} = {got}"
        if want != "positive" and got != want:
            return f"{key} = {got}, not {want}"
    return None


def root_cause(stderr: str, returncode: int) -> str:
    """The recipe's own error line: under `accelerate launch` the last line is the launcher's CalledProcessError,
    which names the command, not what went wrong (the first GPU run reported nothing else for 5 failures)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", line)
              and not line.startswith(("subprocess.CalledProcessError", "torch.distributed.elastic"))]
    return (errors or lines or [f"exit code {returncode}"])[-1][:300]


def run_recipe_check(check: dict, out: Path, cuda: bool) -> dict:
    work = out / check["name"].replace(" ", "_").replace(",", "")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / check.get("config", "single_process.yaml")), "--num_processes", "1",
           str(ROOT / "recipes" / f"{check['recipe']}.py"), *check["args"],
           "--overwrite_output_dir", "--output_dir", str(work)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    results = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else None
    problem = verdict(check, results, cuda) if proc.returncode == 0 else root_cause(proc.stderr, proc.returncode)
    return {"name": check["name"], "ok": problem is None, "problem": problem, "wall_s": round(
        time.perf_counter() - t0, 1), "compute_dtype": (results or {}).get("compute_dtype"),
            "train_loss": (results or {}).get("train_loss"), "command": " ".join(cmd[3:])}


def write_report(rows: list[dict], mfu: list[dict], path: Path, machine: str, offload: dict | None = None) -> None:
    lines = ["# GPU check", "", f"Made by `bash benchmarks/gpu_check.sh` on {machine}.", "",
             "## Recipes, 5 steps each", "", "| check | ok | dtype | loss | seconds | problem |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        loss = f"{r['train_loss']:.4f}" if r.get("train_loss") is not None else ""
        lines.append(f"| {r['name']} | {'✓' if r['ok'] else '✗'} | {r['compute_dtype'] or ''} | {loss} | "
                     f"{r['wall_s']} | {r['problem'] or ''} |")
    lines += ["", "## MFU (shared/core/flops.py: 6 x weights + 12 x layers x hidden x seq FLOPs per token, "
              "dense bf16 peak)",
              "", "| run | tokens/s | TFLOP/s | MFU | compile s | step s |", "|---|---|---|---|---|---|"]
    for m in mfu:
        mfu_cell = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "n/a"
        lines.append(f"| {m['label']} | {m['tokens_per_second']:,.0f} | {m['achieved_flops'] / 1e12:.2f} | {mfu_cell} "
                     f"| {m.get('compile_s', '')} | {m['seconds_per_step']:.4f} |")
    by = {m["label"]: m for m in mfu}
    for fp8, bf16 in (("GPT-2 124M fp8", "GPT-2 124M bf16"),
                      ("GPT-2 124M fp8 compile regional", "GPT-2 124M bf16 compile regional")):
        if fp8 in by and bf16 in by:
            lines.append(f"\nFP8 / bf16 throughput ({fp8}): "
                         f"{by[fp8]['tokens_per_second'] / by[bf16]['tokens_per_second']:.2f}x")
    if offload:
        t = offload["threshold"]
        lines += ["", f"## Activation offloading ({offload['model']})", "",
                  "| setting | device peak above weights | host peak | step s | x none |", "|---|---|---|---|---|"]
        for r in offload["steps"]:
            peak = f"{r['peak_above_start'] / 2**30:.2f} GiB" if r["peak_above_start"] is not None else "n/a"
            lines.append(f"| {r['setting']} | {peak} | {r['host_peak_bytes'] / 2**30:.2f} GiB | {r['step_s']:.4f} | "
                         f"{r['step_ratio']:.2f} |")
        lines.append(f"\nRound trip through the hooks: {t['fixed_s'] * 1e6:.1f} us fixed + {t['per_byte_s'] * 1e9:.4f} "
                     f"ns/byte; suggested --offload_min_bytes {t['suggested_min_bytes']:,}")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--print", action="store_true", help="Print the commands and exit.")
    ap.add_argument("--cpu_smoke", action="store_true", help="Tiny models, 2 steps, no CUDA-only check.")
    ap.add_argument("--output_dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--work_dir", default=str(ROOT / "outputs" / "gpu_check"))
    ap.add_argument("--parallel", type=int, default=4, help="Recipe checks at a time (one GPU holds several).")
    ap.add_argument("--only", action="append", default=[],
                    help="Only checks whose name contains this (repeatable: any may match).")
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not (args.cpu_smoke or args.print):
        raise SystemExit("No CUDA GPU here. Run it on a GPU machine, or pass --cpu_smoke for the CPU-runnable part.")
    def wanted(name: str) -> bool:
        return not args.only or any(o in name for o in args.only)

    checks = [c for c in recipe_checks(2 if args.cpu_smoke else STEPS, tiny=args.cpu_smoke)
              if (cuda or args.print or not c.get("cuda_only")) and wanted(c["name"])]
    mfus = [m for m in mfu_checks(tiny=args.cpu_smoke) if wanted(" ".join(m))]
    if args.print:
        for c in checks:
            print(f"{c['name']}: accelerate launch --config_file accelerate_configs/"
                  f"{c.get('config', 'single_process.yaml')} --num_processes 1 recipes/{c['recipe']}.py "
                  f"{' '.join(c['args'])}")
        for m in mfus:
            print(f"mfu: python benchmarks/mfu.py {' '.join(m)}")
        if wanted("offload"):
            print(f"offload: python benchmarks/activation_offloading.py {' '.join(offload_args(args.cpu_smoke))}")
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda c: run_recipe_check(c, work, cuda), checks))
    for r in rows:
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['name']} ({r['wall_s']} s) {r['problem'] or ''}")
    jsonl = work / "mfu.jsonl"
    jsonl.unlink(missing_ok=True)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import mfu as mfu_script

    mfu_rows = []
    for m in mfus:  # one at a time: each owns the GPU while it is timed
        cut = m.index("--") if "--" in m else len(m)  # the recipe's own flags stay after "--"
        try:
            mfu_rows.append(mfu_script.main([*m[:cut], "--out", str(jsonl), *m[cut:]]))
        except SystemExit as err:
            rows.append({"name": f"mfu {' '.join(m)}", "ok": False, "problem": str(err)[-300:], "wall_s": 0,
                         "compute_dtype": None, "train_loss": None, "command": ""})
    offload = None
    if wanted("offload"):
        import activation_offloading as offload_script

        offload = offload_script.main([*offload_args(args.cpu_smoke), "--out", str(work / "offload.json")])
        problem = offload_problem(offload, cuda)
        rows.append({"name": "activation offloading", "ok": problem is None, "problem": problem, "wall_s": 0,
                     "compute_dtype": "bfloat16" if cuda else "float32", "train_loss": None,
                     "command": "python benchmarks/activation_offloading.py " + " ".join(offload_args(args.cpu_smoke))})
    machine = (torch.cuda.get_device_name(0) if cuda else "CPU") + f"; torch {torch.__version__}; " \
        + time.strftime("%Y-%m-%d")
    out = Path(args.output_dir) if not args.cpu_smoke else work
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({"machine": machine, "checks": rows, "mfu": mfu_rows,
                                                    "activation_offloading": offload}, indent=1))
    write_report(rows, mfu_rows, out / "gpu_check.md", machine, offload)
    print(f"wrote {out / 'gpu_check.md'}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
