"""Every recipe on the decoder presets: `--task causal-lm` with `--model_preset tiny-llama` (Llama: RMSNorm, rotary,
GQA, SwiGLU, untied head) and `tiny-moe` (Mixtral: 4 experts, top-2, the router's load-balancing loss in the loss),
and `--task text-classification` with both (LlamaForSequenceClassification; Mixtral's classifier returns no router
loss); and, shaped as today's checkpoints ship (stored in bf16), `tiny-qwen2` (a tied head), `tiny-qwen3-moe` (router
logits off) and `tiny-mistral` (a sliding window) as causal LMs. Each under the plainest launch the recipe's row in
shared/core/rules.py allows, for 2 steps on tiny built-in data (recipes/ptq.py quantizes the baseline cell's trained
model instead), saving its model as a user's run does.

    python benchmarks/decoder_presets.py                    # every cell, ~45 min on 2 CPU cores
    python benchmarks/decoder_presets.py --only fsdp        # cells whose name contains it (repeatable)
    python benchmarks/decoder_presets.py --only fsdp --update   # rerun them, keep the other committed cells

Each cell ends as one of
  trained  2 steps, a finite loss, the model asked for (results.json's model_type), for a mixture of experts the
           router's load-balancing loss reported (the loss the recipe trained on included it), and the saved model
           loaded back by from_pretrained (every weight found, a tied head tied again), or the recipe's own form;
  refused  stopped by the rule table (shared/core/rules.py, `check` before loading or `check_built` on the built
           model) with the reason and the fix; the Run the table refused is recorded, so tests/test_decoder_presets.py
           can ask the table again and hold the doc to it;
  crashed  an exception, a hang, a refusal from outside the table, or a run that trained something other than asked.
Writes docs/results/decoder_presets.json and docs/results/decoder_presets.md (docs/decoder_presets.md is the prose).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compat_sweep import MOE, PRESET_OF, launch_logged  # noqa: E402  (what both sweeps share)
from shared.core import rules  # noqa: E402
from shared.tools.catalogue import recipes_support  # noqa: E402

# Not run here: recipes being reworked now, whose own tests train the decoder presets.
SKIPPED = {"expert_parallel": "tests/test_expert_parallel.py trains tiny-moe",
           "tensor_parallel": "tests/test_tensor_parallel.py trains tiny-llama",
           "pipeline_parallel": "its stages are being reworked (interleaved schedules)"}
# The presets shaped as checkpoints ship (bf16 storage, a tied head, router logits off, a sliding window) as causal
# LMs; the classifier of the tied one (its head is a new score layer, the tie is the embedding's alone).
CELLS = [("causal-lm", "tiny-llama"), ("causal-lm", "tiny-moe"), ("text-classification", "tiny-llama"),
         ("text-classification", "tiny-moe"), ("causal-lm", "tiny-qwen2"), ("causal-lm", "tiny-qwen3-moe"),
         ("causal-lm", "tiny-mistral")]
# ZeRO-3 rather than the row's first config (zero1): it partitions the parameters, where a model's own modules
# (rotary buffers, the experts' stacked weights) meet DeepSpeed's hooks.
CONFIG_OVERRIDE = {"zero": "zero3.yaml"}
RUN_ARGS = ["--max_train_steps", "2", "--max_train_samples", "32", "--max_eval_samples", "8",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--max_seq_length", "32",
            "--logging_steps", "1", "--report_to", "none", "--ddp_timeout", "120", "--overwrite_output_dir"]
TRAINS_FROM = {"ptq": "baseline"}  # needs a trained model: the baseline cell of the same task and preset saves one
NO_LOOP = {"ptq"}  # quantizes and evaluates, trains nothing: its results are int8_ (and fp32_) metrics, no loss
EVAL_KEYS = ("eval_perplexity", "eval_accuracy", "eval_loss", "int8_perplexity", "int8_accuracy", "fp32_perplexity",
             "fp32_accuracy")


def launch_of(recipe: str) -> tuple[str | None, int]:
    """(accelerate config, processes) of the recipe's plainest allowed launch: one process when its row allows it,
    else the first config its Support.instead names."""
    s = recipes_support()[recipe]
    if "none" in s.shardings and s.min_processes <= 1 and not s.needs_offload:
        return None, 1
    config = CONFIG_OVERRIDE.get(recipe) or re.search(r"accelerate_configs/(\w+\.yaml)", s.instead).group(1)
    text = (ROOT / "accelerate_configs" / config).read_text()
    return config, int(re.search(r"^num_processes:\s*(\d+)", text, re.M).group(1))


@dataclass(frozen=True)
class Cell:
    recipe: str
    task: str
    preset: str

    @property
    def name(self) -> str:
        return f"{self.recipe} {self.task} {self.preset}"

    def command(self, out: Path, work: Path, probe: bool = False) -> list[str]:
        config, processes = launch_of(self.recipe)
        recipe = [str(ROOT / "benchmarks" / "decoder_presets.py"), "--probe"] if probe else []
        recipe += [f"recipes/{self.recipe}.py", "--task", self.task]
        trained = TRAINS_FROM.get(self.recipe)
        model = (["--model_name_or_path", str(work / Cell(trained, self.task, self.preset).slug)] if trained
                 else ["--model_preset", self.preset])
        tail = [*recipe, *model, *RUN_ARGS, "--output_dir", str(out)]  # the model saved, as a user's run saves it
        if config is None:
            return [sys.executable, *tail] if probe else ["python", *tail]
        launch = ["accelerate", "launch", "--config_file", f"accelerate_configs/{config}"]
        return ([sys.executable, "-m", "accelerate.commands.launch", *launch[2:], "--main_process_port",
                 str(_free_port()), *tail] if probe else [*launch, *tail])

    @property
    def slug(self) -> str:
        return self.name.replace(" ", "_")


def _free_port() -> int:
    from shared.core.launch import free_port

    return free_port()


def all_cells() -> list[Cell]:
    # ptq quantizes what the baseline cell of its task and preset trained: the tiny-moe classifier is refused there.
    cells = [Cell(r, t, p) for r in recipes_support() if r not in SKIPPED for t, p in CELLS
             if (r, t, p) != ("ptq", "text-classification", "tiny-moe")]
    return sorted(cells, key=lambda c: (c.recipe not in TRAINS_FROM.values(), c.recipe in TRAINS_FROM))


def run_cell(cell: Cell, work: Path, timeout: int) -> dict:
    out = work / cell.slug
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("refused_rank*.txt"), *out.glob("broken_rank*.txt"), *out.glob("refusal_run_rank*.json"),
                out / "results.json"]:
        old.unlink(missing_ok=True)
    config, processes = launch_of(cell.recipe)
    log, code, seconds = launch_logged(cell.command(out, work, probe=True), out, timeout)
    shown = " ".join(cell.command(Path("<out>"), Path("<work>"))).replace(sys.executable, "python")
    row = {**asdict(cell), "name": cell.name, "launch": config or "one process", "processes": processes,
           "command": shown, "wall_s": round(seconds, 1)}
    refused, broken = out / "refused_rank0.txt", sorted(out.glob("broken_rank*.txt"))
    recorded = out / "refusal_run_rank0.json"
    if code == 0 and (out / "results.json").exists():
        r = json.loads((out / "results.json").read_text())
        problems = what_went_wrong(cell, r)
        saved, problem = reload_saved(cell.task, out)
        problems += [problem] if problem else []
        row.update(saved=saved, status="crashed" if problems else "trained", detail="; ".join(problems) or None,
                   train_loss=r.get("train_loss"), model_type=r.get("model_type"),
                   eval={k: r[k] for k in EVAL_KEYS if r.get(k) is not None},
                   router_aux_loss=r.get("router_aux_loss"), sharding=r.get("sharding"),
                   num_processes=r.get("num_processes"))
    elif code is None:
        row.update(status="crashed", detail=f"hung: no end within {timeout} s")
    elif broken:
        lines = [ln for ln in broken[0].read_text().strip().splitlines() if ln.strip()]
        row.update(status="crashed", detail="\n".join(lines[-4:]))
    elif refused.exists() and recorded.exists():
        message = refused.read_text().strip().removeprefix("Refused before training: ")
        row.update(status="refused", detail=message, refused_by=json.loads(recorded.read_text()))
    elif refused.exists():
        row.update(status="crashed", detail="refused outside the rule table: " + refused.read_text().strip())
    else:
        last = [ln for ln in log.strip().splitlines() if ln.strip()][-3:] or ["?"]
        row.update(status="crashed", detail=f"exit code {code}: " + " | ".join(last)[:600])
    return row


def what_went_wrong(cell: Cell, r: dict) -> list[str]:
    """What a finished run did other than the cell asked: empty when it trained as asked."""
    problems = []
    if cell.recipe in NO_LOOP:
        metric = r.get("int8_perplexity", r.get("int8_accuracy"))
        if metric is None or not math.isfinite(metric):
            problems.append(f"quantized model's metric {metric}")
        if r.get("model_type") != PRESET_OF[cell.preset]:
            problems.append(f"quantized a {r.get('model_type')} model, not {PRESET_OF[cell.preset]}")
        if not r.get("quantized_layers"):
            problems.append("no layer was quantized")
        return problems
    loss = r.get("train_loss")
    if loss is None or not math.isfinite(loss):
        problems.append(f"train_loss {loss}")
    if r.get("model_type") != PRESET_OF[cell.preset]:
        problems.append(f"trained a {r.get('model_type')} model, not {PRESET_OF[cell.preset]} ({cell.preset})")
    if cell.preset in MOE and r.get("router_aux_loss") is None:
        problems.append(f"{cell.preset} trained without the router's load-balancing loss (no router_aux_loss)")
    if r.get("num_processes") != launch_of(cell.recipe)[1]:
        problems.append(f"{r.get('num_processes')} processes, not {launch_of(cell.recipe)[1]}")
    return problems


def reload_saved(task: str, out: Path) -> tuple[str | None, str | None]:
    """(what the run saved, a problem or None): a whole model that from_pretrained loads with every weight found
    (and a tied head tied again), or the recipe's own form (an adapter, a quantized model)."""
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        import transformers

        from shared.core.models import _AUTO_CLASS_NAMES

        auto = getattr(transformers, _AUTO_CLASS_NAMES[task])
        try:
            model, info = auto.from_pretrained(out, output_loading_info=True)
        except Exception as err:  # noqa: BLE001  (what failed is the cell's detail)
            return "model", f"from_pretrained failed on the saved model: {type(err).__name__}: {err}"[:600]
        bad = {k: v for k, v in info.items() if v}
        if bad:
            return "model", f"from_pretrained of the saved model: {bad}"[:600]
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if model.config.tie_word_embeddings and head is not None and head.weight is not embedding.weight:
            return "model", "the saved model reloads untied (its config ties the head to the embedding)"
        return "model", None
    for name, kind in (("adapter_model.safetensors", "adapter"), ("adapter/adapter_model.safetensors", "adapter"),
                       ("quantized_model.pt", "quantized model")):
        if (out / name).exists():
            return kind, None
    return None, "no model saved"


