"""Preflight with the planner's memory estimate: the effective configuration of a run, without training.

    python -m shared.tools.preflight [--config_file accelerate_configs/X.yaml] recipes/Y.py [recipe args]

It launches the recipe as `accelerate launch` would, with --preflight (shared/core/preflight.py: the run resolved,
its preflight.json written, stopped before the first step), then adds the planner's estimate of that run's peak
memory against the memory available to preflight.json and prints it. Exit code 0, or 3 when the estimate does not
fit. In a copied recipe, `--preflight` alone reports the resolved run without the estimate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..core.preflight import REPORT_LINE
from .catalogue import PLANS_AS
from .plan import CPU_RUNTIME_BYTES, TECHNIQUES, Technique, compat_run, fmt, model_spec, predict


def _technique(resolved: dict) -> Technique | None:
    """The planner's model of this run, if it has one: the technique of this recipe whose sharding and offload are
    what the run resolved, and whose flags (e.g. --load_in) the run has."""
    flags = resolved["flags"]
    recipe = PLANS_AS.get(resolved["recipe"], resolved["recipe"])  # e.g. accumulation: modelled as baseline
    launched = (resolved["sharding"], resolved["offload"], resolved["offload_params"])

    def runs_as_launched(t: Technique) -> bool:
        run = compat_run(t, "fp32", resolved["num_processes"])
        return (run.sharding, run.offload, t.offload_params) == launched

    # recipes/zero.py and zero3_offload.py run one DeepSpeed engine: either models the other's launch (zero2_offload
    # is zero.py's row, zero3_offload.py runs it too)
    deepspeed = {"zero", "zero3_offload"}
    candidates = [t for t in TECHNIQUES if (t.recipe == recipe or {t.recipe, recipe} <= deepspeed)
                  and runs_as_launched(t)]

    def has_flags(t: Technique) -> bool:
        words, i = list(t.args), 0
        while i < len(words):
            name = words[i].lstrip("-")
            if i + 1 < len(words) and not words[i + 1].startswith("--"):  # a flag and its value
                if str(flags.get(name, words[i + 1])) != words[i + 1]:
                    return False
                i += 2
            else:  # a switch (store_true), e.g. --use_dora
                if not flags.get(name, False):
                    return False
                i += 1
        return True

    # The most specific row whose flags the run has: tensor_parallel_fsdp (--tp_size 2) before tensor_parallel.
    ranked = sorted(candidates, key=lambda t: -len(t.args))
    return next((t for t in ranked if has_flags(t)), candidates[0] if candidates else None)


def estimate(resolved: dict) -> dict:
    """The planner's peak memory per process for the run a preflight.json describes, against what was available."""
    from transformers import CONFIG_MAPPING

    tech = _technique(resolved)
    if tech is None:
        return {"estimate": f"the planner has no model of recipes/{resolved['recipe']}.py under this launch"}
    flags, config = resolved["flags"], dict(resolved["model_config"])
    spec = model_spec(CONFIG_MAPPING[config["model_type"]].from_dict(config), resolved["task"], "run")
    seq = None if resolved["task"] == "image-classification" else flags["max_seq_length"]
    precision = "bf16" if resolved["mixed_precision"] in ("bf16", "fp16") else "fp32"
    on_gpu = resolved["device"].startswith("cuda")
    p = predict(spec, tech, precision, resolved["num_processes"], flags["per_device_train_batch_size"], seq,
                kernels="cuda" if on_gpu else "cpu")
    need = p.device_peak if on_gpu else p.device_peak + p.host + CPU_RUNTIME_BYTES
    free = resolved["available_bytes_per_process"]
    return {"technique": tech.name, "predicted_peak_per_process": fmt(need), "available_per_process": fmt(free),
            "predicted_peak_bytes_per_process": int(need), "available_bytes_per_process": int(free),
            "fits": bool(need <= free)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launch_args: list[str] = []
    while argv and not argv[0].endswith(".py"):
        launch_args.append(argv.pop(0))
    if not argv:
        raise SystemExit(__doc__)
    recipe, *recipe_args = argv
    if not Path(recipe).exists():
        raise SystemExit(f"{recipe!r} does not exist. Name a recipe, e.g. recipes/baseline.py.")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, recipe, *recipe_args, "--preflight"]
    proc = subprocess.Popen(cmd, env={**os.environ}, stdout=subprocess.PIPE, text=True)
    report = None
    for line in proc.stdout:  # shown as it comes; the report's last line names its file
        sys.stdout.write(line)
        if line.startswith(REPORT_LINE):
            report = Path(line.removeprefix(REPORT_LINE).strip())
    if proc.wait() != 0 or report is None:  # refused or failed (its message is above), or another machine's rank
        return proc.returncode
    resolved = json.loads(report.read_text())
    resolved["memory"] = memory = estimate(resolved)
    report.write_text(json.dumps(resolved, indent=2, default=str))
    print(json.dumps({"memory": memory}, indent=2))
    if memory.get("fits") is False:
        print(f"WARNING: the predicted peak, {memory['predicted_peak_per_process']} per process, exceeds the "
              f"{memory['available_per_process']} available: run `python -m shared.tools.plan` with this model and "
              "hardware for the combinations that fit (docs/planner.md).")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
