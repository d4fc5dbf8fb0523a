"""Stopping on SIGTERM (what schedulers send before a kill) and SIGINT (Ctrl-C).

The first signal only raises a flag. The trainer adds it to the step's loss reduction, so every
rank learns of it after the same step, wherever each one was when its signal came; it then
saves a checkpoint and exits with status ``STOPPED``. A second signal ends the process at once
(by that signal, without saving), unless it comes within ``SAME_REQUEST_S`` of the first: a
scheduler that signals every process of a job and torchrun, which passes its own signal on to
its workers, deliver one request twice.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

STOPPED = 3  # the exit status of a run stopped by a signal (after its checkpoint)
SAME_REQUEST_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered (in the main thread): ``requested`` names the first SIGTERM or SIGINT
    received, or is None. ``loud``: this process prints the line of a second signal."""

    def __init__(self, loud: bool):
        self.loud = loud
        self.requested: str | None = None
        self._at = 0.0
        self._before: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # else Python refuses handlers
            self._before = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.requested is None:
            self.requested, self._at = signal.Signals(signum).name, now
            return
        if now - self._at < SAME_REQUEST_S:
            return
        if self.loud:
            name = signal.Signals(signum).name
            print(f"second signal ({name}): exiting now, without a checkpoint", file=sys.stderr, flush=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def let_threads_run(quiet_polls: int = 3, poll_s: float = 0.005, limit_s: float = 30.0) -> None:
    """Before a process leaves a CPU job: collectives other than DMuonFSDP's own (DCP's, DTensor's
    gathers) leave their tensors to gloo's worker threads, which drop them when they next run; a
    drop after interpreter finalization began aborts the process ("terminate called without an
    active exception"; seen after a failed checkpoint save). So: sleep (the GIL released) until
    no other thread of this process has been runnable for
    ``quiet_polls`` polls in a row: a worker that still held a finished collective's tensors was
    runnable (or waiting for the GIL, which it gets while this thread sleeps) until it dropped
    them. Linux (/proc); elsewhere a fixed pause."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(0.2)
        return
    deadline, quiet, busy = time.monotonic() + limit_s, 0, list[str]()
    while quiet < quiet_polls:
        if time.monotonic() > deadline:
            print(f"finish: threads {busy} still runnable after {limit_s} s", file=sys.stderr, flush=True)
            return
        time.sleep(poll_s)
        busy = [tid for tid in os.listdir(tasks) if int(tid) != os.getpid() and _runnable(f"{tasks}/{tid}")]
        quiet = 0 if busy else quiet + 1


def _runnable(task: str) -> bool:
    try:
        with open(f"{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):  # the thread ended
        return False
