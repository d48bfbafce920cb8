"""Resumable checkpoints: Accelerate's full training state plus the step and data position, written atomically,
verified by a manifest (each process checksums what it wrote), and written on SIGTERM, SIGINT, SIGHUP or SIGUSR1
before the process exits. A checkpoint records its run, the data's content, precision and sharding, and its branch
of the run's lineage. State a technique keeps apart from Accelerate's (pipeline stages, DTensor shards) goes through
its save/load hooks (shared/techniques/); the manifest covers what they write."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import rundir
from .accelerate_compat import prepared_models, prepared_schedulers
from .boundary import diagnose, loading
from .errors import CheckpointError, InputError, RunFinished

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"


# A checkpoint records its run (trainer_state.json "run"): every flag but the FREE ones, what the launch resolved, the
# data's content, the precision and the sharding. On resume each flag has one verdict (docs/faults.md's table):
# FIXED: the run's identity (`latest` and --save_total_limit skip another run's checkpoints); REFUSED: a change is
# refused before loading, naming both values (FIXED, the recorded dependencies and every flag not listed here, a
# recipe's own flags among them); APPLIED: applied from the resumed step on and reported (resume_changes); LAYOUT:
# resharded where the recipe can, the global batch kept; FREE: not part of the training state.
FIXED = ("recipe", "task", "model_name_or_path", "model_preset", "train_file", "validation_file", "dataset_name",
         "dataset_config_name", "train_dir", "max_train_samples", "max_seq_length", "packing", "seed")
APPLIED = ("learning_rate", "lr_scheduler_type", "num_warmup_steps", "weight_decay", "max_train_steps",
           "num_train_epochs", "max_grad_norm")
SCHEDULE = ("learning_rate", "lr_scheduler_type", "num_warmup_steps", "max_train_steps", "num_train_epochs")
LAYOUT = ("num_processes", "per_device_train_batch_size", "gradient_accumulation_steps", "data_parallel_size")
DEPENDS = ("data_content", "mixed_precision", "sharding")  # what the state's bytes depend on, beside the flags
FREE = ("output_dir", "overwrite_output_dir", "checkpointing_steps", "save_total_limit", "resume_from_checkpoint",
        "async_checkpoint", "record_samples", "report_to", "logging_steps", "no_save_model", "preflight", "ddp_timeout",
        "dataloader_num_workers", "torch_compile", "per_device_eval_batch_size", "max_eval_samples",
        "elastic_restarts", "trust_remote_code", "debug", "generate")  # debug: tracebacks; generate: after training
REQUIRED = FIXED + LAYOUT + DEPENDS  # a checkpoint that records none of one is unknown: refused, never trusted
LINEAGE = "lineage.json"  # checkpoints/lineage.json: the run's branches, oldest first
_data_seen: dict[tuple, str] = {}  # (path, size, mtime) -> its content's fingerprint, computed once per process


def _jsonable(value: object) -> object:
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


def _file_print(path: Path, whole: int = 64 << 20, ends: int = 4 << 20) -> str:
    """size:crc32 of the file; a large one's first and last `ends` bytes only (a replaced file changes its size or
    its ends; an edit in the middle of a 64 MB+ file of the same size is not seen)."""
    size, crc = path.stat().st_size, 0
    with path.open("rb") as f:
        if size <= whole:
            for block in iter(lambda: f.read(1 << 20), b""):
                crc = zlib.crc32(block, crc)
        else:
            crc = zlib.crc32(f.read(ends))
            f.seek(size - ends)
            crc = zlib.crc32(f.read(ends), crc)
    return f"{size}:{crc:08x}"


def data_content(args) -> dict[str, str]:
    """The content fingerprint of each data file or folder the flags name (a hub dataset: its name and config)."""
    prints = {}
    for flag in ("train_file", "validation_file", "train_dir", "validation_dir"):
        given = getattr(args, flag, None)
        if not given or not Path(given).exists():
            continue
        root = Path(given)
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        crc = 0
        for f in files:
            st = f.stat()
            key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
            if key not in _data_seen:
                _data_seen[key] = _file_print(f)
            crc = zlib.crc32(f"{f.relative_to(root) if root.is_dir() else ''}={_data_seen[key]};".encode(), crc)
        prints[flag] = f"{len(files)} file(s), {sum(f.stat().st_size for f in files)} bytes, crc32 {crc:08x}"
    return prints


def run_identity(launch: Launch, num_processes: int) -> dict[str, object]:
    """The run as a checkpoint records it: every flag but the FREE ones (as the launch resolved them), the process
    layout, the data's content, the precision and the sharding."""
    args = {k: v for k, v in vars(launch.args).items() if k != "explicit_flags"}
    resolved = {**args, **launch.resolved(), "num_processes": num_processes,
                "data_parallel_size": launch.data_parallel_size or num_processes,
                "data_content": data_content(launch.args),
                "sharding": "whole" if launch.run.sharding in ("none", "ddp") else launch.run.sharding}
    return {k: _jsonable(v) if k != "data_content" else v for k, v in sorted(resolved.items()) if k not in FREE}


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


