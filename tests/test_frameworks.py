"""DMuonFSDP inside the trainers people use, each run as users run it: torchrun, 2 CPU ranks, a tiny
Llama from a config (scripts in tests/frameworks/). Every run must exit 0 after a normal
``destroy_process_group()`` and interpreter exit, with training and a checkpoint resume that match
exactly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

HERE = os.path.join(os.path.dirname(__file__), "frameworks")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
# Where a rank's own account of a failure begins: a Python traceback (a chained one whole) or, for a
# native abort or the stacks dumped at a timeout, faulthandler's report.
FAILURE_STARTS = ("Traceback (most recent call last):", "Fatal Python error:")


def torchrun(script: str, tmp_path) -> dict:
    """Run ``script`` on 2 ranks; its exit status must be 0 (a clean teardown and exit).

    Each rank writes to its own log (torchrun ``--redirects``); a failure shows torchrun's account
    (which ranks failed, their exit codes or signals, the first one) and each rank's last traceback
    or faulthandler report. The ranks of a job past ``TIMEOUT_S`` get SIGABRT, so that each prints
    its threads' Python stacks, then SIGKILL: none is left running."""
    out = tmp_path / "result.pt"
    logs = tmp_path / "logs"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",  # a native abort (or the SIGABRT of a timeout) prints the Python stacks
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),  # the recipe's helpers
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        os.path.join(HERE, script),
        str(out),
    ]
    job = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _, stderr = job.communicate(timeout=TIMEOUT_S)
        failure = f"{script} exited {job.returncode}" if job.returncode else None
    except subprocess.TimeoutExpired:
        failure = f"{script} still running after {TIMEOUT_S} s (SIGABRT: the stacks below are where it was)"
        ranks = children(job.pid)  # each in a session of its own: killing torchrun would leave them running
        signal_all(ranks, signal.SIGABRT)  # faulthandler prints the stacks, torchrun reports the ranks
        try:
            _, stderr = job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            job.kill()
            _, stderr = job.communicate()
        signal_all(ranks, signal.SIGKILL)
    if failure:
        raise AssertionError(f"{failure}\n{failure_report(stderr, logs)}")
    return torch.load(out, weights_only=False)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux: read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended already
            os.kill(pid, sig)


def failure_report(torchrun_stderr: str, logs: Path) -> str:
    """torchrun's summary of the failed ranks, then each rank's stderr from its traceback or
    faulthandler report on (the last lines where it has neither)."""
    start = torchrun_stderr.rfind("Failures:")
    if start >= 0:
        wanted = ("Failures:", "Root Cause", "rank ", "exitcode", "Signal")
        lines = torchrun_stderr[start:].splitlines()
        parts = ["torchrun:\n" + "\n".join(line for line in lines if any(w in line for w in wanted))]
    else:
        parts = ["torchrun's stderr (end):\n" + torchrun_stderr[-3000:]]
    for stderr_log in sorted(logs.glob("*/attempt_*/*/stderr.log")):
        rank = stderr_log.parent.name
        text = stderr_log.read_text(errors="replace")
        starts = [i for i in (text.find(s) for s in FAILURE_STARTS) if i >= 0]
        excerpt = text[text.rfind("\n", 0, min(starts)) + 1 :] if starts else text[-1500:] or "(empty)"
        if len(excerpt) > 6000:
            excerpt = "...\n" + excerpt[-6000:]
        parts.append(f"--- rank {rank} stderr{'' if starts else ' (end)'} ---\n{excerpt}")
        stdout = (stderr_log.parent / "stdout.log").read_text(errors="replace")
        if stdout.strip() and not starts:
            parts.append(f"--- rank {rank} stdout (end) ---\n{stdout[-1000:]}")
    if len(parts) == 1:
        parts.append(f"(no rank logs under {logs})")
    return "\n".join(parts)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different


def assert_resumed_exactly(run, resumed) -> None:
    """``run``: (losses of steps 0-3, snapshot); ``resumed``: from the step-2 checkpoint on."""
    losses, snapshot = run
    resumed_losses, resumed_snapshot = resumed
    assert resumed_losses[-2:] == losses[2:]
    assert_same(snapshot, resumed_snapshot)


def test_accelerate_fsdp2_optimizer_built_before_or_after_prepare(tmp_path):
    result = torchrun("accelerate_fsdp2.py", tmp_path)
    before, after = result["before"], result["after"]
    assert before[2] and after[2]  # Muon matrices exchanged as FSDP shards
    assert before[0] == after[0]  # the parameter swap equals building after sharding, bitwise
    assert_same(before[1], after[1])
    for built in ("before", "after"):
        assert_resumed_exactly(result[built][:2], result[f"{built}-resumed"])
    overlapped = result["overlapped"]
    assert overlapped[3] > 0  # buckets started in backward, after the parameter swap
    assert overlapped[0] == before[0]
    assert_same(overlapped[1], before[1])


def test_transformers_trainer_fsdp2_with_route(tmp_path):
    result = torchrun("transformers_trainer.py", tmp_path)
    assert result["sharded"]
    routing = result["routing"]
    assert not routing["model.embed_tokens.weight"] and not routing["lm_head.weight"]
    assert routing["model.layers.0.mlp.up_proj.weight"] and not routing["model.norm.weight"]
    assert_resumed_exactly(
        (result["losses"], result["snapshot"]), (result["resumed_losses"], result["resumed_snapshot"])
    )


def test_lightning_fabric_and_trainer_model_parallel_strategy(tmp_path):
    result = torchrun("lightning_fsdp2.py", tmp_path)
    for route in ("fabric", "trainer"):
        assert_resumed_exactly(result[route], result[f"{route}-resumed"])
