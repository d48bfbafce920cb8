"""The compatibility matrix: every combination of sharding x offload x weights (8-bit optimizer, LoRA, int8 / NF4
base, DoRA on NF4, the chunked loss) x activation checkpointing x precision, each run for real in 2 processes
through recipes/combined.py; and torchao's 8-bit, 4-bit and FP8 AdamW, through recipes/optim_low_bit.py, under every
sharding + offload row.

    python benchmarks/compat_sweep.py              # 269 combinations, ~115 min on 2 CPU cores (see default_cells)
    python benchmarks/compat_sweep.py --all        # all 612
    python benchmarks/compat_sweep.py --quick      # one cell per outcome, for the tests
    python benchmarks/compat_sweep.py --only zero3 --only lora
    python benchmarks/compat_sweep.py --model_preset tiny-qwen2 --only zero3    # those cells on a decoder preset

Each cell ends as one of
  works    trained 2 steps, and did what was asked: 2 processes, the sharding and offload asked for, the precision
           asked for seen on the activations, a finite loss, LoRA / quantized layers present when asked;
  refused  stopped before training with a message naming the problem and the fix (the recipes' own checks);
  broken   crashed, hung, or trained something other than what was asked (then the rule
           belongs in shared/core/rules.py).
Writes docs/results/compat.md, compat.json and compat.png (or --output_dir).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core import rules  # noqa: E402
from shared.core.launch import free_port  # noqa: E402
from shared.tools import catalogue  # noqa: E402  (every technique's rules; the recipes' SUPPORT)

# sharding -> (accelerate config, launch flags per offload); offloads not listed do not exist for that sharding. The
# words are shared/core/rules.py's (SHARDINGS, OFFLOADS), as results.json reports them: zero3's offloads move the
# parameters too, zero1/2's the optimizer state only, FSDP's the parameters (and what lives with them).
SHARDING = {
    "ddp": ("multi_cpu.yaml", {"none": []}),
    "zero1": ("zero1.yaml", {"none": [], "cpu": ["--offload_optimizer_device", "cpu"],
                             "nvme": ["--offload_optimizer_device", "nvme"]}),
    "zero2": ("zero2.yaml", {"none": [], "cpu": ["--offload_optimizer_device", "cpu"],
                             "nvme": ["--offload_optimizer_device", "nvme"]}),
    "zero3": ("zero3.yaml", {"none": [],
                             "cpu": ["--offload_optimizer_device", "cpu", "--offload_param_device", "cpu"],
                             "nvme": ["--offload_optimizer_device", "nvme", "--offload_param_device", "nvme"]}),
    "fsdp": ("fsdp.yaml", {"none": [], "cpu": ["--fsdp_offload_params", "true"]}),
}
# weights -> recipe flags. NF4 under ZeRO-3 / FSDP stores its packed weights in bf16, the documented way to shard it.
WEIGHTS = {
    "full": [],
    "8bit-optim": ["--optim", "adamw_bnb_8bit"],
    "lora": ["--lora"],
    "int8+lora": ["--load_in", "8bit", "--lora"],
    "nf4+lora": ["--load_in", "4bit", "--lora"],
    "nf4+dora": ["--load_in", "4bit", "--lora", "--use_dora"],
    "chunked-loss": ["--chunked_loss"],
    "ao-8bit-optim": ["--optim", "adamw_torchao_8bit"],
    "ao-4bit-optim": ["--optim", "adamw_torchao_4bit"],
    "ao-fp8-optim": ["--optim", "adamw_torchao_fp8"],
}
# torchao's low-bit AdamWs are shown by their own recipe (it has no --gradient_checkpointing); the rest by combined.py.
RECIPE_OF = {w: "recipes/optim_low_bit.py" for w in ("ao-8bit-optim", "ao-4bit-optim", "ao-fp8-optim")}
PRECISIONS = ("fp32", "bf16", "fp16")
DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUICK = [  # cells of the default sweep: a combination that works, and two that were broken and are now refused
    ("zero3", "none", "lora", True, "bf16", "tiny-llama"),
    ("zero2", "cpu", "8bit-optim", True, "fp32"),
    ("fsdp", "none", "int8+lora", True, "fp32"),
]
# The decoder presets: the model_type each must train, and the mixtures of experts, whose router's load-balancing
# loss must be in the loss (also benchmarks/decoder_presets.py's). The last three are shaped as checkpoints ship:
# stored in bf16, a tied head (qwen2), router logits off (qwen3-moe), a sliding window (mistral).
PRESET_OF = {"tiny-llama": "llama", "tiny-moe": "mixtral", "tiny-qwen2": "qwen2", "tiny-qwen3-moe": "qwen3_moe",
             "tiny-mistral": "mistral"}
MOE = ("tiny-moe", "tiny-qwen3-moe")


def bf16_storage_lifts_a_rule(sharding: str, weights: str) -> bool:
    """Whether the rule table (shared/core/rules.py) refuses this 4-bit cell's uint8 packing and not a bfloat16 one:
    the sweep follows the table's fix rather than restating the rule."""
    run = catalogue.recipe_run(recipe="combined", sharding=sharding, launched=sharding, num_processes=2,
                               load_in="4bit", lora=True, dora=weights == "nf4+dora")
    return len(rules.refusals(replace(run, quant_storage="bfloat16"))) < len(rules.refusals(run))


