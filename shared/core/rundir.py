"""The output directory: one run writes to it at a time, a finished run in it is replaced only when asked (and then
none of its files stay beside the new model), and a full disk is named, with the bytes needed, before a save."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

from .errors import CheckpointError

LOCK = ".run.lock"  # held (flock) for the run's life; it also records which entries were there before the run
RUN_STATE = ("checkpoints", "diverged_step_*", "results.json", "results.json.tmp", "preflight.json")
FINISHED = ("results.json", "model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
            "quantized_model.pt")  # any one of them: a run finished here
_held: dict[Path, int] = {}  # output dir -> this process's locked descriptor


def claim(args: argparse.Namespace, output_dir: str, resume: str | None) -> None:
    """Before anything loads, on the main process: the directory can be written, no other run holds it, and it holds
    no finished run unless --overwrite_output_dir (which removes that run's files) or a resume is asked (`resume`:
    --resume_from_checkpoint, or 'latest' in a restart). A dead run's lock is free: the kernel dropped it."""
    import fcntl

    path = Path(output_dir).expanduser().absolute()
    check_writable(path, output_dir)
    if path in _held:
        return
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the kernel releases it when the process ends, kill -9 too
    except BlockingIOError:
        holder = _read_lock(fd).get("by", "another process")
        os.close(fd)
        raise CheckpointError(f"--output_dir {output_dir!r} is in use by another run ({holder}): two runs in one "
                              "directory replace each other's checkpoints and model. Pass another --output_dir, or "
                              "wait for it to end.") from None
    _held[path] = fd
    before = _read_lock(fd).get("before")
    done = [name for name in FINISHED if (path / name).exists()]
    if done and not resume:
        if not args.overwrite_output_dir:
            release()
            raise CheckpointError(f"--output_dir {output_dir!r} holds a finished run ({done[0]}): a new run would "
                                  "replace its model and results. Pass --overwrite_output_dir to replace it, "
                                  "--resume_from_checkpoint latest to train it on, or another --output_dir.")
        _remove_run(path, before)
        before = None
    if before is None or not resume:  # a resume keeps its first session's record
        before = {p.name: p.stat().st_mtime_ns for p in path.iterdir() if p.name != LOCK}
    record = json.dumps({"by": f"pid {os.getpid()} on {socket.gethostname()}", "before": before}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)


# What a run reads from: none of it may be, hold, or lie inside its output directory.
READS = ("model_name_or_path", "tokenizer_name", "train_file", "validation_file", "train_dir", "validation_dir",
         "dataset_name", "resume_from_checkpoint")


def refuse_inputs(args: argparse.Namespace, output_dir: str, resume: str | None) -> None:
    """The user's files are never the output: an --output_dir that is, holds or lies inside a path the run reads (the
    model being fine-tuned, its tokenizer, the data, another run's checkpoint) is refused, --overwrite_output_dir or
    not, which would delete them. Links are followed. A checkpoint of this run's own (output_dir/checkpoints/...) is
    its resume."""
    out = Path(output_dir).expanduser().resolve()
    typed = args.resume_from_checkpoint  # (an elastic restart's own 'latest' is not typed: it follows the first try)
    if args.overwrite_output_dir and typed and (typed == "latest" or
                                                out / "checkpoints" in Path(typed).expanduser().resolve().parents):
        # claim() would keep the run to resume it, and --overwrite_output_dir would be silently dropped
        raise CheckpointError(f"--overwrite_output_dir removes the run in {output_dir!r}, and --resume_from_checkpoint "
                              f"{typed} continues it: they ask for opposite things. Drop --overwrite_output_dir to "
                              "train that run on, or drop --resume_from_checkpoint to start afresh.")
    for name in READS:
        value = resume if name == "resume_from_checkpoint" else getattr(args, name, None)
        if not value or value == "latest" or not Path(value).expanduser().exists():  # a hub id reads no local path
            continue
        src = Path(value).expanduser().resolve()
        if name == "resume_from_checkpoint" and out / "checkpoints" in src.parents:
            continue
        if name == "resume_from_checkpoint" and src in (out, out / "checkpoints"):  # the run, not one of its steps
            what = "folder (--output_dir)" if src == out else "checkpoints folder"
            raise CheckpointError(f"--resume_from_checkpoint {value!r} is this run's {what}, not one of its "
                                  "checkpoints. Pass --resume_from_checkpoint latest (its newest complete one), or "
                                  f"a step_N folder under {out / 'checkpoints'}.")
        where = ("is" if src == out else "lies inside" if src in out.parents else "holds" if out in src.parents
                 else "")
        if where:
            top = out if where == "holds" else src
            raise CheckpointError(f"--output_dir {output_dir!r} {where} --{name} {value!r}, which this run reads: "
                                  "its files would be overwritten (the model, checkpoints and results written "
                                  "there), and the run's own files mixed with them. Pass an --output_dir apart "
                                  f"from every input (e.g. {top.parent / (top.name + '-finetuned')}).")


