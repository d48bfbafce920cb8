"""Resumable checkpoints: Accelerate's full training state plus the step and data position, written atomically,
verified by a manifest, and written on SIGTERM/SIGINT before the process exits. Pipeline stages, which no process
holds whole, and DTensor models add their own state through save/load hooks (techniques/pipeline_stages.py
checkpoint_per_process, techniques/tensor_parallel.py checkpoint_dtensors); the manifest covers what they write."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import rules, rundir
from .accelerate_compat import prepared_models, prepared_schedulers
from .boundary import diagnose, loading
from .errors import CheckpointError

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
STAGE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt")  # in each rank_NNNNN/ of a per-process save


# A checkpoint records its run (trainer_state.json "run"). A resume that changes one of FIXED is refused, naming it;
# one of CHANGEABLE is applied and reported; one of LAYOUT where the recipe reshards and the global batch stays.
FIXED = ("recipe", "task", "model_name_or_path", "model_preset", "train_file", "validation_file", "dataset_name",
         "dataset_config_name", "train_dir", "max_train_samples", "max_seq_length", "packing", "seed")
CHANGEABLE = ("learning_rate", "lr_scheduler_type", "num_warmup_steps", "weight_decay", "max_train_steps")
LAYOUT = ("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps", "data_parallel_size")


def run_identity(launch: Launch, num_processes: int) -> dict[str, object]:
    """The run's settings a checkpoint is only valid for (FIXED), and those a resume may change (CHANGEABLE)."""
    resolved = {**vars(launch.args), **launch.resolved(), "num_processes": num_processes,
                "data_parallel_size": launch.data_parallel_size or num_processes}
    return {key: resolved.get(key) for key in FIXED + CHANGEABLE + LAYOUT}


def differences(saved: dict, current: dict, keys: tuple[str, ...]) -> dict[str, tuple]:
    """key -> (saved, now), for the keys whose values differ; a checkpoint from before these records has none."""
    return {k: (saved.get(k), current.get(k)) for k in keys if k in saved and saved.get(k) != current.get(k)}


def _described(diffs: dict[str, tuple]) -> str:  # the differences, in the user's own flags
    return ", ".join(f"--{k} was {a!r}, now {b!r}" for k, (a, b) in diffs.items())


def checkpoints_root(output_dir: str) -> Path:
    return Path(output_dir) / "checkpoints"