def _sha256(path: Path) -> str:  # the manifests written before crc32 (still verified)
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


CHUNK = 32 << 20  # a file's crc32 per chunk: the chunks of every file a process wrote are summed in parallel


def _crc32s(paths: list[Path]) -> dict[Path, list[str]]:
    """Each file's zlib.crc32 per CHUNK bytes (5 GiB/s on an idle core; SHA-256 1.7), in threads (zlib frees the GIL),
    so a process checks its files on as many cores as it has (they idle while a checkpoint is written)."""
    jobs = [(p, at) for p in paths for at in range(0, max(p.stat().st_size, 1), CHUNK)]

    local = threading.local()

    def one(job: tuple[Path, int]) -> str:
        if not hasattr(local, "buffer"):  # one reused buffer per thread: fresh 32 MB reads cost more than the crc
            local.buffer = bytearray(4 << 20)
        view, crc, left = memoryview(local.buffer), 0, CHUNK
        with job[0].open("rb", buffering=0) as f:
            f.seek(job[1])
            while left and (n := f.readinto(view[:min(left, len(view))])):
                crc, left = zlib.crc32(view[:n], crc), left - n
        return f"{crc:08x}"

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        crcs = list(pool.map(one, jobs))
    out: dict[Path, list[str]] = {p: [] for p in paths}
    for (path, _), crc in zip(jobs, crcs, strict=True):
        out[path].append(crc)
    return out


_OWNER = re.compile(r"(?:random_states_|zero_pp_rank_|rank_|(?:^|/)__)(\d+)")  # a per-process file's writer


def _owner(name: str, world: int) -> int:
    """The process that wrote a checkpoint file: its rank where the name carries one (DCP `__R_0.distcp`, ZeRO
    `zero_pp_rank_R_*`, `random_states_R.pkl`, pipeline `rank_R/`), else the main process (Accelerate's whole model
    and optimizer, the state file)."""
    match = _OWNER.search(name)
    return int(match.group(1)) if match and int(match.group(1)) < world else 0


def _gathered(accelerator, mine: list) -> list:
    """Every process's list, concatenated (this process's alone without a process group)."""
    if accelerator is None or accelerator.num_processes == 1:
        return mine
    import torch.distributed as dist

    every: list = [None] * accelerator.num_processes
    dist.all_gather_object(every, mine)
    return [item for part in every for item in part]


def _write_manifest(directory: Path, accelerator=None) -> None:
    """Each process checksums the files it wrote itself (in parallel); the main process writes the manifest."""
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    files = [p for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST
             and _owner(str(p.relative_to(directory)), world) == rank]
    mine = [(str(p.relative_to(directory)), p.stat().st_size, crc) for p, crc in _crc32s(files).items()]
    entries = {name: {"bytes": size, "crc32": crc} for name, size, crc in _gathered(accelerator, mine)}
    if rank == 0:
        (directory / MANIFEST).write_text(json.dumps(dict(sorted(entries.items())), indent=1))