@dataclass(frozen=True)
class Cell:
    sharding: str
    offload: str
    weights: str
    checkpointing: bool
    precision: str
    preset: str = "tiny"  # --model_preset: tiny (GPT-2), or a decoder preset (PRESET_OF)

    @property
    def name(self) -> str:
        return (f"{self.sharding}{'' if self.offload == 'none' else '+' + self.offload + '-offload'} {self.weights}"
                f"{' +ckpt' if self.checkpointing else ''} {self.precision}"
                f"{'' if self.preset == 'tiny' else ' ' + self.preset}")

    def command(self, out: Path | None = None, probe: bool = False) -> list[str]:
        config, offloads = SHARDING[self.sharding]
        recipe_args = [*WEIGHTS[self.weights], "--mixed_precision", {"fp32": "no"}.get(self.precision, self.precision)]
        if self.checkpointing:
            recipe_args.append("--gradient_checkpointing")
        if self.weights in ("nf4+lora", "nf4+dora") and bf16_storage_lifts_a_rule(self.sharding, self.weights):
            recipe_args += ["--bnb_4bit_quant_storage", "bfloat16"]
        if self.offload == "nvme" and self.weights not in RECIPE_OF:  # recipes that set up DeepSpeed take a path
            recipe_args += ["--nvme_path", str((out or Path("/tmp/nvme")) / "nvme")]
        launch = ["accelerate", "launch", "--config_file", f"accelerate_configs/{config}", *offloads[self.offload]]
        recipe = [RECIPE_OF.get(self.weights, "recipes/combined.py")]
        recipe = ["benchmarks/compat_cell.py", *recipe] if probe else recipe
        preset = [] if self.preset == "tiny" else ["--model_preset", self.preset]
        return [*launch, *recipe, "--task", "causal-lm", *preset, *recipe_args]


def all_cells() -> list[Cell]:
    """The whole product (--all): 612 runs, about 3.5 h on 2 CPU cores."""
    cells = []
    for sharding, (_, offloads) in SHARDING.items():
        for offload, weights, ckpt, precision in itertools.product(offloads, WEIGHTS, (False, True), PRECISIONS):
            if not (ckpt and weights in RECIPE_OF):
                cells.append(Cell(sharding, offload, weights, ckpt, precision))
    return cells


