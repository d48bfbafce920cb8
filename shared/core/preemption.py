"""SIGTERM and SIGINT as a run acts on them: saved at the next step boundary, then exit (shared/core/checkpoint.py)."""

from __future__ import annotations

import signal


class Preemption:
    """SIGTERM (a scheduler's preemption) and SIGINT: the handler notes the signal, and the next step boundary saves
    and exits (a second SIGINT interrupts at once, as usual). With several processes, all act on the signal they
    agreed on in the meter's logging collective (Meter.record calls `agree`), so every one saves at the same step.
    The run's one instance is `launch.preemption` (installed by start_run)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.local = 0  # the signal this process received (0: none)
        self.agreed = 0  # the signal the processes agreed on at the meter's last logging step

    def install(self) -> None:
        def handler(signum, _frame):
            if signum == signal.SIGINT and self.local:
                raise KeyboardInterrupt
            self.local = self.local or signum

        for signum in self.SIGNALS:
            signal.signal(signum, handler)

    def received(self) -> list[float]:
        """This process's vote, one per SIGNALS, for the meter's logging collective."""
        return [float(self.local == s) for s in self.SIGNALS]

    def agree(self, counts: list[float]) -> None:
        """The collective's result: how many processes received each of SIGNALS."""
        self.agreed = next((int(s) for s, n in zip(self.SIGNALS, counts, strict=True) if n), 0)

    def signal(self, num_processes: int) -> int:
        """The signal to act on now (0 if none). One process acts at once; several at the next logging step, so a
        step that does not log waits on no collective and no host read for it: keep --logging_steps x the step time
        under the scheduler's grace period."""
        return self.local if num_processes == 1 else self.agreed
