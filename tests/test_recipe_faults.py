"""The recipe under faults: killed launchers, a second job, signals, failing and full disks, a
kill while metrics.jsonl is rewritten, and what it prints when nobody watches a terminal."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipes import checkpoint
from recipes.pretrain import main
from recipes.stop import SAME_REQUEST_S, STOPPED
from tests.support.torchrun import only_torchruns_report

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--preset", "tiny", "--batch-size", "4", "--val-every", "50", "--val-batches", "1", "--no-progress"]


def launch(run: Path, cache: Path, *extra: str, ranks: int = 0, **popen) -> subprocess.Popen:
    """The recipe in a subprocess: under torchrun with ``ranks`` ranks, or in one process."""
    launcher = (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks else []
    )
    command = [sys.executable, *launcher, "-m", "recipes.pretrain", *TINY, "--cache-dir", str(cache)]
    return subprocess.Popen(
        [*command, "--run-dir", str(run), *extra],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **popen,
    )


def steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line)["step"] for line in lines]


def wait_for_step(run: Path, step: int, job: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(steps_logged(run)) < step:
        assert job.poll() is None, job.communicate()[0]
        assert time.monotonic() < deadline, f"no step {step} in {timeout} s"
        time.sleep(0.1)


def processes_of(run: Path) -> list[int]:
    """The pids whose command line names ``run`` (the recipe's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(run) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return found


@pytest.fixture(autouse=True)
def no_job_left(tmp_path):
    """A test that fails midway leaves no recipe process running (torchrun's workers have
    sessions of their own)."""
    yield
    kill(processes_of(tmp_path))


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)


def test_a_usage_error_under_torchrun_is_its_line_and_torchruns_report(tmp_path, cache):
    # torchrun returns 1 whenever a rank fails; the rank's own status (2, bad input) is in its report.
    for bad, error in (
        (["--data", str(tmp_path / "nope.bin")], f"error: --data {tmp_path / 'nope.bin'}: no such file"),
        (
            ["--steps", "10", "--warmup", "50"],
            "error: --warmup 50 is longer than --steps 10: the lr would never reach its peak "
            "(pass a --warmup of at most --steps)",
        ),
    ):
        job = launch(tmp_path / "run", cache, *bad, ranks=2)
        out = job.communicate(timeout=120)[0]
        assert job.returncode == 1, out
        assert only_torchruns_report(out, status=2, error=error) in ([], [error]), out


def test_a_second_job_is_refused_while_orphans_train_and_takes_over_once_they_are_gone(tmp_path, cache):
    # SIGKILL of torchrun alone leaves its workers training (they run in their own sessions).
    run = tmp_path / "run"
    job = launch(run, cache, "--steps", "100000", "--save-every", "5", ranks=2)
    try:
        wait_for_step(run, 12, job)
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
        orphans = processes_of(run)
        assert len(orphans) == 2, "both workers outlive their launcher"
        holder = json.loads((run / ".lock").read_text())
        second = launch(run, cache, "--resume", "auto")
        out = second.communicate(timeout=120)[0]
        assert second.returncode == 2
        message = (
            f"error: --run-dir {run} is in use by another job (pid {holder['pid']} on {holder['host']} "
            f"since {holder['started']}); stop it or wait for it to end, or pick another --run-dir\n"
        )
        assert out == message
    finally:
        kill(processes_of(run))
    while processes_of(run):
        time.sleep(0.05)
    done = checkpoint.step_of(checkpoint.latest(run))
    third = launch(run, cache, "--resume", "auto", "--steps", str(done + 10))
    out = third.communicate(timeout=120)[0]
    assert third.returncode == 0, out
    assert f"taking over {run}/.lock from pid {holder['pid']} on {holder['host']}" in out, out
    assert steps_logged(run) == list(range(1, done + 11)), "every step once, in order"
    assert not (run / ".lock").exists()


def test_sigterm_to_torchrun_finishes_the_step_saves_and_says_how_to_resume(tmp_path, cache):
    run = tmp_path / "run"
    job = launch(run, cache, "--steps", "100000", "--log-every", "1000", ranks=2)
    wait_for_step(run, 5, job)
    job.send_signal(signal.SIGTERM)
    out = job.communicate(timeout=120)[0]
    stopped = re.findall(
        r"stopped by SIGTERM after step (\d+) of 100000; checkpoint (\S+); resume with: (.*)", out
    )
    assert len(stopped) == 1, out
    step, saved, command = stopped[0]
    assert Path(saved) == run / f"checkpoints/step_{int(step):07d}" and (Path(saved) / ".metadata").is_file()
    assert command == f"torchrun --nproc-per-node 2 -m recipes.pretrain --resume {run}"
    assert steps_logged(run) == list(range(1, int(step) + 1)), "nothing lost: the checkpoint is the last step"
    # The one traceback is torchrun's own (it raises SignalException when signalled), none a worker's.
    assert out.count("Traceback (most recent call last)") == 1, out
    assert out.rstrip().endswith("got signal: 15"), out
    # The command it prints continues the run (here in one process: any world size resumes).
    resumed = launch(run, cache, "--resume", str(run), "--steps", str(int(step) + 2))
    out = resumed.communicate(timeout=120)[0]
    assert resumed.returncode == 0, out
    assert steps_logged(run) == list(range(1, int(step) + 3))


