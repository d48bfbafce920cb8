"""Run recipes as a user does: in-process through main() for one process, `accelerate launch` for several."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.core.launch import free_port  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"
QUIET = ["--report_to", "none"]


def pytest_configure(config):
    """Every technique's rules in the table, as each recipe registers its own by importing its technique: tests weigh
    runs of any recipe with rules.refusals. A hook, not an import: a training process that imports this module (for
    run_recipe) must not load shared/tools."""
    from shared.tools import catalogue  # noqa: F401


def _quiet(args) -> list[str]:
    # A flag given twice with two values is refused (shared/core/args.py): a test's own --report_to replaces QUIET's.
    return [] if "--report_to" in map(str, args) else QUIET


def _last_wins(args) -> list[str]:
    """A test's flags with each repeated flag given once, at its last value. Tests build a run from a shared list
    plus overrides; a recipe now refuses a flag typed twice (shared/core/args.py), which `as_typed=True` keeps."""
    items: dict[str, list[str]] = {}
    tokens, loose, i = list(map(str, args)), [], 0
    while i < len(tokens):
        if not tokens[i].startswith("--"):
            loose.append(tokens[i])
            i += 1
            continue
        j = i + 1
        while j < len(tokens) and not tokens[j].startswith("--"):
            j += 1
        items[tokens[i].split("=", 1)[0]] = tokens[i:j]
        i = j
    return loose + [t for flag in items.values() for t in flag]


def _reset_accelerate() -> None:
    # Accelerate keeps process-wide singletons; each in-process run must start from a clean state.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_recipe(name: str, output_dir: Path, *args: str, as_typed: bool = False) -> dict:
    """main() of recipes/<name>.py in this process; returns the results it wrote to results.json."""
    args = tuple(args) if as_typed else tuple(_last_wins(args))
    _reset_accelerate()
    # Accelerate writes to os.environ (an FSDP plugin sets ACCELERATE_USE_FSDP=true): restore it, or every later
    # `accelerate launch` from this test session inherits it.
    saved_env = dict(os.environ)
    try:
        returned = load_recipe(name).main([*_quiet(args), *map(str, args), "--output_dir", str(output_dir)])
    finally:
        _reset_accelerate()
        os.environ.clear()
        os.environ.update(saved_env)
    written = json.loads((Path(output_dir) / "results.json").read_text())
    assert written["recipe"] == returned["recipe"]
    return written


def launch_command(name: str, output_dir: Path, *args: str, config: str | None = "multi_cpu.yaml",
                   launch_args: tuple[str, ...] = (), env: dict | None = None) -> tuple[list[str], dict]:
    """The `accelerate launch` command line and environment (one thread per process) of a recipe run."""
    args = tuple(_last_wins(args))
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config:
        cmd += ["--config_file", str(CONFIGS / config)]
    cmd += ["--main_process_port", str(free_port()), *launch_args,
            str(ROOT / "recipes" / f"{name}.py"), *_quiet(args), *map(str, args), "--output_dir", str(output_dir)]
    return cmd, {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}


def launch(name: str, output_dir: Path, *args: str, config: str | None = "multi_cpu.yaml",
           launch_args: tuple[str, ...] = (), env: dict | None = None, timeout: int = 600,
           expect_fail: bool = False) -> dict | subprocess.CompletedProcess:
    """`accelerate launch [--config_file accelerate_configs/<config>] recipes/<name>.py ...` in a subprocess.

    Returns results.json, or the finished process when expect_fail (then it must have failed).
    """
    cmd, full_env = launch_command(name, output_dir, *args, config=config, launch_args=launch_args, env=env)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_fail:
        assert proc.returncode != 0, f"expected a failure, got success:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads((Path(output_dir) / "results.json").read_text())


def load_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:5]}"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.fixture(autouse=True)
def _library_log_streams():
    """datasets' and transformers' own log handlers keep the sys.stderr of the test that first imported them, which
    pytest closes after that test: a later record (datasets' "Failed to read file") then printed a "--- Logging
    error ---" traceback into another test's output. Each test's handlers write to its own stderr."""
    import logging

    # Every logger's (the recipes' own too: an in-process run under one test's capsys made it, then a fuzzed model's
    # load report in the next test printed that traceback).
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values()
                                      if isinstance(v, logging.Logger))]
    for handler in (h for logger in loggers for h in logger.handlers):
        if type(handler) is not logging.StreamHandler:
            continue
        if getattr(handler.stream, "closed", False):
            handler.stream = sys.stderr  # not setStream: it flushes the old, closed stream
        # transformers binds its handler's flush to the sys.stderr of its first import (utils/logging.py)
        if getattr(getattr(handler.__dict__.get("flush"), "__self__", None), "closed", False):
            handler.flush = sys.stderr.flush
    yield


@pytest.fixture(autouse=True)
def _threads():
    # Tests on 2 cores: keep in-process runs from fighting with launched subprocesses.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