# ---------------------------------------------------------------- the probe: one recipe run, as launched


def probe(argv: list[str]) -> None:
    """`decoder_presets.py --probe recipes/X.py ...`: run the recipe as __main__ (benchmarks/compat_cell.py records
    how it ended), and record the Run the rule table refused, with whether check or check_built refused it."""
    out = Path(argv[argv.index("--output_dir") + 1])
    rank = os.environ.get("RANK", "0")
    for name in ("refusals", "built_refusals"):
        original = getattr(rules, name)

        def recorded(run: rules.Run, _original=original, _name=name) -> list[str]:
            found = _original(run)
            if found:
                out.mkdir(parents=True, exist_ok=True)
                run_fields = {k: v for k, v in asdict(run).items() if k != "support"}  # the recipe's: refusal_of
                (out / f"refusal_run_rank{rank}.json").write_text(json.dumps({"via": _name, "run": run_fields}))
            return found

        setattr(rules, name, recorded)  # check() and check_built() look them up in the module when they run
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compat_cell

    sys.argv = [compat_cell.__file__, *argv]
    compat_cell.main()


def refusal_of(recorded: dict) -> str:
    """What the rule table says today for a recorded refused Run (tests/test_decoder_presets.py)."""
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in recorded["run"].items()}
    support = recipes_support().get(fields["recipe"])  # recorded without it: the recipe's own SUPPORT
    return " ".join(getattr(rules, recorded["via"])(rules.Run(**fields, support=support)))