def default_cells() -> list[Cell]:
    """What fits in ~45 min on 2 CPU cores; the table leaves the rest blank (not run), and --all runs it.

    Every sharding + offload row x every weights variant, with checkpointing, in fp32 and bf16; without checkpointing
    for full weights and LoRA in fp32; fp16 where it can run on CPU (DDP, FSDP) and one fp16 cell per ZeRO row (the
    DeepSpeed CPU refusal comes before anything else is set up). ZeRO-1/2 + NVMe is refused before any other check:
    one cell each. The decoder presets, under every sharding (no offload), with checkpointing: tiny-llama with full
    weights, LoRA and NF4 + LoRA, tiny-moe with full weights; and the presets shaped as checkpoints ship: tiny-qwen2
    (tied head) with full weights and LoRA, tiny-qwen3-moe (router logits off) and tiny-mistral (sliding window) with
    full weights. These cells save their model, and the sweep reloads it (from_pretrained, a tied head tied again).
    """
    cells = []
    for sharding, (_, offloads) in SHARDING.items():
        for offload in offloads:
            if sharding in ("zero1", "zero2") and offload == "nvme":
                cells.append(Cell(sharding, offload, "full", False, "fp32"))
                continue
            for weights in WEIGHTS:
                if weights in RECIPE_OF:  # torchao's optimizers, no checkpointing; ZeRO is refused whatever the dtype
                    precisions = ("fp32",) if sharding.startswith("zero") else ("fp32", "bf16")
                    cells += [Cell(sharding, offload, weights, False, p) for p in precisions]
                    continue
                cells += [Cell(sharding, offload, weights, True, p) for p in ("fp32", "bf16")]
                if weights in ("full", "lora"):
                    cells.append(Cell(sharding, offload, weights, False, "fp32"))
                if not sharding.startswith("zero"):
                    cells.append(Cell(sharding, offload, weights, True, "fp16"))
            if sharding.startswith("zero"):
                cells.append(Cell(sharding, offload, "full", True, "fp16"))
    # The decoder presets (Llama, and Mixtral: a mixture of experts) under every sharding: full weights, LoRA, QLoRA.
    for sharding in SHARDING:
        cells += [Cell(sharding, "none", weights, True, precision, "tiny-llama")
                  for weights, precision in (("full", "fp32"), ("lora", "bf16"), ("nf4+lora", "bf16"))]
        cells.append(Cell(sharding, "none", "full", True, "bf16", "tiny-moe"))
        cells += [Cell(sharding, "none", "full", True, "bf16", "tiny-qwen2"),
                  Cell(sharding, "none", "lora", True, "bf16", "tiny-qwen2"),
                  Cell(sharding, "none", "full", True, "bf16", "tiny-qwen3-moe"),
                  Cell(sharding, "none", "full", True, "bf16", "tiny-mistral")]
    return cells


RUN_ARGS = ["--max_train_steps", "2", "--per_device_train_batch_size", "4", "--max_train_samples", "32",
            "--max_eval_samples", "8", "--per_device_eval_batch_size", "4", "--no_save_model", "--report_to", "none",
            "--logging_steps", "1", "--ddp_timeout", "120"]


