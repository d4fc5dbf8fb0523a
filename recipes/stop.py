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

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
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