def verify_checkpoint(directory: Path, accelerator=None) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; else what is wrong. With an
    accelerator, each process reads back the files it wrote (all processes must call it)."""
    manifest = directory / MANIFEST
    if not manifest.exists():
        return f"no {MANIFEST} (the save did not finish)"
    entries = _read_json(manifest)
    # Trusted only as the checker expects it: a non-empty {file: {bytes, crc32 or sha256}} naming the state file,
    # every path inside the checkpoint. Anything else (random bytes, a list, an entry without its hash) is damage.
    if not isinstance(entries, dict) or STATE_FILE not in entries:
        return f"{MANIFEST} is damaged (not a manifest listing {STATE_FILE})"
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    problems, owned = [], []
    for name, meta in entries.items():
        if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int)
                and isinstance(meta.get("crc32", meta.get("sha256")), (list, str))):
            return f"{MANIFEST} is damaged (its entry for {name!r} has no size and hash)"
        path = directory / name
        if not path.resolve().is_relative_to(directory.resolve()):
            return f"{MANIFEST} names a file outside the checkpoint ({name!r})"
        if _owner(name, world) != rank:
            continue
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != meta["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, the manifest says {meta['bytes']}")
        elif "crc32" not in meta and _sha256(path) != meta["sha256"]:
            problems.append(f"{name} does not match its sha256")
        elif "crc32" in meta:
            owned.append((name, path, meta["crc32"]))
    if not problems:
        sums = _crc32s([path for _, path, _ in owned])
        problems = [f"{name} does not match its crc32" for name, path, crc in owned if sums[path] != crc][:1]
    problems = _gathered(accelerator, problems)
    if problems:
        return problems[0]
    state = _read_json(directory / STATE_FILE)
    if not (isinstance(state, dict) and isinstance(state.get("step"), int)
            and isinstance(state.get("micro_batches"), int)):
        return f"{STATE_FILE} is damaged (no step and data position)"
    return None


def _state(directory: Path) -> dict:
    state = _read_json(directory / STATE_FILE)
    return state if isinstance(state, dict) else {}


def saved_run(directory: Path) -> dict:
    """The run a verified checkpoint records ({} for one written before checkpoints recorded it)."""
    run = _state(directory).get("run")
    return run if isinstance(run, dict) else {}


# A run's lineage: a resume that changes a setting, or goes back to a checkpoint that is not its branch's newest,
# starts a new branch (checkpoints/lineage.json, oldest first; each checkpoint records its branch). `latest` follows
# the newest branch's line: its own checkpoints, then its parent's up to the step it started from, and so on up.
_lineage: dict = {"branch": 0, "parent": None, "from_step": None, "from": None}  # this process's (resume() sets it)


def lineage() -> dict:
    """This process's branch of the run: its id, its parent's, the step and checkpoint it started from (results)."""
    return dict(_lineage)


def _branches(root: Path) -> list[dict]:
    """lineage.json, with the branches the checkpoints record and it lacks (each with its parent): where it is
    missing, damaged or stale (a partial copy of the run folder), `latest` took the abandoned branch 0's newest."""
    data = _read_json(root / LINEAGE)
    ok = isinstance(data, list) and data and all(isinstance(b, dict) and isinstance(b.get("branch"), int) for b in data)
    by_id = {b["branch"]: b for b in (data if ok else [{"branch": 0, "parent": None, "from_step": None}])}
    for path in _checkpoints(root):
        state = _state(path)
        branch, parent = state.get("branch", 0), state.get("parent") or {}
        if isinstance(branch, int) and branch not in by_id and isinstance(parent, dict):
            by_id[branch] = {"branch": branch, "parent": parent.get("branch"), "from_step": parent.get("step")}
    return [by_id[b] for b in sorted(by_id)]  # oldest first: a new branch's id is the largest known plus one


def _line(branches: list[dict], branch: int) -> dict[int, float]:
    """branch id -> the last step of that branch on `branch`'s line (the branch itself: all of it)."""
    by_id, line, limit = {b["branch"]: b for b in branches}, {}, float("inf")
    while isinstance(branch, int) and branch not in line:
        line[branch] = limit
        b = by_id.get(branch, {})
        branch, limit = b.get("parent"), b.get("from_step")
        limit = float("inf") if limit is None else limit
    return line


def _checkpoints(root: Path) -> list[Path]:
    """The run's checkpoints, oldest first: step_<N> only. Other folders there (reshard's step_N_universal, a user's
    step_N_backup) are resumed by path, never counted, pruned or taken by `latest` (they raised ValueError)."""
    return sorted((p for p in root.glob("step_*") if p.name[5:].isdigit()), key=_step_of)


def _step_of(path: Path) -> int:
    return int(path.name.rsplit("_", 1)[-1])


def _on_line(path: Path, line: dict[int, float]) -> bool:
    return _step_of(path) <= line.get(_state(path).get("branch", 0), -1)


