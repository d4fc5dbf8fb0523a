"""One job per run directory: rank 0 holds an exclusive ``flock`` on ``<run dir>/.lock`` for the
run's life, with its pid, host and start time written inside.

The kernel drops the lock when its process dies, however it dies, so a lock never outlives its
job: a second job finds it held and is refused, naming the holder. A clean end deletes the
file; a file found with a holder's details but no lock on it was left by a job that was killed,
and is taken over with a message. (``flock`` needs a file system that supports it across the
hosts that share the run dir: local disks and NFSv4 do.)
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from recipes.options import UsageError

LOCK_NAME = ".lock"


def _holder(fd: int) -> str:
    """Who wrote the lock file: 'pid P on HOST since TIME', or '' for an empty file."""
    text = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on {holder['host']} since {holder['started']}"
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"an unreadable holder ({text[:60]!r})" if text else ""


class RunLock:
    """``acquire`` takes the run dir's lock (raising UsageError when another job holds it);
    ``release`` gives it back and deletes the file."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = None
        self.made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # removed if left empty

    def acquire(self) -> str | None:
        """Hold the lock; returns a note when a killed job's lock file is taken over."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd) or "a job still starting"
                os.close(fd)
                raise UsageError(
                    f"--run-dir {self.run_dir} is in use by another job ({holder}); stop it or wait "
                    "for it to end, or pick another --run-dir"
                ) from None
            try:  # the holder before us may have deleted the file between our open and our lock
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _holder(fd)
        mine = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(mine).encode(), 0)
        self.fd = fd
        return f"taking over {self.path} from {previous}: that job is gone" if previous else None

    def release(self) -> None:
        """Delete the lock file, then let go of it; folders ``acquire`` made that the run left
        empty (it stopped before writing anything) go too."""
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while still held: no one can lock a file we delete
            os.close(self.fd)
            self.fd = None
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote there
                break
