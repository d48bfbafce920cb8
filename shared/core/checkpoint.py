"""Resumable checkpoints: Accelerate's full training state plus the step and data position, written atomically,
verified by a manifest, and written on SIGTERM/SIGINT before the process exits. Pipeline stages, which no process
holds whole, add their per-process state through checkpoint_per_process."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
STAGE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt")  # in each rank_NNNNN/ of a per-process save
_signal_received: list[int] = []
_agreed_signal = [0]  # several processes: the signal they agreed on at the meter's last logging step
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def local_signal() -> int:
    """The preemption signal this process received (0: none)."""
    return _signal_received[0] if _signal_received else 0


def agree_on_signal(received: list[float]) -> None:
    """Called by the meter at its logging steps with, for each PREEMPTION_SIGNALS, how many processes got it."""
    _agreed_signal[0] = next((int(s) for s, n in zip(PREEMPTION_SIGNALS, received, strict=True) if n), 0)


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def install_preemption_handler() -> None:
    """SIGTERM (a scheduler's preemption) and SIGINT set a flag; the next step boundary saves and exits.

    A second SIGINT interrupts at once, as usual.
    """

    def handler(signum, _frame):
        if signum == signal.SIGINT and _signal_received:
            raise KeyboardInterrupt
        _signal_received.append(signum)

    _signal_received.clear()
    _agreed_signal[0] = 0
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


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


def checkpoint_per_process(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler) -> None:
    """Make save_state/load_state save and restore this process's own model, optimizer and scheduler.

    For models that are not prepared, whose parameters differ per process (a pipeline stage): Accelerate's
    register_for_checkpointing saves from the main process only, so every other stage would be lost. These hooks run
    on every process inside save_state/load_state and use <checkpoint>/rank_<process index>/. Accelerate still saves
    and restores each process's RNG states, and save_checkpoint's manifest covers the rank directories.
    """
    from safetensors.torch import load_model, save_model

    def save_hook(_models: list, _weights: list, output_dir: str) -> None:
        own = Path(output_dir) / f"rank_{accelerator.process_index:05d}"
        own.mkdir(parents=True, exist_ok=True)
        save_model(model, str(own / STAGE_FILES[0]))  # safetensors: drops a tensor's second name if shared
        torch.save(optimizer.state_dict(), own / STAGE_FILES[1])
        torch.save(scheduler.state_dict(), own / STAGE_FILES[2])

    def load_hook(_models: list, input_dir: str) -> None:
        saved = len(list(Path(input_dir).glob("rank_*")))
        own = Path(input_dir) / f"rank_{accelerator.process_index:05d}"
        if saved != accelerator.num_processes or not own.is_dir():
            raise SystemExit(f"{input_dir} holds the state of {saved} processes (one rank_* directory each), and "
                             f"this run has {accelerator.num_processes}: each process resumes its own pipeline stage. "
                             f"Resume with --num_processes {saved} and the same --pipeline_stages/--layers_per_stage "
                             "as the run that saved it.")
        device = accelerator.device
        location = "cpu" if device.type == "cpu" else str(device)  # safetensors refuses "cpu:0"
        try:
            load_model(model, str(own / STAGE_FILES[0]), strict=True, device=location)
        except RuntimeError as err:  # the same process count, another cut of the model
            found = " ".join(str(err).split()[5:])  # after "Error(s) in loading state_dict for Stage:"
            raise SystemExit(f"{own} holds another stage than this process's ({found[:200]} ...). Resume with the "
                             "same --pipeline_stages/--layers_per_stage as the run that saved it.") from None
        optimizer.load_state_dict(torch.load(own / STAGE_FILES[1], weights_only=True, map_location=location))
        scheduler.load_state_dict(torch.load(own / STAGE_FILES[2], weights_only=True, map_location=location))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def checkpoint_dtensors(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                       layout: dict[str, int]) -> None:
    """Make save_state/load_state save and restore a model whose parameters are DTensors (tensor parallel, FSDP2 on
    a device mesh that Accelerate did not build) with torch.distributed.checkpoint: every process writes its own
    shards of the model and of the optimizer state into <checkpoint>/dcp/ and reads them back in place.

    `layout` (e.g. {"dp": 2, "tp": 2}) is saved beside them: a resume on another mesh is refused, since the data
    position counts this mesh's batches and GPT-2's fused qkv rows are ordered for this tensor-parallel degree.
    Accelerate still saves and restores each process's RNG states; save_checkpoint's manifest covers dcp/."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def save_hook(_models: list, _weights: list, output_dir: str) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(output_dir) / "dcp"))
        if accelerator.is_main_process:  # the same on every process
            torch.save(scheduler.state_dict(), Path(output_dir) / STAGE_FILES[2])
            (Path(output_dir) / "mesh.json").write_text(json.dumps(layout))

    def load_hook(_models: list, input_dir: str) -> None:
        if not (Path(input_dir) / "mesh.json").exists():
            raise SystemExit(f"{input_dir} has no mesh.json: it was not saved by a DTensor run (tensor parallel). "
                             "Resume from a checkpoint this recipe wrote, or drop --resume_from_checkpoint.")
        saved = json.loads((Path(input_dir) / "mesh.json").read_text())
        if saved != layout:
            raise SystemExit(f"{input_dir} was saved on the mesh {saved}, and this run's is {layout}. Resume with "
                             f"the same --num_processes and --tp_size as the run that saved it.")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(input_dir) / "dcp"))  # into this process's shards, in place
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(torch.load(Path(input_dir) / STAGE_FILES[2], weights_only=True))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def _preempted(accelerator) -> int:
    """The signal any process received (0 if none), agreed by all processes so that all of them save and stop.

    With several processes the agreement rides on the meter's logging collective (shared/core/meter.py), so a step
    that does not log waits on no collective and no host read for it: a SIGTERM is acted on at the next logging
    step. Keep --logging_steps x the step time under the scheduler's grace period."""
    if accelerator.num_processes == 1:
        return local_signal()
    return _agreed_signal[0]


def maybe_save_checkpoint(accelerator, launch: Launch, step: int, micro_batches: int) -> None:
    """Every --checkpointing_steps optimizer steps, and at once after SIGTERM/SIGINT (then the run exits)."""
    args, signum = launch.args, _preempted(accelerator)
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