def launch_logged(cmd: list[str], out: Path, timeout: int) -> tuple[str, int | None, float]:
    """Run a cell's launch into out/launch.log: (its output, exit code or None when it hung, seconds). A hung launch
    is killed with every worker (torch's launcher starts them outside its process group). Also
    benchmarks/decoder_presets.py's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        import psutil

        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        log, code = proc.communicate()[0], None
    (out / "launch.log").write_text(log)
    return log, code, time.perf_counter() - t0


def run_cell(cell: Cell, out: Path, timeout: int) -> dict:
    """Launch the cell; classify how it ended. Returns the row for the table."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = cell.command(out, probe=True)
    # A decoder preset's cell saves its model as a user's run does, and reloads it below; the grid's cells do not.
    run_args = RUN_ARGS if cell.preset == "tiny" else [a for a in RUN_ARGS if a != "--no_save_model"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *cmd[2:],
           *run_args, "--overwrite_output_dir", "--output_dir", str(out)]
    log, code, seconds = launch_logged(cmd, out, timeout)
    row = {**asdict(cell), "name": cell.name, "command": " ".join(cell.command()), "wall_s": round(seconds, 1)}
    results = out / "results.json"
    refused = sorted(out.glob("refused_rank*.txt"))
    broken = sorted(out.glob("broken_rank*.txt"))
    if code == 0 and results.exists():
        r = json.loads(results.read_text())
        problems = what_went_wrong(cell, r)
        if cell.preset != "tiny":
            from benchmarks.decoder_presets import reload_saved  # (it imports this module)

            row["saved"], problem = reload_saved("causal-lm", out)
            problems += [problem] if problem else []
        row.update(status="broken" if problems else "works", detail="; ".join(problems) or None,
                   train_loss=r.get("train_loss"), compute_dtype=r.get("compute_dtype"),
                   peak_memory_bytes=max(r.get("peak_memory_bytes") or [0]),
                   trainable_params=r.get("trainable_params"), total_params=r.get("total_params"),
                   optimizer_class=r.get("optimizer_class"), model_type=r.get("model_type"))
    elif code is None:
        row.update(status="broken", detail=f"hung: no end within {timeout} s")
    elif refused and not broken:
        message = refused[0].read_text().strip().removeprefix("Refused before training: ")  # every refusal says it
        stopped = message.startswith("Stopped:")  # the numerical guards: it trained, then diverged
        row.update(status="broken" if stopped else "refused", detail=message)
    elif broken:
        tb = broken[0].read_text().strip().splitlines()
        row.update(status="broken", detail=tb[-1] if tb else "exception")
    else:
        last = [line for line in log.strip().splitlines() if line.strip()][-1:] or ["?"]
        row.update(status="broken", detail=f"exit code {code}: {last[0][:300]}")
    return row


def what_went_wrong(cell: Cell, r: dict) -> list[str]:
    """What a finished run did differently from what the cell asked: an empty list means it works."""
    problems = []
    if r.get("num_processes") != 2:
        problems.append(f"{r.get('num_processes')} process(es), not 2")
    if r.get("sharding") != cell.sharding:
        problems.append(f"sharding {r.get('sharding')}, not {cell.sharding}")
    if r.get("offload") != cell.offload:
        problems.append(f"offload {r.get('offload')}, not {cell.offload}")
    if r.get("compute_dtype") != DTYPE[cell.precision]:
        problems.append(f"computed in {r.get('compute_dtype')}, not {DTYPE[cell.precision]}")
    loss = r.get("train_loss")
    if loss is None or not math.isfinite(loss):
        problems.append(f"loss {loss}")
    if cell.weights in ("int8+lora", "nf4+lora", "nf4+dora") and not r.get("quantized_layers"):
        problems.append("no quantized layers")
    adapters = "lora" in cell.weights or "dora" in cell.weights
    if adapters and r.get("trainable_params", 0) >= 0.5 * (r.get("total_params") or 1e30):
        problems.append("LoRA but most parameters train")
    if cell.weights == "nf4+dora" and not r.get("use_dora"):
        problems.append("DoRA asked for, LoRA trained")
    if cell.preset != "tiny" and r.get("model_type") != PRESET_OF[cell.preset]:
        problems.append(f"trained a {r.get('model_type')} model, not {cell.preset}")
    if cell.preset in MOE and r.get("router_aux_loss") is None:
        problems.append("no router load-balancing loss in the mixture of experts' loss")
    if cell.weights == "chunked-loss" and not r.get("loss_chunks"):
        problems.append("no chunked loss in the run")
    if cell.weights == "8bit-optim" and "8bit" not in str(r.get("optimizer_class")).lower():
        problems.append(f"optimizer {r.get('optimizer_class')}, not 8-bit")
    if cell.weights in RECIPE_OF and not r.get("tensors_with_quantized_state"):
        problems.append(f"optimizer {r.get('optimizer_class')} kept no quantized state")
    return problems


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}"