def _read_lock(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 20, 0) or b"{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _remove_run(path: Path, before: dict | None) -> None:
    """The previous run's files: its run state, and every entry it created or rewrote (where its lock recorded what
    was there before it began). Files that were there before it, a user's own among them, stay."""
    ours = {p for pattern in RUN_STATE for p in path.glob(pattern)}
    if isinstance(before, dict):
        ours |= {p for p in path.iterdir() if p.name != LOCK and before.get(p.name) != p.stat().st_mtime_ns}
    for p in ours:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def release() -> None:
    """The end of the run in this process (entrypoint): another run may take the directories now."""
    while _held:
        os.close(_held.popitem()[1])


LONGEST = 160  # bytes a run adds under --output_dir: checkpoints/.tmp_step_N/pytorch_model_fsdp_0/__R_0.distcp, events


def _exists(path: Path) -> bool:  # a name too long to look up (ENAMETOOLONG) is not there
    try:
        return path.exists()
    except OSError:
        return False


def check_writable(path: Path, output_dir: str) -> None:
    """An output directory that cannot be written, or whose paths would be too long for the filesystem
    (ENAMETOOLONG), would fail at the first checkpoint or log write, or after training."""
    existing = next(p for p in (path, *path.parents) if _exists(p))
    name_max, path_max = os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    long = next((part for part in path.parts if len(part.encode()) > name_max), None)
    if long is not None or len(str(path).encode()) + LONGEST > path_max:
        what = (f"its part {long[:40]}... has {len(long.encode())} bytes, over the {name_max} a name may have there"
                if long is not None else f"it has {len(str(path).encode())} bytes, and the files a run writes under "
                f"it would pass the {path_max} a path may have there")
        raise CheckpointError(f"--output_dir {output_dir[:80]!r}...: {what} (ENAMETOOLONG). Pass a shorter "
                              "--output_dir.")
    if not existing.is_dir():
        raise CheckpointError(f"--output_dir {output_dir!r}: {existing} is a file, not a directory. Pass another path.")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test-"):
            pass
    except OSError as err:
        raise CheckpointError(f"--output_dir {output_dir!r} cannot be written ({type(err).__name__}: "
                              f"{err.strerror or err}). Pass a directory you can write to.") from None


def _mount(path: Path) -> tuple[Path, int]:
    """The mount point holding `path` and its free bytes."""
    path = next(p for p in (path, *path.parents) if p.exists())
    mount = path
    while not os.path.ismount(mount):
        mount = mount.parent
    return mount, shutil.disk_usage(path).free


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


def check_room(path: Path, needed: int, what: str, then: str) -> None:
    """Refuse a save of about `needed` bytes that the disk holding `path` has no room for, before it starts."""
    mount, free = _mount(Path(path).absolute())
    if free < needed:
        raise CheckpointError(f"The disk holding {path} ({mount}) has {_mb(free)} free, and {what} needs about "
                              f"{_mb(needed)}. Free space there or pass another --output_dir; {then}")


def disk_full(err: BaseException, path: Path, what: str, then: str) -> SystemExit | None:
    """A failed save, said as a full disk where it was one (torch says `basic_ios::clear: iostream error` or
    `file write failed`, safetensors `No space left on device`), or as a disk that cannot be written (a read-only
    remount, EIO); None when it was neither."""
    mount, free = _mount(Path(path).absolute())
    if getattr(err, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENAMETOOLONG):
        return SystemExit(f"{what} could not be written under {path} ({err.strerror}: {err.filename}). Make "
                          f"{mount} writable or pass another --output_dir; {then}")
    if getattr(err, "errno", None) != 28 and "No space left" not in str(err) and free > 2**20:
        return None
    return SystemExit(f"The disk holding {path} ({mount}) is full ({_mb(free)} free): {what} did not fit "
                      f"({type(err).__name__}: {err}). Free space there or pass another --output_dir; {then}")
