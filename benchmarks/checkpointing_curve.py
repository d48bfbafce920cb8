"""Activation checkpointing's memory / time curve: every K-th block checkpointed (K = 1..L), the op-level selective
policy, and none, on the base presets of the three families (BERT-base, GPT-2 124M, ViT-B/16).

    python benchmarks/checkpointing_curve.py              # measures (about 7 min on 2 CPU cores), then renders
    python benchmarks/checkpointing_curve.py --render     # the table and plot again from the committed JSON

Each setting runs in a fresh interpreter of its own (the allocator's retention from one setting must not raise the
next one's peak; a forked child hung in torch's thread pool), wrapped by recipes/activation_checkpointing.py's own
enable_checkpointing. Per setting:
  kept bytes   what forward leaves alive for backward (shared/techniques/probes.py forward_kept_bytes: autograd's saved
               tensors,
               checkpoint inputs and selective checkpointing's cached op outputs), exact and repeatable
  peak         peak RSS over the steps minus RSS before the first: activations, gradients, allocator slack
  time ratio   best step time with the setting / without checkpointing, timed alternately in the same process so
               that the load of a shared machine hits both alike
Dropout is off (fp32), as in the exactness tests: on CPU, attention dropout would switch SDPA to its math kernel.
Writes docs/results/checkpointing_curve.json, docs/results/checkpointing_curve.png and the table,
docs/results/checkpointing_curve.md (docs/checkpointing.md is the prose).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core.measure import current_memory_bytes, peak_memory_bytes, reset_peak_memory
from shared.core.models import AUTO_CLASSES, preset_config, transformer_layers
from shared.techniques.probes import forward_kept_bytes
from shared.tools import plan

RESULTS = ROOT / "docs" / "results"
DOC = RESULTS / "checkpointing_curve.md"
TASKS = {"text-classification": "BERT-base", "causal-lm": "GPT-2 124M", "image-classification": "ViT-B/16"}
MiB = 2**20
CPU = torch.device("cpu")


def recipe():
    spec = importlib.util.spec_from_file_location("recipe_activation_checkpointing",
                                                  ROOT / "recipes" / "activation_checkpointing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(task: str, batch: int, seq: int) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    cfg = preset_config(task, "base")
    for key, value in cfg.to_dict().items():  # dropout off: see the docstring
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    model = AUTO_CLASSES[task].from_config(cfg).train()
    if task == "image-classification":
        inputs = {"pixel_values": torch.randn(batch, 3, cfg.image_size, cfg.image_size)}
        labels = torch.zeros(batch, dtype=torch.long)
    else:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids if task == "causal-lm" else torch.zeros(batch, dtype=torch.long)
        if task == "causal-lm":
            inputs["use_cache"] = False  # as shared/core/tasks.py: a recomputed block would append to a KV cache again
    return model, inputs, labels


def loss_of(model: torch.nn.Module, task: str, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
    logits = model(**inputs).logits.float()
    if task == "causal-lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def step(model, task, inputs, labels) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss_of(model, task, inputs, labels).backward()
    return time.perf_counter() - t0


def measure(model, task: str, inputs: dict, labels, every: int, policy: str, steps: int) -> dict:
    """One setting, in this (forked) process: kept bytes and peak on its own first steps, then time vs none."""
    r = recipe()
    on = every > 0
    reset_peak_memory(CPU)
    start = current_memory_bytes(CPU)
    if on:
        r.enable_checkpointing(model, "torch", every, policy)
    model.zero_grad(set_to_none=True)
    with forward_kept_bytes(model, inputs) as kept:
        loss = loss_of(model, task, inputs, labels)
    loss.backward()
    del loss
    times = [step(model, task, inputs, labels)]
    peak = peak_memory_bytes(CPU) - start
    plain = []
    for _ in range(steps):  # alternately: the machine's load drifts, and other processes share its cores
        if on:
            r.disable_checkpointing(model, "torch")
            plain.append(step(model, task, inputs, labels))
            r.enable_checkpointing(model, "torch", every, policy)
        times.append(step(model, task, inputs, labels))
    n_layers = len(transformer_layers(model))
    return {"every": every, "policy": policy if on else "none", "checkpointed_blocks": n_layers // every if on else 0,
            "kept_bytes": kept["bytes"], "peak_bytes": peak, "seconds": min(times),
            "time_ratio": min(times) / min(plain) if on else 1.0}


def one(args: argparse.Namespace) -> dict:
    """--one TASK EVERY POLICY: one setting, in this fresh process."""
    torch.set_num_threads(args.threads)
    task, every, policy = args.one[0], int(args.one[1]), args.one[2]
    model, inputs, labels = build(task, args.batch, args.seq)
    row = measure(model, task, inputs, labels, every, policy, args.steps)
    row.update(task=task, model=TASKS[task], layers=len(transformer_layers(model)), batch=args.batch,
               seq=None if task == "image-classification" else args.seq)
    return row


def run(args: argparse.Namespace, out: Path) -> dict:
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "threads": args.threads, "torch": torch.__version__},
              "setup": {"batch": args.batch, "seq": args.seq, "timed_steps": args.steps, "dropout": 0.0,
                        "precision": "fp32"},
              "date": time.strftime("%Y-%m-%d"), "rows": []}
    for task in args.tasks:
        n_layers = preset_config(task, "base").num_hidden_layers
        for every, policy in [(0, "none"), (1, "selective"), *((k, "full") for k in range(1, n_layers + 1))]:
            cmd = [sys.executable, __file__, "--one", task, str(every), policy, "--batch", str(args.batch), "--seq",
                   str(args.seq), "--steps", str(args.steps), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            report["rows"].append(row)
            out.write_text(json.dumps(report, indent=1) + "\n")  # so far: a failure later keeps these
            print(f"{TASKS[task]:<11} {row['policy']:<9} every {every:>2} ({row['checkpointed_blocks']:>2} blocks): "
                  f"kept {row['kept_bytes'] / MiB:8.1f} MiB  peak +{row['peak_bytes'] / MiB:8.1f} MiB  "
                  f"x{row['time_ratio']:.2f}", flush=True)
    return report


def predicted_kept(row: dict) -> float:
    """The planner's saved-for-backward bytes for this setting (shared/tools/plan.py activation_bytes)."""
    config, task, _ = plan.load_config(None, "base", row["task"], None, None)
    spec = plan.model_spec(config, task, "base", disable_dropout=True)
    every = row["every"] or 1
    act = plan.activation_bytes(spec, row["batch"], row["seq"], "fp32", row["policy"] != "none", kernels="cpu",
                                checkpoint_every=every, selective=row["policy"] == "selective")
    return act.saved