def _read_json(path: Path) -> object:
    """The parsed file, or None where it cannot be read or parsed (damaged bytes, not UTF-8, not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None


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
    entries = _read_json(manifest)
    # Trusted only as the checker expects it: a non-empty {file: {bytes, sha256}} naming the state file, every
    # path inside the checkpoint. Anything else (random bytes, a list, an entry without its hash) is damage.
    if not isinstance(entries, dict) or STATE_FILE not in entries:
        return f"{MANIFEST} is damaged (not a manifest listing {STATE_FILE})"
    for name, meta in entries.items():
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str)):
            return f"{MANIFEST} is damaged (its entry for {name!r} has no size and hash)"
        path = directory / name
        if not path.resolve().is_relative_to(directory.resolve()):
            return f"{MANIFEST} names a file outside the checkpoint ({name!r})"
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != meta["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}"
        if _sha256(path) != meta["sha256"]:
            return f"{name} does not match its sha256"
    state = _read_json(directory / STATE_FILE)
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)
            and isinstance(state.get("micro_batches"), int)):
        return f"{STATE_FILE} is damaged (no step and data position)"
    return None


def saved_run(directory: Path) -> dict:
    """The run a verified checkpoint records ({} for one written before checkpoints recorded it)."""
    run = (_read_json(directory / STATE_FILE) or {}).get("run")
    return run if isinstance(run, dict) else {}


def save_checkpoint(accelerator, launch: Launch, step: int, micro_batches: int, keep: int | None = None,
                    final: Path | None = None, background: bool = False, writes=None) -> Path:
    """Model, optimizer, scheduler, scaler and RNG states (Accelerate), plus where the data stood and the run.

    Written under a temporary name, hashed into a manifest, then renamed: a run killed mid-save never leaves a
    checkpoint that looks whole. `keep`: how many of this run's newest checkpoints to keep (another run's, in the
    same directory, are never deleted). `final`: another place than checkpoints/step_N (the divergence guard's).
    `background` (--async_checkpoint, techniques/async_checkpoint.py): training goes on while the shards are written.
    `writes`: the run's AsyncCheckpoints (--async_checkpoint; None without), whose checkpoint in flight is completed
    first.
    """
    if writes is not None:
        writes.wait()
    root = checkpoints_root(launch.output_dir)
    final = final or root / f"step_{step:08d}"
    tmp = final.with_name(f".tmp_{final.name}")
    run = run_identity(launch, accelerator.num_processes)
    then = "this run's earlier checkpoints are intact (--resume_from_checkpoint latest continues from the newest)."
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        ours = [p for p in sorted(root.glob("step_*")) if not differences(saved_run(p), run, FIXED)]
        if ours:  # the last one's size: what this one needs, checked before writing a byte
            last = _read_json(ours[-1] / MANIFEST) or {}
            rundir.check_room(root, sum(m.get("bytes", 0) for m in last.values()), f"checkpoint {final.name}", then)
    accelerator.wait_for_everyone()

    def complete(write: Callable[[], object]) -> Path:  # written, hashed, renamed: from then on `latest` takes it
        try:
            write()
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                (tmp / STATE_FILE).write_text(json.dumps({"step": step, "micro_batches": micro_batches, "run": run}))
                _write_manifest(tmp)
        except Exception as err:
            full = rundir.disk_full(err, root, f"checkpoint {final.name}", then)
            shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back
            if full:
                raise full from err
            raise
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            logger.info("saved checkpoint %s", final)
            if keep:
                ours = [p for p in sorted(root.glob("step_*")) if not differences(saved_run(p), run, FIXED)]
                for old in ours[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    if not background:
        return complete(lambda: accelerator.save_state(str(tmp)))
    with writes.deferred():  # the DCP shards staged here, written in the background, completed at the next wait()
        accelerator.save_state(str(tmp))
    writes.complete = lambda: complete(writes.written)
    return final


def logging_step(launch: Launch, step: int, max_steps: int) -> bool:
    """Optimizer step `step` (1-based) is a logging step: every --logging_steps steps and the last. The guard and the
    preemption check read across processes there only, so a step in between waits on no collective."""
    return step % launch.args.logging_steps == 0 or step == max_steps


class Preemption:
    """SIGTERM (a scheduler's preemption) and SIGINT, checked by a line of the recipe's loop: `check(step, ...)`.

    The handler only notes the signal (a second SIGINT interrupts at once, as usual). One process acts on it at the
    next step; several agree on it at the logging steps (every --logging_steps steps and the last), in one small
    all-reduce, so that every process saves the same step and a step that does not log waits on no collective and no
    host read: keep --logging_steps x the step time under the scheduler's grace period. Acting on it: the training
    state is saved as a checkpoint and the process exits with 128 + the signal; at the run's last step the run
    finishes instead (the model first, then the evaluation). Created by the recipe once max_steps is known."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, accelerator, launch: Launch, max_steps: int, writes: object = None) -> None:
        self.accelerator, self.launch, self.max_steps = accelerator, launch, max_steps
        self.writes = writes  # --async_checkpoint: the checkpoint in flight is completed before this one
        self.local = 0  # the signal this process received (0: none)
        self.install()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():  # Ray Train's workers: signals are Ray's there
            return
        def handler(signum, _frame):
            if signum == signal.SIGINT and self.local:
                raise KeyboardInterrupt
            if not self.local and os.environ.get("RANK", "0") == "0":  # said once, by one process
                print(f"\n{signal.Signals(signum).name} received: the run saves a checkpoint at the next step and "
                      "stops (during the final evaluation, it finishes it). Ctrl-C again stops at once.",
                      file=sys.stderr, flush=True)
            self.local = self.local or signum

        for signum in self.SIGNALS:
            signal.signal(signum, handler)
        if sys.platform == "linux":
            # `accelerate launch` of one process does not forward SIGTERM: it dies and leaves the recipe training
            # on. Asked here, the kernel sends the recipe SIGTERM when its launcher (the parent) dies.
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    def signal(self, step: int) -> int:
        """The signal every process acts on after optimizer step `step` (1-based; 0 if none)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return self.local
        if not logging_step(self.launch, step, self.max_steps):
            return 0
        votes = torch.tensor([float(self.local == s) for s in self.SIGNALS], device=acc.device)
        counts = acc.reduce(votes, "sum").tolist()  # how many processes received each of SIGNALS
        return next((int(s) for s, n in zip(self.SIGNALS, counts, strict=True) if n), 0)

    def check(self, step: int, micro_batches: int) -> None:
        """After optimizer step `step` (1-based): on an agreed signal, save the training state and exit."""
        signum = self.signal(step)
        if not signum:
            return
        name = signal.Signals(signum).name
        if step == self.max_steps:
            logger.warning("%s received at the last step: finishing the run (the model first, then the evaluation)",
                           name)
            return
        path = save_checkpoint(self.accelerator, self.launch, step, micro_batches,
                               keep=self.launch.args.save_total_limit, writes=self.writes)
        logger.warning("%s received: saved %s at step %d; continue with --resume_from_checkpoint latest",
                       name, path, step)
        self.accelerator.end_training()
        sys.exit(128 + signum)  # the exit code a scheduler reads as "preempted, saved": not a refusal to catch


def maybe_save_checkpoint(accelerator, launch: Launch, step: int, micro_batches: int, max_steps: int,
                          writes=None) -> None:
    """Every --checkpointing_steps optimizer steps and at the last (`max_steps`, the recipe's). `writes`: the run's
    AsyncCheckpoints under --async_checkpoint (written in the background, but the last). SIGTERM/SIGINT are the
    recipe's own line (Preemption.check)."""
    every, last = launch.args.checkpointing_steps, step == max_steps
    if every and (step % every == 0 or last):
        save_checkpoint(accelerator, launch, step, micro_batches, keep=launch.args.save_total_limit,
                        background=writes is not None and not last, writes=writes)


def find_checkpoint(launch: Launch, num_processes: int) -> Path | None:
    """The directory --resume_from_checkpoint names ('latest': the newest one of this run that verifies; another
    run's, in the same directory, with another seed, model, data or batch, is skipped with a warning)."""
    wanted, root = launch.resume_from_checkpoint, checkpoints_root(launch.output_dir)
    if not wanted:
        return None
    if wanted == "latest":
        run = run_identity(launch, num_processes)
        for path in sorted(root.glob("step_*"), reverse=True):
            problem = verify_checkpoint(path)
            if problem is None:
                other = differences(saved_run(path), run, FIXED)
                if not other:
                    return path
                problem = f"another run's ({_described(other)})"
            logger.warning("skipping checkpoint %s: %s", path, problem)
        logger.warning("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from scratch",
                       root)
        return None
    path = Path(wanted)
    if not path.is_dir():
        found, fix = diagnose("checkpoint", wanted)
        raise CheckpointError(f"--resume_from_checkpoint {wanted!r} {'does not exist' if not path.exists() else found}."
                              f" {fix + ' ' if fix.startswith('Did') else ''}Pass a directory under {root} or "
                              "'latest'.")
    problem = verify_checkpoint(path)
    found, fix = diagnose("checkpoint", wanted)
    if problem and found:  # a saved model, an adapter, a dataset: not a checkpoint at all
        raise CheckpointError(f"--resume_from_checkpoint {wanted!r} is {found}. {fix}")
    if problem:
        raise CheckpointError(f"--resume_from_checkpoint {wanted!r} is not a complete checkpoint: {problem}. "
                              "Pass another checkpoint, or 'latest' to take the newest complete one.")
    return path


def _refuse_overwriting_another_run(launch: Launch, num_processes: int) -> None:
    """A run that will write checkpoints into a folder that holds another run's would replace them step by step
    (its step_N in place of theirs), and --save_total_limit would count theirs: refused before the first step."""
    if not launch.args.checkpointing_steps:
        return
    run = run_identity(launch, num_processes)
    for path in sorted(checkpoints_root(launch.output_dir).glob("step_*")):
        other = differences(saved_run(path), run, FIXED) if verify_checkpoint(path) is None else {}
        if other:
            raise CheckpointError(f"{path.parent} holds checkpoints of another run ({path.name}: "
                                  f"{_described(other)}), which this run's checkpoints would replace. Pass another "
                                  "--output_dir, or resume that run with its own settings and "
                                  "--resume_from_checkpoint latest.")


_resume_changes: dict = {}  # this process's resume: setting -> (saved, now), applied (written by resume() only)


def resume_changes() -> dict:
    """What this process's resume changed from the checkpoint's run (results.json "resume_changes")."""
    return dict(_resume_changes)


def resume(accelerator, launch: Launch, max_steps: int) -> tuple[int, int]:
    """Load a checkpoint into the prepared objects; returns (optimizer steps done, micro-batches consumed).

    A checkpoint of a run with other FIXED settings is refused before anything is loaded, naming them; a changed
    learning rate or schedule is applied from the resumed step on, and reported by resume_changes()."""
    path, steps = find_checkpoint(launch, accelerator.num_processes), max_steps
    _resume_changes.clear()
    if launch.elastic_restarts and accelerator.is_main_process:  # the budget torch elastic has left, and then what
        used, most = launch.elastic_restarts, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        then = ("the last one: if a process dies again, the job ends. Find why in the launcher's failure summary (rank,"
                " exit code, signal), fix it, and run the same command with --resume_from_checkpoint latest"
                if used >= most else f"{most - used} left")
        logger.warning("torch elastic restart %d of %d (a process died; all were restarted), resuming from %s: %s.",
                       used, most, path or "step 0 (no complete checkpoint; --checkpointing_steps N writes them)", then)
    if accelerator.is_main_process and not launch.args.no_save_model:  # the final model's room, before any step
        params = [p for m in prepared_models(accelerator) for p in m.parameters()]
        needed = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)  # ZeRO-3: its full size
        rundir.check_room(Path(launch.output_dir), needed, "the final model", "nothing has trained yet.")
    if path is None:
        _refuse_overwriting_another_run(launch, accelerator.num_processes)
        return 0, 0
    state = json.loads((path / STATE_FILE).read_text())
    run, saved = run_identity(launch, accelerator.num_processes), saved_run(path)
    fixed = differences(saved, run, FIXED)
    if fixed:
        raise CheckpointError(f"{path} was written by another run: {_described(fixed)}. Resume with that run's "
                              "settings, or start afresh in another --output_dir (the data position, model or batch "
                              "would differ).")
    consumed = reshard(launch, path, saved, run, state["micro_batches"])
    if steps and state["step"] > steps:
        raise CheckpointError(f"{path} is at step {state['step']}, past this run's {steps} steps. Pass "
                              f"--max_train_steps {state['step']} or more (or --num_train_epochs) to train on.")
    if state["step"] == steps:  # a run stopped after its last step (killed in its final save or evaluation)
        logger.warning("%s is at the last step (%d): nothing to train; the model, evaluation and results are written "
                       "from it", path, steps)
    changes = differences(saved, run, CHANGEABLE)
    # A recipe that checkpoints its own schedulers (pipeline stages) cannot take a new rate: refused before loading.
    if "learning_rate" in changes and not prepared_schedulers(accelerator):
        raise CheckpointError(f"--learning_rate {launch.learning_rate:g}: {path} was trained at "
                              f"{changes['learning_rate'][0]:g}, and recipes/{launch.recipe}.py keeps its schedulers "
                              "apart from Accelerate's, so a new rate cannot be applied on resume. Resume with the old "
                              "one.")
    with loading("checkpoint", "--resume_from_checkpoint", path):  # verified, yet written by another version
        accelerator.load_state(str(path))
    _resume_changes.update(changes)
    if "learning_rate" in changes:
        # The scheduler's state brought back the old peak learning rate (base_lrs): the new one applies from here,
        # on the schedule the flags now give (transformers' schedules are LambdaLRs of the step).
        for wrapper in prepared_schedulers(accelerator):
            inner = getattr(wrapper, "scheduler", wrapper)
            inner.base_lrs = [launch.learning_rate] * len(inner.base_lrs)
            for group, lam in zip(inner.optimizer.param_groups, inner.lr_lambdas, strict=True):
                group["initial_lr"], group["lr"] = launch.learning_rate, launch.learning_rate * lam(inner.last_epoch)
    if changes:
        logger.warning("resumed %s with changed settings (applied from step %d): %s", path, state["step"], changes)
    logger.info("resumed from %s at step %d", path, state["step"])
    return state["step"], consumed


def reshard(launch: Launch, path: Path, saved: dict, run: dict, micro_batches: int) -> int:
    """The data position in this run's micro-batches; on another LAYOUT too, if it keeps the batch (resharding.md)."""
    layout = differences(saved, run, LAYOUT)
    if not layout:
        return micro_batches
    def batch(r: dict) -> int:  # noqa: E306 (samples per optimizer step)
        return r["per_device_train_batch_size"] * r["gradient_accumulation_steps"] * (
            r.get("data_parallel_size") or r["num_processes"])
    if not rules.RECIPES[launch.recipe].reshards:
        fix = f"recipes/{launch.recipe}.py resumes only on the layout that wrote it: resume with that run's settings"
    elif batch(saved) != batch(run):
        per = batch(saved) / batch({**run, "per_device_train_batch_size": 1})
        fix = f"the global batch (per device x processes x accumulation) was {batch(saved)}, now {batch(run)}: pass" + (
            f" --per_device_train_batch_size {per:g}" if per.is_integer() else f" a batch of {batch(saved)}")
    else:
        return micro_batches // saved["gradient_accumulation_steps"] * run["gradient_accumulation_steps"]
    raise CheckpointError(f"{path} was written on another layout ({_described(layout)}); {fix}, or start afresh in "
                          "another --output_dir (docs/resharding.md).")