def test_sigint_in_one_process_exits_3_after_its_checkpoint(tmp_path, cache):
    run = tmp_path / "run"
    job = launch(run, cache, "--steps", "100000", "--save-every", "3", "--save-on-stop", "1000")
    wait_for_step(run, 7, job)
    job.send_signal(signal.SIGINT)
    out = job.communicate(timeout=120)[0]
    assert job.returncode == STOPPED, out
    step = steps_logged(run)[-1]
    newest = run / f"checkpoints/step_{step // 3 * 3:07d}"
    # --save-on-stop 1000: the newest checkpoint is recent enough, so none is added
    line = f"stopped by SIGINT after step {step} of 100000; checkpoint {newest}; resume with: "
    assert out.count("stopped by") == 1 and line + f"python -m recipes.pretrain --resume {run}\n" in out, out
    assert "Traceback" not in out and not (run / ".lock").exists()


def test_a_second_signal_exits_at_once_and_a_repeat_within_a_moment_does_not(tmp_path):
    script = (
        "import time\nfrom recipes.stop import StopSignals\n"
        "with StopSignals(loud=True) as stop:\n"
        "    print('ready', flush=True)\n"
        "    while stop.requested is None: time.sleep(0.01)\n"
        "    print('requested', stop.requested, flush=True)\n"
        "    time.sleep(60)\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert job.stdout.readline() == "ready\n"
    job.send_signal(signal.SIGTERM)
    assert job.stdout.readline() == "requested SIGTERM\n"
    job.send_signal(signal.SIGTERM)  # the same request, delivered twice (a launcher passing it on)
    time.sleep(SAME_REQUEST_S + 0.2)
    assert job.poll() is None
    job.send_signal(signal.SIGINT)
    assert job.wait(timeout=10) == -signal.SIGINT
    assert job.stderr.read() == "second signal (SIGINT): exiting now, without a checkpoint\n"


def under_a_file_size_limit(run: Path, cache: Path, limit: int, *extra: str) -> tuple[str, list[str]]:
    """A 2-rank run whose files may not grow past ``limit`` bytes (a write past it fails for
    real, EFBIG); its output and its ``error:`` lines."""
    job = launch(
        run,
        cache,
        *extra,
        ranks=2,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )
    out = job.communicate(timeout=180)[0]
    return out, [line for line in out.splitlines() if line.startswith("error:")]


def test_a_failed_save_is_one_line_on_every_rank_and_the_run_resumes(tmp_path, cache):
    # The checkpoint's shard must pass 64 KiB; both ranks stop with the same error, printed once.
    run = tmp_path / "run"
    out, errors = under_a_file_size_limit(run, cache, 64 * 1024, "--steps", "6", "--save-every", "3")
    assert errors == [
        f"error: checkpoint {run}/checkpoints/step_0000003 could not be saved: "
        "OSError: [Errno 27] File too large (rank 0)"
    ], out
    only_torchruns_report(out, status=1, error=errors[0])
    assert steps_logged(run) == [1, 2, 3], out
    assert not (run / "checkpoints/step_0000003/.metadata").exists(), out
    resumed = launch(run, cache, "--resume", "auto", "--save-every", "0")
    again = resumed.communicate(timeout=120)[0]
    assert resumed.returncode == 0 and "removing incomplete checkpoint" in again, out + again
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6], out + again


def test_a_failed_metrics_write_stops_every_rank_at_the_next_step(tmp_path, cache):
    # Rank 0 alone writes metrics.jsonl; past 4 KiB (about 13 lines) its write fails.
    run = tmp_path / "run"
    out, errors = under_a_file_size_limit(run, cache, 4096, "--steps", "100", "--no-save-final")
    assert errors == [f"error: could not write {run}/metrics.jsonl: File too large"], out
    only_torchruns_report(out, status=1, error=errors[0])
    assert 5 < len(steps_logged(run)) < 20