def table(report: dict) -> str:
    lines = ["| model | setting | blocks checkpointed | kept for backward MiB | planner MiB | peak above start MiB "
             "| step time vs none |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        setting = {"none": "none", "selective": "selective, every block"}.get(
            r["policy"], f"full, every {r['every']}")
        lines.append(f"| {r['model']} | {setting} | {r['checkpointed_blocks']} / {r['layers']} | "
                     f"{r['kept_bytes'] / MiB:,.1f} | {predicted_kept(r) / MiB:,.1f} | {r['peak_bytes'] / MiB:,.1f} | "
                     f"{r['time_ratio']:.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in report["rows"]))
    # x: blocks checkpointed, not the time ratio: on this shared machine the ratios are noise (docs/checkpointing.md)
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.2 * len(tasks), 7.4), squeeze=False)
    for col, task in enumerate(tasks):
        rows = [r for r in report["rows"] if r["task"] == task]
        full = sorted((r for r in rows if r["policy"] != "selective"), key=lambda r: r["checkpointed_blocks"])
        sel = [r for r in rows if r["policy"] == "selective"]
        ax = axes[0][col]
        ax.plot([r["checkpointed_blocks"] for r in full], [r["kept_bytes"] / MiB for r in full], "o-",
                color="#4c72b0", label="full, every K-th block (0: none)")
        ax.plot([r["checkpointed_blocks"] for r in full], [predicted_kept(r) / MiB for r in full], "x", color="orange",
                label="planner")
        ax.plot([r["checkpointed_blocks"] for r in sel], [r["kept_bytes"] / MiB for r in sel], "*", ms=12,
                color="#c44e52", label="selective (op-level), every block")
        ax.set_title(f"{rows[0]['model']}, batch {rows[0]['batch']}"
                     + (f" x {rows[0]['seq']} tokens" if rows[0]["seq"] else ""), fontsize=10)
        ax.set_ylabel("bytes kept for backward (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1][col]
        ax.plot([r["checkpointed_blocks"] for r in full], [r["time_ratio"] for r in full], "o", color="#4c72b0")
        ax.plot([r["checkpointed_blocks"] for r in sel], [r["time_ratio"] for r in sel], "*", ms=12, color="#c44e52")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("blocks checkpointed")
        ax.set_ylabel("step time / none (one alternated pair: load noise)")
        ax.grid(alpha=0.3)
    m = report["machine"]
    fig.suptitle(f"Activation checkpointing: memory vs time, {m['cores']}-core CPU, {m['threads']} threads, "
                 f"torch {m['torch']}, fp32", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(report: dict) -> None:
    plot(report, RESULTS / "checkpointing_curve.png")
    DOC.write_text("<!-- generated by python benchmarks/checkpointing_curve.py; do not edit -->\n"
                   "# Activation checkpointing: the curve on the base presets\n\n"
                   "What the columns mean and what the curve shows: [../checkpointing.md](../checkpointing.md).\n\n"
                   f"{table(report)}\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    # The committed run's shape: small, so that 42 settings measure in minutes on 2 cores (docs/checkpointing.md).
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=64, help="Tokens per sample (text); ViT-B/16 sees 197 patches.")
    p.add_argument("--steps", type=int, default=1, help="Timed steps of each setting, each beside one without.")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--render", action="store_true", help="Only redo the table and plot from the JSON.")
    p.add_argument("--one", nargs=3, metavar=("TASK", "EVERY", "POLICY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    out = RESULTS / "checkpointing_curve.json"
    report = json.loads(out.read_text()) if args.render else run(args, out)
    render(report)
    print(table(report))


if __name__ == "__main__":
    main()
