"""Resumable checkpoints: Accelerate's full training state plus the step and data position, written atomically."""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

logger = logging.getLogger("recipes")
STATE_FILE = "trainer_state.json"


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(accelerator, output_dir: str, step: int, micro_batches: int) -> Path:
    """Model, optimizer, scheduler, scaler and RNG states (Accelerate), plus where the data stood.

    Written under a temporary name and renamed once complete, so a run killed mid-save never leaves a
    checkpoint that looks whole.
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
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        logger.info("saved checkpoint %s", final)
    accelerator.wait_for_everyone()
    return final


def maybe_save_checkpoint(accelerator, args: argparse.Namespace, step: int, micro_batches: int) -> None:
    """Every --checkpointing_steps optimizer steps."""
    if args.checkpointing_steps and step % args.checkpointing_steps == 0:
        save_checkpoint(accelerator, args.output_dir, step, micro_batches)


def find_checkpoint(args: argparse.Namespace) -> Path | None:
    """The directory --resume_from_checkpoint names ('latest': the newest complete one in output_dir)."""
    wanted = args.resume_from_checkpoint
    if not wanted:
        return None
    if wanted == "latest":
        done = sorted(p for p in checkpoints_root(args.output_dir).glob("step_*") if (p / STATE_FILE).exists())
        if not done:
            logger.warning("--resume_from_checkpoint latest: no checkpoint in %s; starting from scratch",
                           checkpoints_root(args.output_dir))
            return None
        return done[-1]
    path = Path(wanted)
    if not (path / STATE_FILE).exists():
        raise SystemExit(f"--resume_from_checkpoint {wanted!r} is not a complete checkpoint (no {STATE_FILE}). "
                         f"Pass a directory under {checkpoints_root(args.output_dir)} or 'latest'.")
    return path


def resume(accelerator, args: argparse.Namespace) -> tuple[int, int]:
    """Load a checkpoint into the prepared objects; returns (optimizer steps done, micro-batches consumed)."""
    path = find_checkpoint(args)
    if path is None:
        return 0, 0
    accelerator.load_state(str(path))
    state = json.loads((path / STATE_FILE).read_text())
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"], state["micro_batches"]
