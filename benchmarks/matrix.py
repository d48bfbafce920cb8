"""The measured technique matrix: every recipe on the same model, data and steps; tables, JSON and plots.

    python benchmarks/matrix.py --quick          # tiny + base presets, 3 tasks, 3 recipes, 2 steps: a few minutes
    python benchmarks/matrix.py                  # more steps, more recipes and configs, the decoder presets too
    python benchmarks/matrix.py --quick --presets tiny-llama tiny-moe --tasks text-classification causal-lm

Writes docs/results/matrix.md, matrix.json and matrix.png (or --output_dir). Each run's measured bytes are printed
beside what the planner (shared/tools/plan.py) predicts for it. Adding a recipe or a config is one line in RUNS:
a planner row by its name (its recipe, config and flags), or a recipe of shared/core/rules.py's catalogue.

No speed column: each cell is one short run, and a ratio of two such runs swung from 0.07x to 1.20x between tiny
runs (one timed step). Speed ratios are published only by the benchmarks that time enough steps, as medians of
interleaved repeats with their spread: benchmarks/overhead.py, checkpointing_curve.py, dora.py, compile.py.

Single-process runs are forked from this process after it has imported the stack once (about 6 s saved per run):
the child starts with the same imported runtime a fresh `accelerate launch` has, and its peak RSS is measured the
same way (see docs/planner.md for the check). Runs with several processes go through `accelerate launch`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Imported once here, before any fork: what every recipe imports (no tensor is computed in this process), so each
# forked run shares these pages (FORKED_RUNTIME_BYTES, shared/tools/plan.py). The core imports transformers' model
# classes and DTensor only where they are used (a fast --help), so they are named here.
import accelerate  # noqa: F401
import datasets  # noqa: F401
import torch
import torch.distributed.tensor  # noqa: F401
import transformers  # noqa: F401
import yaml
from tqdm.auto import tqdm
from transformers import (  # noqa: F401
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    BertConfig,
    GPT2Config,
    ViTConfig,
)

from shared.core import args as _args  # noqa: F401
from shared.core import checkpoint, data, launch, meter, models, optim, results, tasks  # noqa: F401
from shared.tools.catalogue import PLANS_AS
from shared.tools.plan import (
    CPU_RUNTIME_BYTES,
    FORKED_RUNTIME_BYTES,
    TECHNIQUES,
    Technique,
    load_config,
    model_spec,
    predict_cpu_run,
)

# ---------------------------------------------------------------- the runs: one line each

DECODERS = ("tiny-llama", "tiny-moe")  # Llama and Mixtral (a mixture of experts): text tasks, in the full matrix


@dataclass(frozen=True)
class Run:
    recipe: str  # recipes/<recipe>.py (shared/tools/catalogue.py recipes_support)
    config: str = "single_process.yaml"  # accelerate_configs/<config>
    args: tuple[str, ...] = ()
    technique: Technique | None = None  # how the planner models it; None: not predicted
    quick: bool = False  # part of --quick
    presets: tuple[str, ...] = ("tiny", "base")  # multi-process base-size runs take many minutes on 2 CPU cores
    tasks: tuple[str, ...] = ("text-classification", "causal-lm", "image-classification")

    @property
    def name(self) -> str:
        extra = " ".join(a for a in self.args if not a.startswith("--")) if self.args else ""
        return f"{self.recipe}[{self.config.removesuffix('.yaml')}{' ' + extra if extra else ''}]"


PLANNED = {t.name: t for t in TECHNIQUES}


def planned(name: str, config: str | None = None, args: tuple[str, ...] | None = None, model: dict | None = None,
            **run: object) -> Run:
    """A row of the planner (shared/tools/plan.py TECHNIQUES), run as its printed command runs it: its recipe,
    launch config and flags (or `config` / `args` instead), predicted by that row (with `model`'s fields changed)."""
    tech = replace(PLANNED[name], **(model or {}))
    return Run(tech.recipe, config or tech.config or "single_process.yaml", tech.args if args is None else args,
               technique=tech, **run)


def unplanned(recipe: str, **run: object) -> Run:
    """A recipe without planner rows of its own: predicted as the recipe shared/tools/catalogue.py's PLANS_AS
    names, or not at all (NOT_PLANNED)."""
    like = PLANS_AS.get(recipe, "")
    tech = next((t for t in TECHNIQUES if t.recipe == like), None) if like else None
    return Run(recipe, technique=tech, **run)


RUNS: list[Run] = [
    planned("baseline", quick=True, presets=("tiny", "base", *DECODERS)),
    planned("mixed_precision", quick=True, presets=("tiny", "base", *DECODERS)),
    planned("activation_checkpointing", quick=True, presets=("tiny", "base", *DECODERS)),
    planned("mixed_precision", args=("--mixed_precision", "fp16")),  # predicted as bf16 (the same 16-bit bytes)
    unplanned("gradient_accumulation", args=("--gradient_accumulation_steps", "2")),
    planned("baseline", config="multi_cpu.yaml"),
    # Memory techniques in 2 processes (1 for the quantized ones), tiny preset in --quick.
    planned("optim_8bit", quick=True, presets=("tiny", *DECODERS)),
    planned("zero1"),
    planned("zero2", quick=True, presets=("tiny",)),
    planned("zero3", quick=True, presets=("tiny", *DECODERS)),
    planned("zero2_offload"),
    planned("zero3_offload"),
    planned("fsdp", quick=True, presets=("tiny", *DECODERS)),
    planned("fsdp_offload"),
    planned("qlora_4bit", presets=("tiny",)),
    planned("qlora_4bit_dora", presets=("tiny",)),
    # The memory techniques of issue 13, one process, tiny preset in --quick.
    planned("chunked_loss", args=("--loss_chunk_size", "16"), model={"loss_chunk": 16}, quick=True,
            presets=("tiny", *DECODERS), tasks=("causal-lm",)),
    planned("optim_4bit", quick=True, presets=("tiny", *DECODERS)),
    planned("optimizer_in_backward", quick=True, presets=("tiny", *DECODERS)),
    planned("qlora_8bit", presets=("tiny",)),
    unplanned("qat", presets=("tiny", "tiny-llama")),  # tiny-moe: refused (its experts are not nn.Linear)
    unplanned("pruning", presets=("tiny", "tiny-llama")),
    unplanned("combined", config="zero3.yaml", args=("--lora", "--gradient_checkpointing"), presets=("tiny",)),
    unplanned("model_parallel", presets=("tiny",)),
    unplanned("pipeline_parallel", config="pipeline.yaml", presets=("tiny",)),
    unplanned("data_model_parallel", config="data_model_parallel.yaml", presets=("tiny",)),
]

# --quick leaves out ViT-base in bf16: on an AVX2-only CPU a bf16 matmul is ~6x slower than fp32 (measured), and
# one bf16 step of ViT-base took minutes. The full matrix runs it.
QUICK = dict(steps=2, presets=("tiny", "base"), batch={"tiny": 8, "base": 1, **dict.fromkeys(DECODERS, 8)},
             skip={("mixed_precision", "image-classification", "base")})
FULL = dict(steps=20, presets=("tiny", "base", *DECODERS), batch={"tiny": 16, "base": 4, **dict.fromkeys(DECODERS, 16)},
            skip=set())
# Sequence lengths every built-in example reaches, so each batch has exactly this shape (no dynamic padding):
# the shortest review has 13 tokens, the shortest story 6.
SEQ = {"text-classification": 12, "causal-lm": 6, "image-classification": None}
TASKS = ("text-classification", "causal-lm", "image-classification")


def run_argv(run: Run, task: str, preset: str, steps: int, batch: int, out: Path) -> list[str]:
    argv = ["--task", task, "--model_preset", preset, "--max_train_steps", str(steps),
            "--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", str(batch),
            "--max_train_samples", str(max(64, 4 * batch * steps)), "--max_eval_samples", str(2 * batch),
            "--no_save_model", "--report_to", "none", "--overwrite_output_dir", "--output_dir", str(out), *run.args]
    if SEQ[task]:
        argv += ["--max_seq_length", str(SEQ[task])]
    return argv


def _single_process(config: str) -> dict | None:
    """The env `accelerate launch` would set for a one-process config, or None when it needs a real launch."""
    cfg = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())
    if cfg.get("distributed_type", "NO") != "NO" or cfg.get("num_processes", 1) != 1:
        return None
    return {"ACCELERATE_MIXED_PRECISION": str(cfg.get("mixed_precision", "no"))}


