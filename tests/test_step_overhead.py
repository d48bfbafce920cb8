"""A step that does not log adds no collective beyond the technique's own (issue: no per-step overhead): the
loss logging, the divergence guard's non-finite count and the preemption agreement each take one small all-reduce, at
the logging steps only (each is the recipe's own line: meter.record, guard.check, preemption.check)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, launch_command


@pytest.mark.slow
def test_non_logging_steps_call_only_the_techniques_own_collective(tmp_path):
    counts = tmp_path / "counts.json"
    cmd, env = launch_command("baseline", tmp_path / "out", "--max_train_steps", 9, "--logging_steps", 4,
                              "--no_save_model")
    script = cmd.index(str(ROOT / "recipes" / "baseline.py"))
    # The same launch, through the counting wrapper: `... tests/count_collectives.py OUT baseline <flags>`.
    cmd[script:script + 1] = [str(ROOT / "tests" / "count_collectives.py"), str(counts), "baseline"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"counts.json.{rank}").read_text())
        assert len(steps) == 9
        logging = {3, 7, 8}  # --logging_steps 4: steps 4 and 8, and the last (9), 0-based
        for i, called in enumerate(steps):
            if i == 0:
                continue  # the first step also holds what ran before it (set-up, the state count)
            # baseline's own: the global batch's item count, all-reduced to normalize the loss
            # + at a logging step: the meter's loss, the guard's non-finite count, the preemption agreement
            expected = ["all_reduce"] * (4 if i in logging else 1)
            assert called == expected, (rank, i, called)