def in_a_small_filesystem(directory: Path, size_kib: int, script: str) -> subprocess.CompletedProcess:
    """Run a shell script with a tmpfs of ``size_kib`` mounted on ``directory``, in a private
    mount namespace (unshare: nothing to clean up, and no root needed where user namespaces are
    allowed). Skips where neither works."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) to mount a small file system")
    mount = f'mount -t tmpfs -o size={size_kib}k tmpfs "{directory}" || exit 99\n'
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount + script],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 99 or "unshare:" in done.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    return done


def recipe(cache: Path, run: Path, *extra: str) -> str:
    words = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        *TINY,
        "--cache-dir",
        str(cache),
        "--run-dir",
        str(run),
    ]
    return " ".join([*words, *extra])


def test_keep_last_needs_room_for_k_checkpoints_only(tmp_path, cache):
    # One checkpoint of the tiny model takes about 540 KiB: this disk holds two, not three.
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    done = in_a_small_filesystem(
        disk,
        1400,
        recipe(cache, run, "--steps", "8", "--save-every", "2", "--keep-last", "2")
        + "\necho status=$?; ls "
        + f"{run}/checkpoints",
    )
    out = done.stdout
    assert "status=0" in out, out + done.stderr
    assert out.splitlines()[-2:] == ["step_0000006", "step_0000008"], out
    first = (
        f"deleted checkpoint {run}/checkpoints/step_0000002 first (--keep-last 2: the disk is short of room)"
    )
    assert first in out, out


def test_a_read_only_checkpoint_dir_is_found_before_training(tmp_path, cache):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    checkpoints = run / "checkpoints"
    script = "\n".join(
        [
            recipe(cache, run, "--steps", "2", "--save-every", "2") + " > /dev/null || exit 98",
            f'mount --bind "{checkpoints}" "{checkpoints}" || exit 99',
            f'mount -o remount,ro,bind "{checkpoints}" || exit 99',
            recipe(cache, run, "--steps", "6", "--resume", str(run)),
            "echo status=$?",
            f'wc -l < "{run}/metrics.jsonl"',
        ]
    )
    done = in_a_small_filesystem(disk, 4096, script)
    error = f"error: --run-dir {run}: cannot write {checkpoints}/.write-test: Read-only file system"
    assert done.stderr.strip() == error, done.stdout + done.stderr
    assert done.stdout.splitlines()[-2:] == ["status=2", "2"], "found before any step"


def test_a_kill_while_metrics_are_rewritten_loses_no_line(tmp_path, cache, monkeypatch):
    run = tmp_path / "run"
    common = [*TINY, "--cache-dir", str(cache), "--run-dir", str(run), "--steps", "6", "--save-every", "2"]
    assert main(common) == 0
    (run / "checkpoints/step_0000006/.metadata").unlink()  # resume from step 4: metrics cut back
    before = (run / "metrics.jsonl").read_text()

    class Killed(BaseException):
        pass

    write_text = Path.write_text

    def dies_halfway(path, text, *args, **kwargs):  # as a kill in the middle of a write
        write_text(path, text[: len(text) // 2], *args, **kwargs)
        raise Killed

    monkeypatch.setattr(Path, "write_text", dies_halfway)
    with pytest.raises(Killed):
        main([*common, "--resume", str(run)])
    monkeypatch.undo()
    assert (run / "metrics.jsonl").read_text() == before
    assert main([*common, "--resume", str(run)]) == 0
    assert steps_logged(run) == [1, 2, 3, 4, 5, 6]


def test_plain_log_lines_when_not_a_terminal_and_a_final_checkpoint_by_default(tmp_path, cache, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                *TINY[:-1],
                "--cache-dir",
                str(cache),
                "--run-dir",
                str(run),
                "--steps",
                "4",
                "--val-every",
                "2",
                "--log-every",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "\r" not in out
    records = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 3/4", "step 4/4"], out
    for line in lines:
        record = records[int(line.split("/")[0].removeprefix("step "))]
        assert f"loss {record['train_loss']:.4f}" in line and f"lr {record['lr']:.4g}" in line
        assert f"adamw lr {record['adamw_lr']:.4g}" in line and f"grad norm {record['grad_norm']:.3f}" in line
        assert ("val loss" in line) == ("val_loss" in record)
    final = run / "checkpoints/step_0000004"
    assert (final / ".metadata").is_file() and out.rstrip().endswith(f"; weights in {final}")
    assert json.loads((run / "summary.json").read_text())["checkpoint"] == str(final)
    other = tmp_path / "unsaved"
    assert (
        main([*TINY, "--cache-dir", str(cache), "--run-dir", str(other), "--steps", "2", "--no-save-final"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.rstrip().endswith("; the final weights were not saved (--no-save-final)")
    assert not (other / "checkpoints").exists()