# ---------------------------------------------------------------- outputs


def machine() -> str:
    import torch
    import transformers

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    return (f"{cpu}, {os.cpu_count()} CPU cores, no GPU (gloo for several processes); torch {torch.__version__}, "
            f"transformers {transformers.__version__}; {time.strftime('%Y-%m-%d')}")


def saved_words(r: dict) -> str:
    """What a trained cell saved: a model from_pretrained reloaded, or the recipe's own form."""
    if r["status"] != "trained":
        return ""
    return {"model": "model, reloaded"}.get(r.get("saved"), r.get("saved") or "")


def write_outputs(rows: list[dict], json_path: Path, md_path: Path, note: str) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": note, "run_args": RUN_ARGS, "skipped": SKIPPED,
              "rows": rows}
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("trained", "refused", "crashed")}
    by = {(r["recipe"], r["task"], r["preset"]): r for r in rows}
    lines = ["<!-- generated by python benchmarks/decoder_presets.py; do not edit -->",
             "# Every recipe on the decoder presets", "",
             f"Made by `python benchmarks/decoder_presets.py` on {note}.", "",
             "Each cell is a real run of the recipe, 2 steps on the built-in data (" + " ".join(RUN_ARGS[:10])
             + "), under the plainest launch its row of `shared/core/rules.py` allows: one process where it may, "
             "else the launch config its row names. **trained**: a finite loss, results.json's model_type the "
             "preset's, for a mixture of experts the router's load-balancing loss reported, and the saved model "
             "loaded back with from_pretrained, every weight found and a tied head tied again. **refused**: "
             "stopped by the rule table with the reason and the fix (tests/test_decoder_presets.py asks the table "
             "again for each). **crashed**: anything else.", "",
             f"{counts['trained']} trained, {counts['refused']} refused, {counts['crashed']} crashed, of {len(rows)}. "
             + "Not run here: " + "; ".join(f"{k} ({v})" for k, v in sorted(SKIPPED.items()))
             + ".", "",
             "| recipe | launch | " + " | ".join(f"{t} {p}" for t, p in CELLS) + " |",
             "|---|---|" + "---|" * len(CELLS)]

    def show(r: dict | None) -> str:
        if r is None:
            return ""
        if r["status"] != "trained":
            return r["status"]
        ev = r["eval"]
        if r["recipe"] in NO_LOOP:  # no training: the quantized model's metric beside the fp32 one
            return (f"✓ int8 ppl {ev['int8_perplexity']:.0f} (fp32 {ev['fp32_perplexity']:.0f})"
                    if "int8_perplexity" in ev else
                    f"✓ int8 acc {ev['int8_accuracy']:.2f} (fp32 {ev['fp32_accuracy']:.2f})")
        metric = (f"ppl {ev['eval_perplexity']:.0f}" if "eval_perplexity" in ev else
                  f"acc {ev['eval_accuracy']:.2f}" if "eval_accuracy" in ev else "")
        aux = f", aux {r['router_aux_loss']:.3f}" if r.get("router_aux_loss") is not None else ""
        return f"✓ loss {r['train_loss']:.2f}, {metric}{aux}"

    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        cells = [by.get((recipe, t, p)) for t, p in CELLS]
        first = next(c for c in cells if c)
        launch = first["launch"] + ("" if first["processes"] == 1 else f", {first['processes']} processes")
        lines.append(f"| {recipe} | {launch} | " + " | ".join(show(c) for c in cells) + " |")
    lines += ["", "## Refused and crashed cells", ""]
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r["status"] != "trained":
            reasons.setdefault(f"{r['status']}: {' '.join((r.get('detail') or '').split())}", []).append(r["name"])
    for reason, names in reasons.items():
        lines.append(f"- {', '.join(f'**{n}**' for n in names)} ({reason})")
    common = " ".join(RUN_ARGS)
    lines += ["", f"## Every run (each command ends with `{common} --output_dir <out>`)", "",
              "| cell | status | model_type | saved | seconds | command |", "|---|---|---|---|---|---|"]
    for r in rows:
        command = r["command"].replace(f" {common}", "").removesuffix(" --output_dir <out>")
        lines.append(f"| {r['name']} | {r['status']} | {r.get('model_type') or ''} | {saved_words(r)} | {r['wall_s']} "
                     f"| `{command}` |")
    md_path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--probe"]:
        probe(argv[1:])
        return []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help="Keep cells whose name contains this (all must).")
    ap.add_argument("--json", default=str(ROOT / "docs" / "results" / "decoder_presets.json"))
    ap.add_argument("--md", default=str(ROOT / "docs" / "results" / "decoder_presets.md"))
    ap.add_argument("--work_dir", default=str(ROOT / "docs" / "results" / "runs" / "decoder_presets"))
    ap.add_argument("--timeout", type=int, default=400, help="Seconds before a cell counts as hung.")
    ap.add_argument("--update", action="store_true", help="Replace only the cells run now in the existing JSON "
                    "(written after each cell).")
    ap.add_argument("--cells", nargs="+", default=[], help="Exact cell names ('zero causal-lm tiny-qwen2'), in order.")
    ap.add_argument("--render", action="store_true", help="Only rewrite the table from the JSON (no runs).")
    args = ap.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.json).read_text())
        write_outputs(report["rows"], Path(args.json), Path(args.md), report["machine"])
        return report["rows"]
    cells = [c for c in all_cells() if all(o in c.name for o in args.only)]
    if args.cells:  # exact names, in the order given
        cells = [c for name in args.cells for c in all_cells() if c.name == name]
    work = Path(args.work_dir)
    rows = []
    for cell in cells:
        rows.append(run_cell(cell, work, args.timeout))
        print(f"{rows[-1]['status']:8s} {cell.name} ({rows[-1]['wall_s']} s): "
              f"{(rows[-1].get('detail') or '').splitlines()[-1:] or ''}", flush=True)
        if args.update:  # each cell kept as it ends: a long sweep stopped midway keeps what it ran
            merged = _merge(rows, Path(args.json))
    if not args.update or not rows:
        write_outputs(rows, Path(args.json), Path(args.md), machine())
        return rows
    return merged


def _merge(rows: list[dict], json_path: Path) -> list[dict]:
    """Replace the committed cells run now (and add the new ones), then rewrite the table."""
    note, previous = machine(), {"rows": []}
    if json_path.exists():
        previous = json.loads(json_path.read_text())
        note = f"{previous['machine'].split(' (updated')[0]} (updated on {time.strftime('%Y-%m-%d')})"
    new = {r["name"]: r for r in rows}
    merged = [new.pop(r["name"], r) for r in previous["rows"]] + list(new.values())
    write_outputs(merged, json_path, json_path.with_suffix(".md"), note)
    return merged


if __name__ == "__main__":
    main()
