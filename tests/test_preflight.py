"""Preflight resolves and prints a run's effective configuration and stops before the first step."""

import json
import os
import subprocess
import sys

import pytest

from shared.tools.preflight import estimate
from tests.conftest import CONFIGS, ROOT, free_port, run_recipe


def test_preflight_stops_before_training(tmp_path):
    with pytest.raises(SystemExit) as exc:
        run_recipe("gradient_accumulation", tmp_path, "--task", "causal-lm", "--preflight",
                   "--gradient_accumulation_steps", 2, "--mixed_precision", "fp16")
    assert exc.value.code == 0
    resolved = json.loads((tmp_path / "preflight.json").read_text())
    assert (resolved["distributed_type"], resolved["num_processes"], resolved["mixed_precision"]) == ("NO", 1, "fp16")
    assert resolved["fp16_path"] == "torch CPU autocast + GradScaler"
    assert resolved["global_batch_size"] == 16 * 2 and resolved["max_train_steps"] > 0
    memory = estimate(resolved)  # the planner's estimate is the repository tool's, from preflight.json alone
    assert memory["fits"] is True and memory["predicted_peak_bytes_per_process"] > 0
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "model.safetensors").exists()


@pytest.mark.slow
def test_preflight_command_resolves_a_launch_config(tmp_path):
    """Through `python -m shared.tools.preflight`, as a user runs it: 2 gloo processes really resolved."""
    cmd = [sys.executable, "-m", "shared.tools.preflight",
           "--config_file", str(ROOT / "accelerate_configs/multi_cpu.yaml"),
           "--main_process_port", str(free_port()), str(ROOT / "recipes/baseline.py"), "--report_to", "none",
           "--output_dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = json.loads((tmp_path / "preflight.json").read_text())
    assert (resolved["distributed_type"], resolved["num_processes"]) == ("MULTI_CPU", 2)
    assert '"distributed_type": "MULTI_CPU"' in proc.stdout


def test_training_does_not_import_the_tools(tmp_path):
    """The planner serves the preflight tool: a training run (2 steps of the baseline) imports no tool."""
    code = (f"import sys; from tests.conftest import run_recipe; run_recipe('baseline', {str(tmp_path)!r}, "
            "'--max_train_steps', 2, '--max_eval_samples', 16, '--no_save_model'); "
            "tools = [m for m in sys.modules if m.startswith('shared.tools')]; "
            "assert not tools, f'imported by training: {tools}'; print('trained')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]


# The recipe each launch config is preflighted with: one that trains under it (docs/results/launch_grid.md), the one the
# config's header names where it names one. zero3.yaml runs docs/layout.md's example.
PREFLIGHT = {
    "bf16.yaml": ("mixed_precision", []), "fp16.yaml": ("gradient_accumulation", []),
    "single_process.yaml": ("baseline", []), "multi_cpu.yaml": ("data_parallel", []),
    "multi_gpu.yaml": ("baseline", []), "multi_node.yaml": ("data_parallel", []),
    "pipeline.yaml": ("pipeline_parallel", []), "data_model_parallel.yaml": ("data_model_parallel", []),
    "fsdp.yaml": ("fsdp", []), "fsdp_offload.yaml": ("fsdp", []),
    "zero1.yaml": ("zero", []), "zero2.yaml": ("zero", []), "zero3.yaml": ("zero", ["--task", "causal-lm"]),
    "zero2_offload.yaml": ("zero3_offload", []), "zero3_offload.yaml": ("zero3_offload", []),
    "zero3_nvme.yaml": ("zero3_offload", ["--nvme_path", "NVME_DIR"]),
    "tp2_dp2.yaml": ("tensor_parallel", ["--tp_size", "2"]), "hsdp.yaml": ("fsdp", ["--dp_replicate_size", "2"]),
}
# multi_gpu.yaml launches 8 processes: 2 run the same code on 2 cores. multi_node.yaml: both machines on loopback.
LAUNCH_ARGS = {"multi_gpu.yaml": ["--num_processes", "2"],
               "multi_node.yaml": ["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "127.0.0.1"]}
# Enough examples for one global batch of data_model_parallel's 4 processes; preflight stops before training.
SMALL = ["--max_train_samples", "64", "--max_eval_samples", "16", "--per_device_train_batch_size", "8",
         "--report_to", "none"]


def test_every_config_has_a_preflight_case():
    assert sorted(PREFLIGHT) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


def _launched(config: str) -> bool:
    """More than one process: a real launch (a slow test, ~15 s); one process runs in this one (~0.2 s)."""
    from shared.tools.plan import config_launch

    return config_launch(config)[0] > 1 or config in LAUNCH_ARGS


@pytest.mark.parametrize("config", [pytest.param(c, marks=[pytest.mark.slow] if _launched(c) else [])
                                    for c in sorted(PREFLIGHT)])
def test_preflight_under_every_config(config, tmp_path, monkeypatch):
    """`python -m shared.tools.preflight --config_file accelerate_configs/<config> recipes/<recipe>.py` resolves the run
    (under ZeRO-3 too: the planner's meta model is built outside zero.Init), estimates its memory in GiB with the
    planner's technique for that config, and stops before the first step."""
    from shared.tools.plan import TECHNIQUES
    from tests.test_launch_grid import launch_env

    recipe, args = PREFLIGHT[config]
    args = [str(tmp_path / "nvme") if a == "NVME_DIR" else a for a in args]
    launch_args = LAUNCH_ARGS.get(config, [])
    world = int(launch_env(config, launch_args)["WORLD_SIZE"])
    out = tmp_path / "out"
    if world == 1:  # in this process: the launch's environment, then the recipe's main()
        for key, value in launch_env(config).items():
            monkeypatch.setenv(key, value)
        with pytest.raises(SystemExit) as exc:
            run_recipe(recipe, out, *SMALL, *args, "--preflight")
        assert exc.value.code == 0
    else:
        port = str(free_port())
        machines = 2 if "--num_machines" in launch_args else 1
        procs = [subprocess.Popen(
            [sys.executable, "-m", "shared.tools.preflight", "--config_file", str(CONFIGS / config), *launch_args,
             "--main_process_port", port, *(["--machine_rank", str(rank)] if machines > 1 else []),
             str(ROOT / "recipes" / f"{recipe}.py"), *SMALL, *args, "--output_dir", str(out)],
            cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(machines)]
        logs = [p.communicate(timeout=600)[0] for p in procs]
        assert [p.returncode for p in procs] == [0] * machines, "\n".join(log[-4000:] for log in logs)
    resolved = json.loads((out / "preflight.json").read_text())
    assert resolved["num_processes"] == world and resolved["recipe"] == recipe
    memory = resolved["memory"] if world > 1 else estimate(resolved)  # the tool wrote it, or it is asked here
    expected = next((t.name for t in TECHNIQUES if t.config == config and t.recipe == recipe), None)
    if expected:  # the configs the planner plans with: its model of exactly that launch
        assert memory["technique"] == expected, memory
    if "technique" in memory:
        assert memory["predicted_peak_per_process"].endswith(("GiB", "MiB")) and memory["fits"] is True, memory
    assert not (out / "results.json").exists()