def save_checkpoint(accelerator, launch: Launch, step: int, micro_batches: int, keep: int | None = None,
                    final: Path | None = None, background: bool = False, writes=None) -> Path:
    """Model, optimizer, scheduler, scaler and RNG states (Accelerate), plus where the data stood and the run.

    Written under a temporary name, hashed into a manifest, then renamed: a run killed mid-save never leaves a
    checkpoint that looks whole. `keep`: how many of this run's newest checkpoints to keep (another run's, in the
    same directory, are never deleted). `final`: another place than checkpoints/step_N (the divergence guard's).
    `writes`: the run's AsyncCheckpoints under --async_checkpoint (techniques/async_checkpoint.py; None without): its
    checkpoint in flight is completed first, and a `background` one is written while training goes on.
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
        ours = [p for p in _checkpoints(root) if not differences(saved_run(p), run, FIXED)]
        if ours:  # the last one's size: what this one needs, checked before writing a byte
            last = _read_json(ours[-1] / MANIFEST) or {}
            rundir.check_room(root, sum(m.get("bytes", 0) for m in last.values()), f"checkpoint {final.name}", then)
    accelerator.wait_for_everyone()

    def complete(write: Callable[[], object]) -> Path:  # written, hashed, renamed: from then on `latest` takes it
        try:
            write()
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                parent = {"branch": _lineage["parent"], "step": _lineage["from_step"]}
                (tmp / STATE_FILE).write_text(json.dumps({"step": step, "micro_batches": micro_batches, "run": run,
                                                          "branch": _lineage["branch"], "parent": parent}))
            accelerator.wait_for_everyone()
            _write_manifest(tmp, accelerator)  # each process checksums what it wrote
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
            if keep and final.parent == root:
                # The newest `keep` of this branch's line; the checkpoints of abandoned branches go too, now that
                # this branch has one (the rollback point stays until then: it is on the line).
                line = _line(_branches(root), _lineage["branch"])
                ours = [p for p in _checkpoints(root) if not differences(saved_run(p), run, FIXED)]
                on = [p for p in ours if _on_line(p, line)]
                for old in on[:-keep] + [p for p in ours if p not in on]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    if background:  # the DCP shards staged here, written in the background, completed at the next writes.wait()
        writes.start(lambda: accelerator.save_state(str(tmp)), complete)
        return final
    return complete(lambda: accelerator.save_state(str(tmp)))


def logging_step(launch: Launch, step: int, max_steps: int) -> bool:
    """Optimizer step `step` (1-based) is a logging step: every --logging_steps steps and the last. The guard and the
    preemption check read across processes there only, so a step in between waits on no collective."""
    return step % launch.args.logging_steps == 0 or step == max_steps


class Preemption:
    """SIGTERM (a scheduler's preemption), SIGINT, SIGHUP (a closed terminal, a dropped ssh session) and SIGUSR1
    (Slurm's `--signal=USR1@T` warning before the time limit), checked by a line of the recipe's loop:
    `check(step, ...)`.

    The handler only notes the signal (a second SIGINT interrupts at once, as usual). One process acts on it at the
    next step; several agree on it at the logging steps (every --logging_steps steps and the last), in one small
    all-reduce, so that every process saves the same step and a step that does not log waits on no collective and no
    host read: keep --logging_steps x the step time under the scheduler's grace period. Acting on it: the training
    state is saved as a checkpoint and the process exits with 128 + the signal; at the run's last step the run
    finishes instead (the model first, then the evaluation). Created by the recipe once max_steps is known."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

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
    AsyncCheckpoints under --async_checkpoint (written in the background, but the last). The signals are the
    recipe's own line (Preemption.check)."""
    every, last = launch.args.checkpointing_steps, step == max_steps
    if every and (step % every == 0 or last):
        save_checkpoint(accelerator, launch, step, micro_batches, keep=launch.args.save_total_limit,
                        background=writes is not None and not last, writes=writes)


def find_checkpoint(launch: Launch, accelerator) -> Path | None:
    """The directory --resume_from_checkpoint names ('latest': the newest one of this run's newest branch that
    verifies; another run's, in the same directory, with another seed, model, data or batch, is skipped with a
    warning, and so is an abandoned branch's). Only the checkpoint about to be loaded is read back."""
    wanted, root = launch.resume_from_checkpoint, checkpoints_root(launch.output_dir)
    if not wanted:
        return None
    if wanted == "latest":
        run = run_identity(launch, accelerator.num_processes)
        branches = _branches(root)
        line = _line(branches, branches[-1]["branch"])
        for path in reversed(_checkpoints(root)):
            if not _on_line(path, line):
                logger.info("skipping checkpoint %s: its branch was abandoned at an earlier step (a resume from "
                            "there started branch %d, which `latest` follows)", path, branches[-1]["branch"])
                continue
            other = differences(saved_run(path), run, FIXED)
            problem = f"another run's ({_described(other)})" if other else verify_checkpoint(path, accelerator)
            if problem is None:
                return path
            logger.warning("skipping checkpoint %s: %s", path, problem)
        # The line began at a checkpoint outside this folder (--resume_from_checkpoint of another run's) and has none
        # here yet: that is where it resumes; starting from scratch would drop what the line was trained from.
        for branch in (b for b in reversed(branches) if b["branch"] in line and b.get("from")):
            start = Path(branch["from"])
            if start.resolve() in {p.resolve() for p in _checkpoints(root)}:
                continue  # a rollback point here is on the line above: taken there if it verifies
            problem = verify_checkpoint(start, accelerator) if start.is_dir() else "it no longer exists"
            if problem:
                raise CheckpointError(f"--resume_from_checkpoint latest: branch {branch['branch']} of the run in "
                                      f"{launch.output_dir} started from {start}, which it has no checkpoint after, "
                                      f"and {start} cannot be resumed ({problem}). Pass --resume_from_checkpoint "
                                      "with a complete checkpoint, or start afresh with --overwrite_output_dir.")
            logger.warning("--resume_from_checkpoint latest: branch %d has no checkpoint in %s yet; resuming from "
                           "%s, where it started", branch["branch"], root, start)
            return start
        logger.warning("--resume_from_checkpoint latest: no complete checkpoint in %s; starting from scratch",
                       root)
        return None
    path = Path(wanted)
    if not path.is_dir():
        found, fix = diagnose("checkpoint", wanted)
        raise CheckpointError(f"--resume_from_checkpoint {wanted!r} {'does not exist' if not path.exists() else found}."
                              f" {fix + ' ' if fix.startswith('Did') else ''}Pass a directory under {root} or "
                              "'latest'.")
    problem = verify_checkpoint(path, accelerator)
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
    for path in _checkpoints(checkpoints_root(launch.output_dir)):
        other = differences(saved_run(path), run, FIXED) if (path / MANIFEST).exists() else {}
        if other:
            raise CheckpointError(f"{path.parent} holds checkpoints of another run ({path.name}: "
                                  f"{_described(other)}), which this run's checkpoints would replace. Pass another "
                                  "--output_dir, or resume that run with its own settings and "
                                  "--resume_from_checkpoint latest.")


_resume_changes: dict = {}  # this process's resume: setting -> (saved, now), applied (written by resume() only)


def resume_changes() -> dict:
    """What this process's resume changed from the checkpoint's run (results.json "resume_changes")."""
    return dict(_resume_changes)


def _finished(accelerator, launch: Launch, at_last_step: bool, steps: int) -> None:
    """Results are written once per training: a resume that trains nothing where results.json is written, or a torch
    elastic restart after this launch wrote it (a process died after the run finished), leaves it and stops."""
    results = Path(launch.output_dir) / "results.json"
    if not results.exists():
        return
    written = _read_json(results)
    if not isinstance(written, dict):  # cut short or damaged (a full disk, a partial copy): no record of the end
        logger.warning("%s cannot be read as the run's results (damaged, or cut short): the run's end is not "
                       "recorded, so it is evaluated and written again from the checkpoint.", results)
        return
    # `latest` where the newest branch finished writing no checkpoint at its last step (run without
    # --checkpointing_steps): it would train that branch again from an earlier step and write over its results. (One
    # whose last checkpoint is damaged trains again from the newest that verifies.)
    ended = launch.resume_from_checkpoint == "latest" and written.get("max_train_steps") == steps and not (
        written.get("flags") or {}).get("checkpointing_steps") and (written.get("lineage") or {}).get(
        "branch", 0) == _branches(checkpoints_root(launch.output_dir))[-1]["branch"]
    restarted = False
    if not at_last_step and launch.elastic_restarts:
        import psutil  # the launcher (torch elastic's agent) began before this launch's first attempt

        restarted = results.stat().st_mtime >= psutil.Process(os.getppid()).create_time()
    if not (at_last_step or ended or restarted):
        return
    logger.warning("the run in %s is finished (%s written%s): nothing to train, and its results are left as they "
                   "are. To train on, pass a larger --max_train_steps with --resume_from_checkpoint latest.",
                   launch.output_dir, results, " by this launch before a process died" if restarted else "")
    accelerator.end_training()
    raise RunFinished(written)


def _refuse_unknown_or_changed(path: Path, saved: dict, run: dict, explicit: set) -> None:
    """Before loading: a checkpoint that does not record what it depends on is unknown, and a change of a setting
    it depends on is refused, each naming both values and the fix."""
    missing = [k for k in REQUIRED if k not in saved]
    if missing:
        raise CheckpointError(f"{path} does not record {', '.join(missing)} (written before checkpoints recorded "
                              "their run and data): it cannot be checked against this run, so it is not resumed. "
                              "Resume it with the version of the recipes that wrote it, or start afresh in another "
                              "--output_dir.")
    if saved.get("recipe", run["recipe"]) != run["recipe"]:  # first: every other difference follows from it
        raise CheckpointError(f"{path} was written by recipes/{saved['recipe']}.py, and this is recipes/"
                              f"{run['recipe']}.py: a checkpoint holds its recipe's model, wrapping and optimizer "
                              f"state. Resume it with recipes/{saved['recipe']}.py and that run's flags, or start "
                              "afresh in another --output_dir (--model_name_or_path takes a finished run's model).")
    data = differences(saved, run, ("data_content",))
    if data:
        (was, now), = data.values()
        names = sorted(set(was) | set(now))
        raise CheckpointError(f"{path} was trained on other data: " + "; ".join(
            f"--{k} held {was.get(k)}, now {now.get(k)}" for k in names if was.get(k) != now.get(k)) +
            ". Resume with the data it was trained on, or start afresh in another --output_dir.")
    layout = differences(saved, run, ("mixed_precision", "sharding"))
    if layout:
        fix = {"mixed_precision": f"resume with --mixed_precision {saved['mixed_precision']} (a checkpoint holds "
                                  "the optimizer and loss-scaler state of its precision: fp16 adds scaler.pt, ZeRO "
                                  "bf16 its bf16_* optimizer files)",
               "sharding": f"resume under the launch config that wrote it ({saved['sharding']}); another sharding "
                           "reads other files (DDP: one model and optimizer; FSDP: DCP shards; ZeRO: per-stage "
                           "partitions), which neither Accelerate nor DeepSpeed converts in place"}
        said = {"mixed_precision": "--mixed_precision", "sharding": "the launch config's sharding"}
        raise CheckpointError(f"{path} was written with another layout (" + ", ".join(
                              f"{said[k]} was {a!r}, now {b!r}" for k, (a, b) in layout.items()) + "): "
                              + "; ".join(fix[k] for k in layout) + ". To change it, start a new run from the "
                              "trained model (--model_name_or_path).")
    refused = [k for k in sorted(set(saved) | set(run)) if k not in APPLIED + LAYOUT + DEPENDS + FREE]
    changed = {k: (saved.get(k), run.get(k)) for k in refused if k in saved and saved[k] != run.get(k)}
    changed |= {k: ("not recorded", run.get(k)) for k in refused if k not in saved and k in explicit}
    if changed:
        raise CheckpointError(f"{path} was written by another run: {_described(changed)}. Resume with that run's "
                              "settings, or start afresh in another --output_dir (the data position, model or batch "
                              "would differ).")


def _start_branch(accelerator, launch: Launch, path: Path | None, state: dict, changes: dict) -> None:
    """This process's branch: the resumed one where it resumes its branch's newest checkpoint unchanged; else a
    new one (recorded in lineage.json by the main process), whose parent is the resumed checkpoint's branch."""
    root = checkpoints_root(launch.output_dir)
    branches = _branches(root)
    newest = branches[-1]["branch"]
    ours = _checkpoints(root)
    if path is None and not (launch.args.checkpointing_steps and (ours or (root / LINEAGE).exists())):
        _lineage.update(branch=0, parent=None, from_step=None, **{"from": None})  # nothing to branch from, or to
        return
    if path is not None:
        branch, step = state.get("branch", 0), state["step"]
        tip = path.parent.resolve() == root.resolve() and branch == newest and not any(
            _step_of(p) > step and _state(p).get("branch", 0) == branch for p in ours)
        if tip and not changes:
            _lineage.update(next(({"branch": b["branch"], "parent": b.get("parent"), "from_step": b.get("from_step"),
                                   "from": b.get("from")} for b in branches if b["branch"] == branch),
                                 {"branch": branch, "parent": None, "from_step": None, "from": None}))
            return
    known = {b["branch"] for b in branches} | {_state(p).get("branch", 0) for p in ours}
    entry = {"branch": max(known) + 1, "parent": state.get("branch", 0) if path else None,
             "from_step": state["step"] if path else None, "from": str(path.resolve()) if path else None,
             "changes": {k: list(v) for k, v in changes.items()}}
    accelerator.wait_for_everyone()  # every process has read lineage.json before the main process adds to it
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        if not (root / LINEAGE).exists():
            branches = [{"branch": 0, "parent": None, "from_step": None}]
        (root / f"{LINEAGE}.tmp").write_text(json.dumps([*branches, entry], indent=1))
        os.replace(root / f"{LINEAGE}.tmp", root / LINEAGE)
    accelerator.wait_for_everyone()
    _lineage.update({k: entry[k] for k in ("branch", "parent", "from_step", "from")})
    parent = f"branch {entry['parent']} at step {entry['from_step']} ({path})" if path else "step 0"
    logger.warning("branch %d of this run starts here, from %s%s; `--resume_from_checkpoint latest` now follows "
                   "branch %d, never the steps it replaces", entry["branch"], parent,
                   f", with {_described(changes)}" if changes else "", entry["branch"])


def _optimizers(accelerator) -> list:
    return list(getattr(accelerator, "_optimizers", []))


def resume(accelerator, launch: Launch, max_steps: int) -> tuple[int, int]:
    """Load a checkpoint into the prepared objects; returns (optimizer steps done, micro-batches consumed).

    A checkpoint that does not record what it depends on, or of a run with another setting it depends on (data,
    precision, sharding, every REFUSED flag), is refused before anything is loaded, naming them; an APPLIED one is
    applied from the resumed step on and reported by resume_changes(); either starts a new branch (lineage())."""
    path, steps = find_checkpoint(launch, accelerator), max_steps
    _resume_changes.clear()
    if launch.elastic_restarts and accelerator.is_main_process:  # the budget torch elastic has left, and then what
        used, most = launch.elastic_restarts, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        then = ("the last one: if a process dies again, the job ends. Find why in the launcher's failure summary (rank,"
                " exit code, signal), fix it, and run the same command with --resume_from_checkpoint latest"
                if used >= most else f"{most - used} left")
        logger.warning("torch elastic restart %d of %d (a process died; all were restarted), resuming from %s: %s.",
                       used, most, path or "step 0 (no complete checkpoint; --checkpointing_steps N writes them)", then)
    state = json.loads((path / STATE_FILE).read_text()) if path else {}
    _finished(accelerator, launch, bool(path) and state["step"] == steps, steps)
    if accelerator.is_main_process and not launch.args.no_save_model:  # the final model's room, before any step
        params = [p for m in prepared_models(accelerator) for p in m.parameters()]
        needed = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)  # ZeRO-3: its full size
        rundir.check_room(Path(launch.output_dir), needed, "the final model", "nothing has trained yet.")
    if path is None:
        _refuse_overwriting_another_run(launch, accelerator.num_processes)
        _start_branch(accelerator, launch, None, {}, {})
        return 0, 0
    run, saved = run_identity(launch, accelerator.num_processes), saved_run(path)
    _refuse_unknown_or_changed(path, saved, run, set(getattr(launch.args, "explicit_flags", ())))
    consumed = reshard(launch, path, saved, run, state["micro_batches"])
    if steps and state["step"] > steps:
        raise CheckpointError(f"{path} is at step {state['step']}, past this run's {steps} steps. Pass "
                              f"--max_train_steps {state['step']} or more (or --num_train_epochs) to train on.")
    if state["step"] == steps:  # a run stopped after its last step (killed in its final save or evaluation)
        logger.warning("%s is at the last step (%d): nothing to train; the model, evaluation and results are written "
                       "from it", path, steps)
    changes = differences(saved, run, APPLIED)
    # A recipe that checkpoints its own schedulers or optimizers (pipeline stages) cannot take a new schedule or
    # weight decay: refused before loading.
    kept_apart = [k for k in changes if k != "max_grad_norm" and not (prepared_schedulers(accelerator)
                                                                     and _optimizers(accelerator))]
    if kept_apart:
        raise CheckpointError(f"{path} was trained with {_described({k: changes[k] for k in kept_apart})}, and "
                              f"recipes/{launch.recipe}.py keeps its schedulers and optimizers apart from "
                              "Accelerate's, so they cannot be changed on resume. Resume with the old values.")
    # The optimizers' settings as the flags now give them: load_state brings back the saved ones (weight decay, betas).
    fresh = [[{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in o.param_groups]
             for o in _optimizers(accelerator)]
    try:  # a layout mismatch gets its own message; anything else a library raises, the loading boundary's
        with loading("checkpoint", "--resume_from_checkpoint", path):
            accelerator.load_state(str(path))
    except InputError as err:
        if not isinstance(err.__cause__, (FileNotFoundError, AssertionError, KeyError, ValueError, RuntimeError)):
            raise
        err = err.__cause__
        raise CheckpointError(f"{path} does not load into this launch ({type(err).__name__}: {err}): its files do not "
                              "match the model, optimizer or sharding built here. Resume it with the launch config "
                              "and flags that wrote it, or start afresh in another --output_dir.") from err
    _resume_changes.update(changes)
    if "weight_decay" in changes:
        for optimizer, groups in zip(_optimizers(accelerator), fresh, strict=True):
            for group, new in zip(optimizer.param_groups, groups, strict=True):
                group["weight_decay"] = new.get("weight_decay", group.get("weight_decay"))
    if set(changes) & set(SCHEDULE):
        # The scheduler's state brought back the old peak learning rate (base_lrs): the new one applies from here,
        # on the schedule the flags now give (transformers' schedules are LambdaLRs of the step).
        for wrapper in prepared_schedulers(accelerator):
            inner = getattr(wrapper, "scheduler", wrapper)
            inner.base_lrs = [launch.learning_rate] * len(inner.base_lrs)
            for group, lam in zip(inner.optimizer.param_groups, inner.lr_lambdas, strict=True):
                group["initial_lr"], group["lr"] = launch.learning_rate, launch.learning_rate * lam(inner.last_epoch)
    _start_branch(accelerator, launch, path, state, changes | differences(saved, run, LAYOUT))
    if changes:
        logger.warning("resumed %s with changed settings (applied from step %d): %s", path, state["step"], changes)
    logger.info("resumed from %s at step %d (branch %d)", path, state["step"], _lineage["branch"])
    return state["step"], consumed


def reshard(launch: Launch, path: Path, saved: dict, run: dict, micro_batches: int) -> int:
    """The data position in this run's micro-batches; on another LAYOUT too, if it keeps the batch (resharding.md)."""
    layout = differences(saved, run, LAYOUT)
    if not layout:
        return micro_batches
    def batch(r: dict) -> int:  # noqa: E306 (samples per optimizer step)
        return r["per_device_train_batch_size"] * r["gradient_accumulation_steps"] * (
            r.get("data_parallel_size") or r["num_processes"])
    if not launch.run.support.reshards:
        fix = f"recipes/{launch.recipe}.py resumes only on the layout that wrote it: resume with that run's settings"
    elif batch(saved) != batch(run):
        per = batch(saved) / batch({**run, "per_device_train_batch_size": 1})
        fix = f"the global batch (per device x processes x accumulation) was {batch(saved)}, now {batch(run)}: pass" + (
            f" --per_device_train_batch_size {per:g}" if per.is_integer() else f" a batch of {batch(saved)}")
    else:
        return micro_batches // saved["gradient_accumulation_steps"] * run["gradient_accumulation_steps"]
    raise CheckpointError(f"{path} was written on another layout ({_described(layout)}); {fix}, or start afresh in "
                          "another --output_dir (docs/resharding.md).")
