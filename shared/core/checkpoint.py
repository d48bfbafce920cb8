"""Resumable checkpoints: Accelerate's full training state plus the step and data position, written atomically,
verified by a manifest, and written on SIGTERM/SIGINT before the process exits. Pipeline stages, which no process
holds whole, and DTensor models add their own state through save/load hooks (techniques/pipeline_stages.py
checkpoint_per_process, techniques/tensor_parallel.py checkpoint_dtensors); the manifest covers what they write."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
STAGE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt")  # in each rank_NNNNN/ of a per-process save


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(directory: Path) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (directory / MANIFEST).write_text(json.dumps(entries, indent=1))


def verify_checkpoint(directory: Path) -> str | None:
    """None if every file the manifest lists is there with its size and hash; else what is wrong."""
    manifest = directory / MANIFEST
    if not manifest.exists():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        entries = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return f"{MANIFEST} is unreadable"
    for name, meta in entries.items():
        path = directory / name
        if not path.exists():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256"
    return None


def save_checkpoint(accelerator, output_dir: str, step: int, micro_batches: int, keep: int | None = None) -> Path:
    """Model, optimizer, scheduler, scaler and RNG states (Accelerate), plus where the data stood.

    Written under a temporary name, hashed into a manifest, then renamed: a run killed mid-save never leaves a
    checkpoint that looks whole. `keep`: how many of the newest checkpoints to keep.
    """
    root = checkpoints_root(output_dir)
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, "micro_batches": micro_batches}))
        _write_manifest(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        logger.info("saved checkpoint %s", final)
        if keep:
            for old in sorted(root.glob("step_*"))[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def maybe_save_checkpoint(accelerator, launch: Launch, step: int, micro_batches: int) -> None:
    """Every --checkpointing_steps optimizer steps, and at once after SIGTERM/SIGINT (then the run exits)."""
    args, signum = launch.args, launch.preemption.signal(accelerator.num_processes)
    if (args.checkpointing_steps and step % args.checkpointing_steps == 0) or signum:
        path = save_checkpoint(accelerator, launch.output_dir, step, micro_batches, keep=args.save_total_limit)
    if signum:
        name = signal.Signals(signum).name
        logger.warning("%s received: saved %s at step %d; continue with --resume_from_checkpoint latest",
                       name, path, step)
        accelerator.end_training()
        sys.exit(128 + signum)


def find_checkpoint(launch: Launch) -> Path | None:
    """The directory --resume_from_checkpoint names ('latest': the newest one that verifies)."""
    wanted, root = launch.args.resume_from_checkpoint, checkpoints_root(launch.output_dir)
    if not wanted:
        return None
    if wanted == "latest":
        for path in sorted(root.glob("step_*"), reverse=True):
            problem = verify_checkpoint(path)
            if problem is None:
                return path
            logger.warning("skipping checkpoint %s: %s", path, problem)
        logger.warning("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from scratch",
                       root)
        return None
    path = Path(wanted)
    if not path.is_dir():
        raise SystemExit(f"--resume_from_checkpoint {wanted!r} does not exist. Pass a directory under "
                         f"{root} or 'latest'.")
    problem = verify_checkpoint(path)
    if problem:
        raise SystemExit(f"--resume_from_checkpoint {wanted!r} is not a complete checkpoint: {problem}. "
                         "Pass another checkpoint, or 'latest' to take the newest complete one.")
    return path


def resume(accelerator, launch: Launch) -> tuple[int, int]:
    """Load a checkpoint into the prepared objects; returns (optimizer steps done, micro-batches consumed)."""
    path, steps = find_checkpoint(launch), launch.max_train_steps
    if path is None:
        return 0, 0
    state = json.loads((path / STATE_FILE).read_text())
    if steps and state["step"] >= steps:
        # Nothing would train: the run would end with no loss to report (train_loss None) and save the same model.
        raise SystemExit(f"{path} is at step {state['step']}, and this run has {steps} steps: nothing "
                         "is left to train. Raise --max_train_steps (or --num_train_epochs) to train on.")
    accelerator.load_state(str(path))
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"], state["micro_batches"]
