"""The GPU check (benchmarks/gpu_check.py) stays runnable without a GPU: every command it would run on the GPU is
accepted by its recipe's own parser, and its CPU-runnable part runs end to end (fp16 with a real loss scaler, and
the MFU script on a tiny GPT-2) with the verdicts read from the runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_every_gpu_command_parses_with_its_recipe():
    from shared.core.args import parse_args

    checks = gpu_check.recipe_checks(gpu_check.STEPS, tiny=False)
    assert {c["recipe"] for c in checks} >= {"baseline", "fp8", "qlora", "optim_8bit", "zero3_offload"}
    for check in checks:
        spec = importlib.util.spec_from_file_location(f"r_{check['recipe']}", ROOT / "recipes" /
                                                      f"{check['recipe']}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        args = parse_args([*check["args"], "--output_dir", "/tmp/unused"], module.add_args)
        assert args.max_train_steps == gpu_check.STEPS, check["name"]
    for argv in gpu_check.mfu_checks(tiny=False):  # the recipe flags after "--" exist too
        cut = argv.index("--") if "--" in argv else len(argv)
        recipe = argv[argv.index("--recipe") + 1] if "--recipe" in argv else "baseline"
        spec = importlib.util.spec_from_file_location(f"r_{recipe}", ROOT / "recipes" / f"{recipe}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        parse_args(argv[cut + 1:], module.add_args)


def test_gpu_check_refuses_to_run_without_a_gpu():
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "No CUDA GPU here" in proc.stderr and "--cpu_smoke" in proc.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_and_reads_its_verdicts(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu_smoke", "--work_dir", str(tmp_path),
                           "--only", "fp16 GradScaler", "--only", "GPT-2 tiny", "--parallel", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    (check,) = report["checks"]
    assert check["ok"] and check["compute_dtype"] == "float16"
    (mfu,) = report["mfu"]
    assert mfu["device"] == "cpu" and mfu["mfu"] is None  # no peak for a CPU: said, not guessed
    assert mfu["achieved_flops"] == pytest.approx(mfu["flops_per_token"] * mfu["tokens_per_second"])
    assert "| GPT-2 tiny fp32 |" in (tmp_path / "gpu_check.md").read_text()