def write_outputs(rows: list[dict], out_dir: Path, quick: bool, machine_note: str | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_note or machine(), "quick": quick, "rows": rows}
    (out_dir / "compat.json").write_text(json.dumps(report, indent=1))
    counts = {s: sum(r["status"] == s for r in rows) for s in ("works", "refused", "broken")}
    lines = ["<!-- generated by python benchmarks/compat_sweep.py; do not edit -->",
             f"# Compatibility matrix{' (quick)' if quick else ''}", "",
             f"Made by `python benchmarks/compat_sweep.py` on {report['machine']}.",
             "Every cell is a real run of recipes/combined.py (the ao- optimizers: recipes/optim_low_bit.py) in 2 "
             "processes (tiny GPT-2, or the decoder preset the cell names, built-in data, 2 steps). "
             "**works**: trained, with 2 processes, the sharding, offload and precision asked for (checked on the "
             "run, not on the config), a finite loss, LoRA / quantized layers present when asked. **refused**: "
             "stopped before training with the message shown. **broken**: crashed, hung, or did something else.",
             "", f"{counts['works']} work, {counts['refused']} refused, {counts['broken']} broken, "
             f"of {len(rows)} combinations.", ""]
    # The grid (tiny GPT-2; the decoder presets' cells are listed below it): one row per sharding+offload, one column
    # per weights x checkpointing x precision.
    by_key = {(r["sharding"], r["offload"], r["weights"], r["checkpointing"], r["precision"]): r for r in rows
              if r.get("preset", "tiny") == "tiny"}
    cols = [(w, c, p) for w in WEIGHTS for c in (False, True) for p in PRECISIONS
            if any(k[2:] == (w, c, p) for k in by_key)]  # columns with at least one run
    mark = {"works": "✓", "refused": "R", "broken": "✗"}
    lines += ["✓ works · R refused · ✗ broken · blank: not run. Columns: weights / checkpointing / precision.", "",
              "| sharding + offload | " + " | ".join(f"{w}{' ckpt' if c else ''} {p}" for w, c, p in cols) + " |",
              "|---" * (len(cols) + 1) + "|"]
    for sharding, (_, offloads) in SHARDING.items():
        for offload in offloads:
            cells = [by_key.get((sharding, offload, w, c, p)) for w, c, p in cols]
            if not any(cells):
                continue
            lines.append(f"| {sharding}{'' if offload == 'none' else ' + ' + offload + ' offload'} | "
                         + " | ".join(mark[x["status"]] if x else "" for x in cells) + " |")
    decoders = [r for r in rows if r.get("preset", "tiny") != "tiny"]
    if decoders:
        lines += ["", "Decoder presets (`--model_preset`): " + ", ".join(
            f"{r['name']} {mark[r['status']]}" for r in decoders) + "."]
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] != "works":
            reasons.setdefault(f"{r['status']}: {r['detail']}", []).append(r["name"])
    lines += ["", "## Why each combination is refused or broken", ""]
    for reason, names in sorted(reasons.items()):
        lines.append(f"- **{len(names)}×** {reason.splitlines()[0][:400]}  \n  e.g. `{names[0]}`"
                     + (f" and {len(names) - 1} more" if len(names) > 1 else ""))
    lines += ["", "## Every run", "", "| combination | status | loss | peak RSS MiB / process | seconds | command |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        loss = f"{r['train_loss']:.3f}" if r.get("train_loss") is not None else ""
        peak = f"{r['peak_memory_bytes'] / 2**20:,.0f}" if r.get("peak_memory_bytes") else ""
        lines.append(f"| {r['name']} | {r['status']} | {loss} | {peak} | {r['wall_s']} | `{r['command']}` |")
    (out_dir / "compat.md").write_text("\n".join(lines) + "\n")
    plot(rows, cols, out_dir / "compat.png")


def plot(rows: list[dict], cols: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    by_key = {(r["sharding"], r["offload"], r["weights"], r["checkpointing"], r["precision"]): r for r in rows
              if r.get("preset", "tiny") == "tiny"}
    row_keys = [(s, o) for s, (_, offs) in SHARDING.items() for o in offs
                if any((s, o, *c) in by_key for c in cols)]
    code = {"works": 1, "refused": 2, "broken": 3}
    grid = [[code[by_key[(s, o, *c)]["status"]] if (s, o, *c) in by_key else 0 for c in cols] for s, o in row_keys]
    fig, ax = plt.subplots(figsize=(max(8, 0.38 * len(cols) + 3), 0.45 * len(row_keys) + 2.4))
    ax.imshow(grid, cmap=ListedColormap(["#eeeeee", "#55a868", "#dd8452", "#c44e52"]), vmin=0, vmax=3,
              aspect="auto")
    ax.set_yticks(range(len(row_keys)), [s if o == "none" else f"{s} + {o} offload" for s, o in row_keys])
    ax.set_xticks(range(len(cols)), [f"{w}{' ckpt' if c else ''} {p}" for w, c, p in cols], rotation=70,
                  ha="right", fontsize=7)
    ax.set_xticks([x - 0.5 for x in range(1, len(cols))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(row_keys))], minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in ("#55a868", "#dd8452", "#c44e52", "#eeeeee")]
    ax.legend(handles, ["works", "refused before training,\nwith the fix", "broken", "not run"], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.set_title("Which techniques combine: 2 processes, tiny GPT-2, each cell a real run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="One cell per outcome (the tests run it).")
    ap.add_argument("--all", action="store_true", help="Every combination (612 runs).")
    ap.add_argument("--only", action="append", default=[],
                    help="Keep cells whose name contains this (repeatable: all must match).")
    ap.add_argument("--output_dir", default=str(ROOT / "docs" / "results"))
    ap.add_argument("--work_dir", default=None, help="Run outputs; default: <output_dir>/compat_runs (not committed).")
    ap.add_argument("--timeout", type=int, default=300, help="Seconds before a cell counts as hung.")
    ap.add_argument("--model_preset", default=None, choices=("tiny", *PRESET_OF),
                    help="Run the chosen cells on this model instead of each cell's own (tiny GPT-2 unless named).")
    ap.add_argument("--update", action="store_true",
                    help="Replace only the cells run now in the existing compat.json (after a fix).")
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    cells = [Cell(*c) for c in QUICK] if args.quick else all_cells() if args.all else default_cells()
    cells = [replace(c, preset=args.model_preset) if args.model_preset else c for c in cells]
    cells = [c for c in dict.fromkeys(cells) if all(o in c.name for o in args.only)]
    work = Path(args.work_dir) if args.work_dir else Path(args.output_dir) / "compat_runs"
    rows = []
    bar = tqdm(cells, desc="compat", dynamic_ncols=True)
    for i, cell in enumerate(bar):
        bar.set_postfix_str(cell.name)
        rows.append(run_cell(cell, work / f"{i:03d}", args.timeout))
        bar.write(f"{rows[-1]['status']:8s} {cell.name}: {(rows[-1].get('detail') or '')[:150]}")
    note = None
    if args.update:
        previous = json.loads((Path(args.output_dir) / "compat.json").read_text())
        new = {r["name"]: r for r in rows}
        note = f"{previous['machine'].split(' (')[0]} ({len(new)} cells updated on {machine()})"
        rows = [new.pop(r["name"], r) for r in previous["rows"]] + list(new.values())
    write_outputs(rows, Path(args.output_dir), args.quick, note)
    return rows


if __name__ == "__main__":
    main()