def fork_recipe(recipe: str, argv: list[str], log: Path, threads: int, env: dict[str, str] | None = None) -> bool:
    """recipes/<recipe>.py's main(argv) in a forked child of this process (the stack imported once, here), as
    `python recipes/<recipe>.py` would run it; its output to `log`. True when it finished. A refusal (SystemExit)
    leaves its message as the log's last line; any other error its traceback. benchmarks/ladder.py runs its rungs
    with it too."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env or {})
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
            import importlib.util

            spec = importlib.util.spec_from_file_location(f"recipe_{recipe}", ROOT / "recipes" / f"{recipe}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.main(argv)
            code = 0
        except SystemExit as e:
            print(e, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - the parent reports it
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def execute(run: Run, argv: list[str], out: Path, threads: int) -> tuple[dict | None, str | None, float]:
    """Run one recipe; returns (results.json, error, wall seconds)."""
    t0 = time.perf_counter()
    env = _single_process(run.config)
    log = out.parent / f"{out.name}.log"
    out.mkdir(parents=True, exist_ok=True)
    if env is not None:
        ok = fork_recipe(run.recipe, argv, log, threads, env)
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "accelerate_configs" / run.config), str(ROOT / "recipes" / f"{run.recipe}.py"), *argv]
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
        ok = proc.returncode == 0
    wall = time.perf_counter() - t0
    if not ok or not (out / "results.json").exists():
        tail = log.read_text()[-1500:] if log.exists() else ""
        return None, tail.strip().splitlines()[-1] if tail.strip() else "failed", wall
    return json.loads((out / "results.json").read_text()), None, wall


def planner_prediction(run: Run, task: str, preset: str, batch: int, num_processes: int) -> dict | None:
    """What shared/tools/plan.py predicts for this run on this CPU, per process."""
    if run.technique is None:
        return None
    config, task, _ = load_config(None, preset, task, None, None)
    spec = model_spec(config, task, f"preset:{preset}")
    precision = next((run.args[i + 1] for i, a in enumerate(run.args[:-1]) if a == "--mixed_precision"), "fp32")
    # Accumulation keeps one micro-batch's activations at a time: the prediction is the same as without it.
    forked = _single_process(run.config) is not None
    return predict_cpu_run(spec, run.technique, precision, num_processes, batch, SEQ[task],
                           runtime_bytes=FORKED_RUNTIME_BYTES if forked else CPU_RUNTIME_BYTES)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="The subset CI runs: a few minutes on 2 CPU cores.")
    ap.add_argument("--output_dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--work_dir", default=None, help="Run outputs; default: <output_dir>/runs (not committed).")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--presets", nargs="+", default=None, choices=("tiny", "base", *DECODERS))
    ap.add_argument("--base_recipes", nargs="+", default=None,
                    help="Only these recipes on the base preset (the tests run baseline only, to stay in budget).")
    ap.add_argument("--recipes", nargs="+", default=None, help="Only these recipes.")
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    args = ap.parse_args(argv)
    setup = QUICK if args.quick else FULL
    presets = args.presets or setup["presets"]
    out_dir = Path(args.output_dir)
    work = Path(args.work_dir) if args.work_dir else out_dir / "runs"
    runs = [r for r in RUNS if (r.quick or not args.quick) and (not args.recipes or r.recipe in args.recipes)]
    jobs = [(r, t, p) for p in presets for t in args.tasks for r in runs
            if (r.recipe, t, p) not in setup["skip"] and p in r.presets and t in r.tasks
            and not (p in DECODERS and t == "image-classification")  # text models
            and not (p == "tiny-moe" and t == "text-classification")  # refused: Mixtral's classifier has no router loss
            and not (p == "base" and args.base_recipes and r.recipe not in args.base_recipes)]
    rows = []
    bar = tqdm(jobs, desc="matrix", dynamic_ncols=True)
    for i, (run, task, preset) in enumerate(bar):
        bar.set_postfix_str(f"{run.name} {task} {preset}")
        batch = setup["batch"][preset]
        out = work / f"{i:02d}-{run.recipe}-{task}-{preset}"
        res, err, wall = execute(run, run_argv(run, task, preset, setup["steps"], batch, out), out, args.threads)
        row = {"run": run.name, "recipe": run.recipe, "config": run.config, "args": list(run.args), "task": task,
               "preset": preset, "batch": batch, "seq": SEQ[task], "steps": setup["steps"], "wall_s": round(wall, 1),
               "status": "ok" if res else "failed", "error": err}
        if res:
            row["measured"] = {k: res.get(k) for k in (
                "num_processes", "distributed_type", "mixed_precision", "compute_dtype", "peak_memory_bytes",
                "param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes_without_checkpointing",
                "activation_bytes_with_checkpointing", "peak_grad_bytes", "train_tokens_per_second",
                "train_samples_per_second",
                "train_loss", "initial_loss", "eval_accuracy", "eval_loss", "eval_perplexity")}
            row["predicted"] = planner_prediction(run, task, preset, batch, res["num_processes"])
        rows.append(row)
    _relative_to_baseline(rows)
    report = {"machine": machine(), "setup": {**setup, "presets": list(presets), "skip": sorted(setup["skip"])},
              "quick": args.quick, "rows": rows}
    write_outputs(report, out_dir)
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(failed)} runs ok, {len(failed)} failed; wrote {out_dir}/matrix.md, .json, .png")
    for r in failed:
        print(f"FAILED {r['run']} {r['task']} {r['preset']}: {r['error']}")
    return report


def _relative_to_baseline(rows: list[dict]) -> None:
    base = {(r["task"], r["preset"]): r for r in rows
            if r["status"] == "ok" and r["recipe"] == "baseline" and r["config"] == "single_process.yaml"}
    for r in rows:
        b = base.get((r["task"], r["preset"]))
        if r["status"] != "ok" or b is None:
            continue
        m, bm = r["measured"], b["measured"]
        r["model_states_vs_baseline"] = _model_states(m) / _model_states(bm)
        r["loss_vs_baseline"] = (m["train_loss"] / bm["train_loss"] if m["train_loss"] and bm["train_loss"] else None)


def _model_states(measured: dict) -> float:
    return sum(measured[k][0] for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "accelerate": accelerate.__version__, "date": time.strftime("%Y-%m-%d")}


def _mb(v: float | None) -> str:
    return "" if v is None else f"{v / 2**20:,.1f}"


def write_outputs(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "matrix.json").write_text(json.dumps(report, indent=1))
    m = report["machine"]
    lines = ["<!-- generated by python benchmarks/matrix.py; do not edit -->",
             f"# Technique matrix{' (quick)' if report['quick'] else ''}", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 2**30:.0f} GiB, no GPU; "
             f"torch {m['torch']}, transformers {m['transformers']}, accelerate {m['accelerate']}; {m['date']}.",
             f"Each run: {report['setup']['steps']} optimizer steps, built-in data, batch per preset "
             f"{report['setup']['batch']}, sequence {SEQ['text-classification']} (text) / {SEQ['causal-lm']} "
             "(causal LM) / 17 or 197 patches (ViT tiny / base). Memory per process in MiB; measured (pred = "
             "shared/tools/plan.py). Peak = peak RSS of the process, with the ~450 MiB Python/torch runtime of a "
             "process "
             "forked from the matrix (a fresh `accelerate launch` process has 85 MiB more, see docs/planner.md). "
             "Model states (params + grads + optimizer, per process) and loss relative to the baseline recipe of the "
             "same task and preset, same run. No speed column: one short run per cell is not a stable ratio (see "
             "benchmarks/overhead.py and the technique pages for timed medians)"
             f"{'; ' + report['note'] if report.get('note') else ''}.", "",
             "| run | task | preset | procs | peak (pred) | params (pred) | grads (pred) | optim (pred) "
             "| activations saved (pred) | model states vs baseline | loss vs baseline | eval | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['run']} | {r['task']} | {r['preset']} | | | | | | | | | | failed: "
                         f"{(r['error'] or '')[:80]} |")
            continue
        me, pr = r["measured"], r.get("predicted") or {}

        def both(key: str, m_=me, p_=pr) -> str:
            mv = m_.get(key)
            mv = mv[0] if isinstance(mv, list) else mv
            return f"{_mb(mv)} ({_mb(p_.get(key))})" if mv is not None else ""

        act = "activation_bytes_without_checkpointing"
        if me.get("activation_bytes_with_checkpointing") is not None:
            act_cell = f"{both(act)} / ckpt {both('activation_bytes_with_checkpointing')}"
        else:
            act_cell = ""
        ev = me.get("eval_accuracy")
        ev = f"acc {ev:.2f}" if ev is not None else (f"ppl {me['eval_perplexity']:.0f}"
                                                      if me.get("eval_perplexity") else "")
        sv, lv = r.get("model_states_vs_baseline"), r.get("loss_vs_baseline")
        lines.append(f"| {r['run']} | {r['task']} | {r['preset']} | {me['num_processes']} | "
                     f"{both('peak_memory_bytes')} | {both('param_bytes')} | {both('grad_bytes')} | "
                     f"{both('optimizer_state_bytes')} | {act_cell} | {'' if sv is None else f'{sv:.3f}'} | "
                     f"{'' if lv is None else f'{lv:.3f}'} | {ev} | ok |")
    (out_dir / "matrix.md").write_text("\n".join(lines) + "\n")
    plot(report, out_dir / "matrix.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["status"] == "ok"]
    presets = sorted({r["preset"] for r in rows}, key=["tiny", "base", *DECODERS].index)
    # One panel per row, full width: a preset can have 30+ runs, whose labels need the room.
    most = max(sum(r["preset"] == p for r in rows) for p in presets)
    fig, axes = plt.subplots(2 * len(presets), 1, figsize=(max(12, 0.42 * most), 4.6 * 2 * len(presets)),
                             squeeze=False)
    for i, preset in enumerate(presets):
        rs = [r for r in rows if r["preset"] == preset]
        labels = [f"{r['recipe']}{' ' + ' '.join(r['args'][1::2]) if r['args'] else ''}"
                  f"{'' if r['config'] == 'single_process.yaml' else ' ' + r['config']}\n{r['task'].split('-')[0]}"
                  for r in rs]
        x = range(len(rs))
        mib = 2**20
        parts = [("params", "param_bytes", "#4c72b0"), ("grads", "grad_bytes", "#55a868"),
                 ("optimizer", "optimizer_state_bytes", "#c44e52")]
        ax = axes[2 * i][0]
        bottom = [0.0] * len(rs)
        for label, key, color in parts:
            vals = [r["measured"][key][0] / mib for r in rs]
            ax.bar(x, vals, bottom=bottom, color=color, label=label, width=0.6)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        peak = [r["measured"]["peak_memory_bytes"][0] / mib for r in rs]
        rest = [max(0.0, p - b) for p, b in zip(peak, bottom, strict=True)]
        ax.bar(x, rest, bottom=bottom, color="#cccccc", width=0.6,
               label="rest of peak: runtime, activations, buffers")
        ax.scatter(x, peak, marker="_", s=400, color="black", label="peak RSS (measured)", zorder=3)
        pred = [(r.get("predicted") or {}).get("peak_memory_bytes") for r in rs]
        ax.scatter([j for j, p in zip(x, pred, strict=True) if p], [p / mib for p in pred if p], marker="x",
                   color="orange", label="peak (planner)", zorder=4)
        ax.set_title(f"{preset} preset: memory per process (MiB)")
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, max(peak + [p / mib for p in pred if p]) * 1.45)  # headroom: the legend sits above the bars
        ax.legend(fontsize=7, loc="upper center", ncol=3, framealpha=0.9)
        ax = axes[2 * i + 1][0]
        states = [r.get("model_states_vs_baseline") or 0 for r in rs]
        ax.bar(x, states, color="#8172b2", width=0.6)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_title(f"{preset} preset: model-state bytes per process vs baseline (same task)"
                     f"{chr(10) + report['note'] if report.get('note') else ''}", fontsize=9)
        ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=7)
    fig.suptitle(f"Technique matrix on {report['machine']['cores']} CPU cores "
                 f"({report['setup']['steps']} steps per run)", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985))  # room for the suptitle
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    main()
