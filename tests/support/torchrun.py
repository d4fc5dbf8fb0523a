"""What a job that failed under torchrun printed: checked whole, as its user sees it."""

from __future__ import annotations

import re

TORCHRUN_LOG = re.compile(r"^[DIWE]\d{4} ")  # torchrun's own log lines: level, month, day
RECIPE_FRAME = re.compile(r'File "[^"]*/recipes/')


def only_torchruns_report(out: str, status: int, error: str) -> list[str]:
    """The whole output of a job that failed with ``error`` under torchrun: rank 0's line at most
    once among the workers' lines (returned; absent when another rank failed first and torchrun
    ended rank 0 before it printed: the user reads it in the report), then torchrun's failure
    report (with torchrun's own traceback, ChildFailedError), naming the failed rank's
    ``status``, whose every ``traceback`` field is the line the workers left in torchrun's error
    file (or the signal torchrun ended the other ranks with); no worker printed a traceback, no
    frame of the recipe shows."""
    before, report = out.split("Traceback (most recent call last)", 1)
    printed = [line for line in before.splitlines() if not TORCHRUN_LOG.match(line)]
    assert printed.count(error) <= 1 and "Traceback" not in before, out
    assert f"exitcode  : {status}" in report and "ChildFailedError" in report, out
    fields = [line.split(": ", 1)[1] for line in report.splitlines() if line.startswith("  traceback :")]
    assert error in fields, out
    assert all(f == error or f.startswith("Signal 15 (SIGTERM) received by PID") for f in fields), out
    assert "Traceback" not in report and not RECIPE_FRAME.search(out), out
    return printed
