"""--async_checkpoint: checkpoints written in the background while training goes on (torch.distributed.checkpoint's
async_save, as torchtitan's checkpointer does).

A checkpoint's model and optimizer shards go through torch.distributed.checkpoint (DCP) in these recipes: Accelerate's
save_state writes FSDP2's sharded state with dcp.save (model, then optimizer), and techniques/tensor_parallel.py's
hook writes DTensor shards with one dcp.save. Inside `deferred()` each of those calls becomes dcp.async_save: the
state is staged (copied into new host memory; on a CPU-only machine that copy is host-to-host, the same bytes moved
once more in RAM) and the call returns; a background thread writes the copy. The checkpoint's layout is
Accelerate's own, so it resumes through load_state as a synchronous one does, and holds the same bytes.

Each write runs its collectives (DCP's plan exchange) on a gloo group of its own, apart from the training's and from
the other write: two threads on one group would interleave their messages. shared/core/checkpoint.py hashes and
renames the checkpoint only once its writes have finished (`wait`, at the next save or the run's last step), so
`--resume_from_checkpoint latest` never takes one that is still being written; a kill -9 in the meantime leaves
its .tmp_ directory, which `latest` does not look at, and the previous checkpoint whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp


class AsyncCheckpoints:
    """The run's background checkpoint writes: at most one checkpoint in flight (the recipe's `writes`)."""

    def __init__(self) -> None:
        self.groups: list[dist.ProcessGroup | None] = []  # the i-th DCP save of a checkpoint runs on groups[i]
        self.futures: list[Future] = []  # the writes of the checkpoint in flight
        self.complete: Callable[[], object] | None = None  # marks it complete once written (core/checkpoint.py)

    def _group(self, index: int) -> dist.ProcessGroup | None:
        while len(self.groups) <= index:  # every process makes its saves in the same order: the same groups
            self.groups.append(dist.new_group(backend="gloo") if dist.is_initialized() else None)
        return self.groups[index]

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside: each dcp.save stages its state to host memory and returns; the write goes on in the background.

        Accelerate's save_state has no asynchronous mode and calls dcp.save itself (accelerate/utils/fsdp_utils.py),
        so the call is redirected for the length of the save rather than the layout rewritten here."""
        if self.futures or self.complete:
            raise RuntimeError("a checkpoint is still being written: call wait() first")
        real = dcp.save

        def background(state_dict, **kwargs) -> None:
            group = self._group(len(self.futures))
            self.futures.append(dcp.async_save(state_dict, process_group=group, **kwargs))

        dcp.save = background
        try:
            yield
        finally:
            dcp.save = real

    def start(self, save: Callable[[], object], complete: Callable[[Callable[[], object]], object]) -> None:
        """Run `save` (Accelerate's save_state) with its DCP writes in the background; `complete(written)`, the
        spine's manifest and rename (shared/core/checkpoint.py save_checkpoint), runs at the next wait()."""
        with self.deferred():
            save()
        self.complete = lambda: complete(self.written)

    def written(self) -> None:
        """Block until this process's writes of the checkpoint in flight are on disk (a write's error raised here)."""
        futures, self.futures = self.futures, []
        for future in futures:
            future.result()

    def wait(self) -> None:
        """Finish the checkpoint in flight: its writes, then its manifest and rename (a collective: every process)."""
        complete, self.complete = self.complete, None
        if complete is not None:
            complete()

    def in_flight(self) -> bool:
        return any(not f.done() for f in self.futures)


def async_checkpoints(args) -> AsyncCheckpoints | None:
    """The recipe's `writes` for --async_checkpoint (None: every checkpoint written before the next step)."""
    return AsyncCheckpoints() if args.async_checkpoint else None
