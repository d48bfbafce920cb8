"""Preflight resolves and prints a run's effective configuration and stops before the first step."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port, run_recipe


def test_preflight_stops_before_training(tmp_path):
    with pytest.raises(SystemExit) as exc:
        run_recipe("gradient_accumulation", tmp_path, "--task", "causal-lm", "--preflight",
                   "--gradient_accumulation_steps", 2, "--mixed_precision", "fp16")
    assert exc.value.code == 0
    resolved = json.loads((tmp_path / "preflight.json").read_text())
    assert (resolved["distributed_type"], resolved["num_processes"], resolved["mixed_precision"]) == ("NO", 1, "fp16")
    assert resolved["fp16_path"] == "torch CPU autocast + GradScaler"
    assert resolved["global_batch_size"] == 16 * 2 and resolved["max_train_steps"] > 0
    assert resolved["memory"]["fits"] is True and resolved["memory"]["predicted_peak_bytes_per_process"] > 0
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
def test_preflight_command_resolves_a_launch_config(tmp_path):
    """Through `python -m shared.preflight`, as a user runs it: 2 gloo processes really resolved."""
    cmd = [sys.executable, "-m", "shared.preflight", "--config_file", str(ROOT / "accelerate_configs/multi_cpu.yaml"),
           "--main_process_port", str(free_port()), str(ROOT / "recipes/baseline.py"), "--report_to", "none",
           "--output_dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads((tmp_path / "preflight.json").read_text())
    assert (resolved["distributed_type"], resolved["num_processes"]) == ("MULTI_CPU", 2)
    assert '"distributed_type": "MULTI_CPU"' in proc.stdout


def test_training_does_not_import_the_planner(tmp_path):
    """The planner serves the preflight report: a training run (2 steps of the baseline) never imports it."""
    code = (f"import sys; from tests.conftest import run_recipe; run_recipe('baseline', {str(tmp_path)!r}, "
            "'--max_train_steps', 2, '--max_eval_samples', 16, '--no_save_model'); "
            "assert 'shared.plan' not in sys.modules, 'shared.plan imported by training'; print('trained')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
