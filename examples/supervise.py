#!/usr/bin/env python3
"""Run a launch command so that SIGTERM and SIGINT reach the recipe's processes, whoever sends them (a scheduler,
`docker stop` with this script as the container's PID 1, Ctrl-C), and exit 128 + signal after a preemption save.

    python examples/supervise.py accelerate launch recipes/baseline.py --checkpointing_steps 100
    # a container:  ENTRYPOINT ["python", "examples/supervise.py", "accelerate", "launch"]

Why a wrapper: `accelerate launch` of one process forwards no signal (it dies, and its recipe saves only because it
asked the kernel to be told when its launcher dies); as a container's PID 1 it ignores SIGTERM altogether (the kernel
drops signals that PID 1 has no handler for), and `docker stop` then kills everything after its grace period. Torch
elastic (several processes) forwards them and waits for its workers' save, but then exits 1, so a scheduler cannot
tell a preemption from a failure.

What it does (standard library only, Linux): it starts the command in its own process group, forwards SIGTERM and
SIGINT to that group, waits for every process the command started (as their subreaper, it still waits for a recipe
whose launcher died), and exits 128 + the signal after one was forwarded and the command did not succeed; else with
the command's own status. A signal that came at the last step may also report 128 + signal for a run that finished:
resuming it rewrites the same model and results, so a scheduler that requeues loses nothing.
"""

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        sys.exit("usage: python examples/supervise.py COMMAND [ARGS...]")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned descendants are reparented here
    child = subprocess.Popen(argv, start_new_session=True)  # its own group: a terminal's Ctrl-C comes through here
    received: list[int] = []

    def forward(signum, _frame):
        received.append(signum)
        try:
            os.killpg(child.pid, signum)  # the launcher and, for one process, the recipe it started
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    status = 0
    while True:
        try:
            pid, raw = os.wait()  # every descendant that ends, reparented ones included
        except ChildProcessError:
            break  # none is left
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(raw)
    code = status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell reports it
    return 128 + received[0] if received and code != 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
