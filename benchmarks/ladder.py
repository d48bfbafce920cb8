"""The technique ladder, measured: techniques added one per rung, in the order a user would add them until a model
fits, each rung the one before plus one recipes/combined.py flag (shared/tools/ladder.py RUNGS), on the same model,
data and steps; per rung the bytes of parameters, gradients, optimizer state and activations on live tensors, the
peak, the step time and the loss, beside the planner's prediction.

    python benchmarks/ladder.py                       # GPT-2 124M and tiny-llama, every rung, 2 interleaved repeats
    python benchmarks/ladder.py --presets tiny-llama --repeats 1 --steps 3

Writes docs/ladder.md, docs/results/ladder.json and docs/results/ladder.png (or --output_dir). One-process rungs
are forked from this process once it has imported the stack (benchmarks/matrix.py: the same runtime a fresh
`accelerate launch` has, its peak RSS measured alone); the ZeRO rungs go through `accelerate launch`, 2 processes.
Step time: the median of the interleaved repeats (repeat 1 runs every rung, then repeat 2 ...), with the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from matrix import fork_recipe, machine  # noqa: E402 - also imports the stack once, before any fork

from shared.core import rules  # noqa: E402
from shared.tools.ladder import (  # noqa: E402
    RUNGS,
    Rung,
    argv,
    predict_rung,
    run_of,
    stacked,
)
from shared.tools.plan import CPU_RUNTIME_BYTES, load_config, model_spec  # noqa: E402

COMBINED = ROOT / "recipes" / "combined.py"
MODELS = {"base": "GPT-2 124M", "tiny-llama": "tiny-llama"}
PARTS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes")
REFUSED = "Refused before training: "


def run_rung(rung: Rung, preset: str, out: Path, steps: int, batch: int, seq: int, threads: int) -> dict:
    """One run of a rung: results.json's fields, or {"refused": why} / {"failed": the error}, and its wall time."""
    flags = stacked(rung.name)
    refused = rules.refusals(run_of(flags, rung.config))
    if refused:  # what combined.py would say before loading anything: not launched (2 processes take a minute)
        return {"refused": " ".join(refused).removeprefix(REFUSED), "wall_s": 0.0}
    args = [*argv(flags), "--model_preset", preset, "--max_train_steps", str(steps), "--max_seq_length", str(seq),
            "--per_device_train_batch_size", str(batch), "--disable_dropout", "--measure_activations",
            "--logging_steps", "1", "--report_to", "none", "--no_save_model", "--max_eval_samples", "8",
            "--seed", "0", "--output_dir", str(out), "--overwrite_output_dir"]
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    if rung.config is None:
        ok = fork_recipe("combined", args, log, threads)
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / rung.config), "--num_processes", "2", str(COMBINED), *args]
        with open(log, "w") as fh:
            ok = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env={
                **os.environ, "OMP_NUM_THREADS": str(max(1, threads // 2))}).returncode == 0
    wall = time.perf_counter() - t0
    text = log.read_text() if log.exists() else ""
    if ok and (out / "results.json").exists():
        return {**json.loads((out / "results.json").read_text()), "wall_s": wall}
    if REFUSED in text:
        return {"refused": text[text.index(REFUSED) + len(REFUSED):].strip().splitlines()[0], "wall_s": wall}
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return {"failed": lines[-1] if lines else "failed", "wall_s": wall}


def measured(r: dict) -> dict:
    """A run's figures in the ladder's words (rank 0 of the ZeRO runs)."""
    if "refused" in r or "failed" in r or "pending" in r:
        return {k: r[k] for k in ("refused", "failed", "pending") if k in r}
    grads = r["peak_grad_bytes"] if r.get("optimizer_in_backward") else r["grad_bytes"][0]  # freed in its hook
    # a whole number of tokens, from two rounded floats' product
    tokens_per_step = round(r["train_tokens_per_second"] * r["seconds_per_step"]) / (2 if r.get("sharding", "none")
                                                                            .startswith("zero") else 1)
    return {"param_bytes": r["param_bytes"][0], "grad_bytes": grads,
            "optimizer_state_bytes": r["optimizer_state_bytes"][0],
            "activation_bytes": r.get("activation_bytes"), "peak_memory_bytes": r["peak_memory_bytes"][0],
            "train_loss": r["train_loss"], "tokens_per_step": tokens_per_step, "compute_dtype": r.get("compute_dtype"),
            "optimizer_class": r.get("optimizer_class"), "trainable_params": r.get("trainable_params"),
            "padding_fraction": r.get("padding_fraction"),
            # activation offloading: the bytes it moved off the device (on CPU: the same memory, bookkeeping)
            "offloaded_activation_bytes": r.get("offload_peak_host_bytes")}


def ladder(preset: str, rungs: tuple[Rung, ...], out: Path, steps: int, batch: int, seq: int, repeats: int,
           threads: int) -> list[dict]:
    """Every rung `repeats` times, interleaved; the first repeat's bytes, the step time's median and spread."""
    runs: dict[str, list[dict]] = {r.name: [] for r in rungs}
    for rep in range(repeats):
        for rung in rungs:
            r = run_rung(rung, preset, out / preset / f"{rung.name}-{rep}", steps, batch, seq, threads)
            runs[rung.name].append(r)
            status = r.get("refused") or r.get("failed") or r.get("pending") or f"{r['seconds_per_step']:.3f} s/step"
            print(f"[{preset} repeat {rep + 1}/{repeats}] {rung.name}: {status[:160]} ({r['wall_s']:.0f} s)",
                  flush=True)
    config, task, _ = load_config(None, preset, "causal-lm", None, None)
    spec = model_spec(config, task, f"preset:{preset}", disable_dropout=True)
    rows = []
    for rung in rungs:
        first = runs[rung.name][0]
        row = {"rung": rung.name, "adds": rung.adds, "config": rung.config, "processes": 2 if rung.config else 1,
               "flags": argv(stacked(rung.name)), **measured(first),
               "wall_s": sum(r["wall_s"] for r in runs[rung.name])}
        times = [r["seconds_per_step"] for r in runs[rung.name] if "seconds_per_step" in r]
        if times:
            med = statistics.median(times)
            row.update(seconds_per_step=med, step_time_spread=(max(times) - min(times)) / med, repeats=len(times))
        p = predict_rung(spec, stacked(rung.name), rung.config, batch, seq, kernels="cpu")
        # On CPU the host and the device are one memory: the offloaded states are measured with the rest
        row["predicted"] = {"param_bytes": p.weights, "grad_bytes": p.grads, "optimizer_state_bytes": p.optimizer,
                            "model_state_bytes": p.states_anywhere, "activation_bytes": p.activations,
                            "peak_memory_bytes": p.device_peak + p.host + CPU_RUNTIME_BYTES}
        rows.append(row)
    return rows


# ---------------------------------------------------------------- the report


def _unit(rows: list[dict]) -> tuple[str, float]:
    """KiB for a model whose parameters are under 16 MiB (the tiny one), else MiB: each row readable to 3 digits."""
    top = max((r.get("param_bytes") or 0 for r in rows), default=0)
    return ("KiB", 2**10) if top < 16 * 2**20 else ("MiB", 2**20)


def _status(row: dict) -> str:
    if "refused" in row:
        return "refused: " + re.sub(r"\s+", " ", row["refused"])
    if "failed" in row:
        return "failed: " + row["failed"][:200]
    return row.get("pending", "")


def table(rows: list[dict]) -> list[str]:
    unit, scale = _unit(rows)

    def b(v: float | None) -> str:
        return "" if v is None else f"{v / scale:,.1f}"

    lines = ["| rung | adds | params | grads | optimizer | activations | peak RSS | s/step (spread) | tokens/step | "
             "loss | vs rung before | planned states / activations |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    loss = {}  # each rung's loss: a rung compares with the one it stacks on (the ZeRO rungs: full_ckpt)
    before = None
    for row in rows:
        rung = next(r for r in RUNGS if r.name == row["rung"])
        ref = rung.on or before
        before = row["rung"] if not rung.on and row["processes"] == 1 else before
        if "param_bytes" not in row:
            lines.append(f"| {row['rung']} | {row['adds']} | {_status(row)} |||||||||| |")
            continue
        loss[row["rung"]] = row["train_loss"]
        p = row["predicted"]
        states = sum(row[k] for k in PARTS[:3])
        planned = p["model_state_bytes"]  # offloaded states included: on CPU host and device are one memory
        delta = f"{row['train_loss'] - loss[ref]:+.4f}" + (f" (vs {ref})" if rung.on else "") if ref in loss else ""
        speed = (f"{row['seconds_per_step']:.3f} (±{row['step_time_spread'] / 2:.0%})"
                 if "seconds_per_step" in row else "")
        moved = row.get("offloaded_activation_bytes")
        # the probe counts the host copies too (on CPU, allocated in the same memory): split them out
        act = (f"{b(row['activation_bytes'] - moved)} + {b(moved)} on host" if moved else b(row["activation_bytes"]))
        lines.append(
            f"| {row['rung']} | {row['adds']} | {b(row['param_bytes'])} | {b(row['grad_bytes'])} | "
            f"{b(row['optimizer_state_bytes'])} | {act} | {row['peak_memory_bytes'] / 2**20:,.0f} MiB | {speed} | "
            f"{row['tokens_per_step']:,.0f} | {row['train_loss']:.4f} | {delta} | "
            f"{b(planned)} ({states / planned - 1:+.1%}) / {b(p['activation_bytes'])} |")
    return [f"Bytes in {unit} (peak RSS in MiB).", "", *lines]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(results["models"])
    fig, axes = plt.subplots(len(presets), 2, figsize=(15, 5.4 * len(presets)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.3]})
    colors = {"param_bytes": "#4c72b0", "grad_bytes": "#dd8452", "optimizer_state_bytes": "#55a868",
              "activation_bytes": "#c44e52", "other": "#d0d0d0"}
    names = {"param_bytes": "params", "grad_bytes": "grads", "optimizer_state_bytes": "optimizer state",
             "activation_bytes": "activations saved for backward", "other": "runtime + other (to peak RSS)"}
    for (ax, tax), preset in zip(axes, presets, strict=True):
        rows = results["models"][preset]["rungs"]
        unit, scale = _unit(rows)
        xs = range(len(rows))
        parts = [sum(r[k] or 0 for k in PARTS) / scale for r in rows if "param_bytes" in r]
        peaks = [r["peak_memory_bytes"] / scale for r in rows if "param_bytes" in r]
        # The runtime (Python and the libraries, ~450 MiB on CPU) dwarfs a tiny model's bytes: the axis then stops
        # at twice the largest training bytes and each bar's peak RSS is written on it, the runtime cut.
        top = max(peaks) if max(peaks) < 3 * max(parts) else 2 * max(parts)
        for i, row in enumerate(rows):
            if "param_bytes" not in row:
                label = "refused" if "refused" in row else "failed" if "failed" in row else "pending"
                ax.bar(i, top * 0.98, color="white", edgecolor="#999999", hatch="//")
                ax.text(i, top * 0.5, label, rotation=90, ha="center", va="center", fontsize=9)
                continue
            bottom = 0.0
            for k in PARTS:
                v = (row[k] or 0) / scale
                ax.bar(i, v, bottom=bottom, color=colors[k], label=names[k] if i == 0 else None)
                bottom += v
            other = max(0.0, row["peak_memory_bytes"] / scale - bottom)
            ax.bar(i, other, bottom=bottom, color=colors["other"], label=names["other"] if i == 0 else None)
            if bottom + other > top:
                ax.text(i, top * 0.97, f"peak\n{row['peak_memory_bytes'] / 2**20:,.0f}\nMiB", ha="center",
                        va="top", fontsize=6.5)
            moved = row.get("offloaded_activation_bytes")
            if moved:
                ax.text(i, bottom, f"{moved / scale:,.0f} {unit}\nmoved\nto host", ha="center", va="bottom",
                        fontsize=6.5)
        ax.set_ylim(0, top)
        ax.set_xticks(list(xs), [r["rung"] for r in rows], rotation=45, ha="right")
        ax.set_ylabel(f"{unit} (rank 0 for ZeRO)")
        block = results["models"][preset]
        ax.set_title(f"{MODELS.get(preset, preset)}, batch {block.get('batch', results['batch'])} x "
                     f"{block.get('seq', results['seq'])} tokens: each rung adds one technique to the one before")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=5)  # below: not over a bar
        secs = [r.get("seconds_per_step", 0) for r in rows]
        tax.barh(list(xs), secs, color=["#8172b2" if s else "#ffffff" for s in secs])
        for i, r in enumerate(rows):
            if "spread" in r or "step_time_spread" in r:
                tax.text(r["seconds_per_step"], i, f" {r['seconds_per_step']:.2f}", va="center", fontsize=7)
        tax.set_yticks(list(xs), [r["rung"] for r in rows], fontsize=8)
        tax.invert_yaxis()
        tax.set_xlabel("seconds per step (median of repeats)")
        tax.set_title("step time")
    fig.suptitle(f"Technique ladder, measured on {results['machine']['cores']} CPU cores, "
                 "one process unless named", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(results: dict, path: Path, planner_text: str) -> None:
    m = results["machine"]
    lines = [
        "<!-- generated by python benchmarks/ladder.py (--render: from docs/results/ladder.json); do not edit -->",
        "# The technique ladder",
        "",
        "\"I add techniques one by one until it fits: what does each buy and cost, on my model?\" Each rung below "
        "is the rung before plus one `recipes/combined.py` flag (the flags of every rung: "
        "`shared/tools/ladder.py` RUNGS, and `flags` in docs/results/ladder.json), on the same model, data (the "
        "built-in causal-LM text), seed and steps. Measured by `python benchmarks/ladder.py` "
        f"({results['wall_s'] / 60:.1f} min wall time on this machine; load average "
        f"{results.get('load_average', float('nan')):.2f} before it started, nothing else running).",
        "",
        "![ladder](results/ladder.png)",
        "",
        f"Machine: {m['cores']} CPU cores ({m['cpu']}), no GPU, torch {m['torch']} CPU, gloo, transformers "
        f"{m['transformers']}, accelerate {m['accelerate']}; {m['date']}. The batch and "
        f"the steps below (the first is warm-up, not timed), no dropout, no "
        "clipping (the optimizer step in backward cannot clip), learning rate 1e-3. One-process rungs: "
        f"{results['threads']} threads; ZeRO rungs: 2 processes of {max(1, results['threads'] // 2)} thread.",
        "",
        "How to read it:",
        "- params, grads, optimizer: bytes on live tensors (in KiB for the tiny model, MiB for GPT-2) after the "
        "first optimizer step (shared/core/measure.py; "
        "ZeRO: rank 0's partition; the optimizer step in backward: the most gradient bytes alive in any hook). "
        "activations: the bytes the first forward (and the loss) leaves alive for backward, counted on the op "
        "outputs (`--measure_activations`, shared/techniques/probes.py `forward_kept_bytes`: autograd's saved "
        "tensors, checkpoint inputs, selective checkpointing's cache; autocast's bf16 weight copies included). "
        "With activation offloading: the bytes left on the device + the bytes moved to host memory (the probe "
        "counts both: on CPU the host copy is made in the same memory, so the total stays). "
        "peak RSS: the process's high-water mark (VmHWM), the Python runtime included, so on the tiny model it is "
        "mostly runtime.",
        "- s/step: the median over interleaved repeats of each run's mean step time, ± half the spread (max - min) "
        "as a share of the median. Read ratios between neighbouring rungs, not the "
        "absolute seconds; CPU timings do not transfer to a GPU (bf16 is slower than fp32 on this CPU, where a "
        "GPU's tensor cores make it about 2x faster).",
        "- loss: the last step's loss; vs rung before: its change against the rung it stacks on (the one above; "
        "the ZeRO rungs: full_ckpt, whose flags they keep). Packing "
        "changes what a step trains on (more real tokens per step), so its loss is not the rung before's.",
        "- planned: shared/tools/plan.py's model-state bytes (params + grads + optimizer) for the same run, and its "
        "difference from the measured ones, and its activation bytes (CPU kernels). tests/test_ladder.py holds "
        "the planned model states within 5% of the measured ones at every rung of each model measured, the ZeRO rungs "
        "(rank 0) included: DeepSpeed's fp32 gradient partition is built in step() and freed after it, so the "
        "planner counts it in the peak, not in the gradients; with offload the planner's host bytes are measured "
        "with the rest (on CPU host and device are one memory). Its activations "
        "include, under checkpointing, the block recomputed in backward (not alive after forward, so not measured), "
        "and assume full-length sequences where the unpacked rungs pad only to the longest in the batch.",
        "",
    ]
    for preset, block in results["models"].items():
        lines += [f"## {MODELS.get(preset, preset)} (`--model_preset {preset}`, "
                  f"{block['num_params'] / 1e6:,.1f}M parameters)", "",
                  f"Batch {block.get('batch', results['batch'])} x {block.get('seq', results['seq'])} tokens, "
                  f"{block['steps']} steps, {block['repeats']} interleaved repeat(s), "
                  f"{block['wall_s'] / 60:.1f} min wall time.", "", *table(block["rungs"]), ""]
    for preset in MODELS:
        if preset not in results["models"]:
            lines += [f"## {MODELS[preset]} (`--model_preset {preset}`): not measured on this machine", "",
                      "Its bf16 rungs are too slow on this CPU, which has no bf16 matrix units: at batch 2 x 64, "
                      "fp32 took 1.85 s a step, bf16 autocast 10.5 s and bf16 packed 72.9 s (2026-12-02, the "
                      "first three rungs, one timed step each, the machine partly shared with a test run), so its "
                      "16 rungs would take well over an hour against the 30 minutes this benchmark has. On a "
                      "machine with a GPU (or a CPU with AMX): "
                      f"`python benchmarks/ladder.py --presets {preset} --keep_other_models`. The planner's ladder "
                      "for GPT-2 124M on one 80 GB GPU is at the end of this page.", ""]
    lines += [
        "## What cannot stack, and where it runs",
        "",
        "- Activation offloading (rung `act_offload`) is `recipes/combined.py --activation_offloading checkpointed` "
        "(the checkpointed blocks' inputs to host memory): on this CPU machine host and device are one memory, so "
        "its bytes move in the bookkeeping only (recipes/activation_offloading.py, docs/activation_offloading.md).",
        "- The sharding rungs (2 processes) stack on `full_ckpt`, the last rung DeepSpeed can run: on the whole "
        "stack ZeRO is refused by shared/core/rules.py (`zero2_stack`: torchao's optimizer under ZeRO; the "
        "optimizer step in backward is refused under any sharding too), since DeepSpeed keeps its own fp32 "
        "AdamW partitions.",
        "- Techniques the ladder does not stack in one run, each by its own recipe: FSDP2 (recipes/fsdp.py, or "
        "combined.py under accelerate_configs/fsdp.yaml), FP8 (recipes/fp8.py), tensor and sequence parallel "
        "(recipes/tensor_parallel.py, sequence_parallel.py), torch.compile (recipes/baseline.py and the others "
        "that compile: combined.py does not).",
        "",
        "## The same ladder for your model and GPU",
        "",
        "The planner prints the ladder for any model it knows (offline configs: `--list_models`) at your sequence "
        "length and batch:",
        "",
        "```",
        planner_text.strip(),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv_: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["tiny-llama", "base"])
    ap.add_argument("--rungs", nargs="+", default=None, help="Rung names (default: all).")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    ap.add_argument("--output_dir", default=str(ROOT / "docs"))
    ap.add_argument("--work_dir", default="/tmp/ladder-runs")
    ap.add_argument("--keep_other_models", action="store_true",
                    help="Keep the rows of models not in --presets from the existing ladder.json.")
    ap.add_argument("--render", action="store_true",
                    help="Only rewrite docs/ladder.md and the picture from the existing ladder.json.")
    a = ap.parse_args(argv_)
    out = Path(a.output_dir)
    old = out / "results" / "ladder.json"
    if a.render:
        results = json.loads(old.read_text())
        report(results, out)
        return results
    rungs = tuple(r for r in RUNGS if a.rungs is None or r.name in a.rungs)
    results = {"machine": machine(), "steps": a.steps, "batch": a.batch, "seq": a.seq, "repeats": a.repeats,
               "threads": a.threads, "load_average": os.getloadavg()[0], "models": {}}
    if a.keep_other_models and old.exists():  # the other models' rows as recorded (e.g. another --repeats)
        results["models"] = {k: v for k, v in json.loads(old.read_text())["models"].items() if k not in a.presets}
    for preset in a.presets:  # the report is rewritten after each model: a stopped run keeps the models done
        config, task, _ = load_config(None, preset, "causal-lm", None, None)
        spec = model_spec(config, task, f"preset:{preset}")
        t_model = time.perf_counter()
        rows = ladder(preset, rungs, Path(a.work_dir), a.steps, a.batch, a.seq, a.repeats, a.threads)
        results["models"][preset] = {"num_params": spec.num_params, "rungs": rows, "repeats": a.repeats,
                                     "steps": a.steps, "batch": a.batch, "seq": a.seq,
                                     "wall_s": time.perf_counter() - t_model}
        results["wall_s"] = sum(b.get("wall_s", 0) for b in results["models"].values())
        report(results, out)
    return results


def report(results: dict, out: Path) -> None:
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "ladder.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "results" / "ladder.png")
    text = ""
    for model, seq, batch in (("gpt2", 1024, 8), ("meta-llama/Llama-3.2-3B", 2048, 4)):
        cmd = ["-m", "shared.tools.ladder", "--model_name_or_path", model, "--gpu_memory", "80GB",
               "--seq_len", str(seq), "--per_device_batch_size", str(batch)]
        planner = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True).stdout
        text += f"$ python {' '.join(cmd)}\n{planner}\n"
    write_doc(results, out / "ladder.md", text)
    print(f"wrote {out / 'ladder.md'}, {out / 'results' / 'ladder.json'}, {out / 'results' / 'ladder.png'} "
          f"({results['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
