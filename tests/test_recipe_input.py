"""The recipe's bad input: one ``error:`` line, exit status 2, nothing written or changed."""

from __future__ import annotations

import array
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.model import PRESETS
from recipes.pretrain import main
from tests.support.torchrun import only_torchruns_report

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--preset", "tiny", "--batch-size", "4", "--val-every", "2", "--val-batches", "1", "--no-progress"]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its content hash (empty when root is missing)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A finished one-process run (python -m recipes.pretrain, no torchrun) with a complete
    checkpoint at step 2 and one whose save did not finish at step 4, plus token files."""
    root = tmp_path_factory.mktemp("recipe-input")
    cache = root / "cache"
    command = [
        sys.executable,
        "-m",
        "recipes.pretrain",
        *TINY,
        "--steps",
        "4",
        "--save-every",
        "2",
        "--run-dir",
        str(root / "used"),
        "--cache-dir",
        str(cache),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr
    config = json.loads((root / "used/config.json").read_text())
    assert config["world_size"] == 1 and config["args"]["preset"] == "tiny"
    (root / "used/checkpoints/step_0000004/.metadata").unlink()
    (root / "partial/checkpoints").mkdir(parents=True)
    shutil.copytree(root / "used/checkpoints/step_0000004", root / "partial/checkpoints/step_0000004")
    rng = random.Random(0)
    tokens = [rng.randrange(256) for _ in range(4000)]
    write_uint16(root / "high.bin", tokens[:1000] + [300] + tokens[1001:])
    (root / "val").mkdir()
    write_uint16(root / "val/train.bin", tokens)
    write_uint16(root / "val/val.bin", tokens[:7] + [999] + tokens[8:500])
    (root / "short.txt").write_bytes(bytes(tokens[:700]))  # 35 validation bytes
    (root / "empty.txt").write_bytes(b"")
    write_uint16(root / "few.bin", tokens[:30])
    (root / "prose.txt").write_text("Any text at all, read as uint16 tokens, makes ids past 256.\n" * 200)
    shutil.copytree(root / "used", root / "finished", ignore=shutil.ignore_patterns("checkpoints"))
    return root


def write_uint16(path: Path, ids: list[int]) -> None:
    """A nanoGPT token file (uint16, this machine's byte order, as the recipe reads it)."""
    path.write_bytes(array.array("H", ids).tobytes())


def cases(root: Path) -> dict[str, tuple[list[str], dict, str]]:
    """name -> (arguments, environment, the exact message)."""
    presets = ", ".join(f"'{name}'" for name in sorted(PRESETS))
    used = root / "used"
    return {
        "missing --data": (["--data", f"{root}/none.bin"], {}, f"--data {root}/none.bin: no such file"),
        "missing --text": (["--text", f"{root}/none.txt"], {}, f"--text {root}/none.txt: no such file"),
        "unknown preset": (
            ["--preset", "huge"],
            {},
            f"argument --preset: invalid choice: 'huge' (choose from {presets})",
        ),
        "batch vs ranks x accumulation": (
            ["--batch-size", "6", "--grad-accum", "2"],
            {"WORLD_SIZE": "2"},
            "--batch-size 6 must be divisible by ranks x --grad-accum (2 x 2 = 4)",
        ),
        "replicas": (
            ["--replicas", "3"],
            {"WORLD_SIZE": "2"},
            "--replicas 3 does not divide the world size 2",
        ),
        "--steps 0 in a used run dir": (
            ["--steps", "0", "--run-dir", str(used)],
            {},
            "--steps must be at least 1 (got 0)",
        ),
        "negative lr": (["--lr", "-0.01"], {}, "--lr must be positive (got -0.01)"),
        "negative AdamW lr": (["--adamw-lr", "-0.001"], {}, "--adamw-lr must be positive (got -0.001)"),
        "QK-clip threshold": (["--qk-clip", "0"], {}, "--qk-clip must be positive (got 0)"),
        "QK-clip alpha": (
            ["--qk-clip", "10", "--qk-clip-alpha", "1.5"],
            {},
            "--qk-clip-alpha must be between 0 and 1 (got 1.5)",
        ),
        "NS form for AdamW": (
            ["--optimizer", "adamw", "--ns-algorithm", "gram"],
            {},
            "--ns-algorithm applies to --optimizer dmuon only (got --optimizer adamw)",
        ),
        "NS dtype for AdamW": (
            ["--optimizer", "adamw", "--ns-dtype", "bfloat16"],
            {},
            "--ns-dtype applies to --optimizer dmuon only (got --optimizer adamw)",
        ),
        "MLP width": (["--ffn-dim", "0"], {}, "--ffn-dim must be at least 1 (got 0)"),
        "NorMuon for AdamW": (
            ["--optimizer", "adamw", "--variant", "normuon"],
            {},
            "--variant applies to --optimizer dmuon only (got --optimizer adamw)",
        ),
        "overlap for torch's Muon": (
            ["--optimizer", "torch-muon", "--overlap-backward"],
            {},
            "--overlap-backward applies to --optimizer dmuon only (got --optimizer torch-muon)",
        ),
        "empty buckets": (["--bucket-mib", "0"], {}, "--bucket-mib must be positive (got 0)"),
        "token beyond the vocabulary, training": (
            ["--data", f"{root}/high.bin"],
            {},
            f"training data {root}/high.bin (first 95%): token id 300 is outside the vocabulary of 256 "
            "(preset "
            "tiny); pass --vocab-size 301 or more",
        ),
        "token beyond the vocabulary, validation": (
            ["--data", f"{root}/val/train.bin"],
            {},
            f"validation data {root}/val/val.bin: token id 999 is outside the vocabulary of 256 (preset "
            "tiny); "
            "pass --vocab-size 1000 or more",
        ),
        "validation data shorter than its windows": (
            ["--text", f"{root}/short.txt", "--val-batches", "2"],
            {},
            f"validation data {root}/short.txt (last 5%): 35 tokens are too few for 8 windows of 33 "
            "(--val-batches 2); "
            "it needs 40: lower --val-batches or --batch-size",
        ),
        "empty --text": (["--text", f"{root}/empty.txt"], {}, f"--text {root}/empty.txt: the file is empty"),
        "empty --data": (["--data", f"{root}/empty.txt"], {}, f"--data {root}/empty.txt: the file is empty"),
        "text file as --data": (
            ["--data", f"{root}/prose.txt"],
            {},
            f"--data {root}/prose.txt: this is a text file, not uint16 tokens; pass it as --text "
            "(byte-level)",
        ),
        "--data too short": (
            ["--data", f"{root}/few.bin"],
            {},
            f"training data {root}/few.bin (first 95%): 28 tokens are too few for one window of "
            "--seq-len + 1 = 33",
        ),
        "resume auto of a finished run with no checkpoint": (
            ["--resume", "auto", "--run-dir", f"{root}/finished"],
            {},
            f"--resume auto: {root}/finished holds a finished run and no complete checkpoint to continue "
            "from; start "
            "a new --run-dir, or replace it with --overwrite (without --resume)",
        ),
        "resume a missing directory": (
            ["--resume", f"{root}/gone"],
            {},
            f"--resume {root}/gone: no such directory",
        ),
        "resume with no complete checkpoint": (
            ["--resume", f"{root}/partial"],
            {},
            f"--resume {root}/partial: no complete checkpoint under {root}/partial/checkpoints "
            "(only incomplete ones: step_0000004)",
        ),
        "resume an incomplete step": (
            ["--resume", f"{used}/checkpoints/step_0000004"],
            {},
            f"--resume {used}/checkpoints/step_0000004: incomplete checkpoint (no .metadata: its save did "
            "not finish)",
        ),
        "resume another preset's run": (
            ["--resume", str(used), "--run-dir", str(used), "--preset", "cpu-demo", "--steps", "6"],
            {},
            f"--resume {used}: {used}/checkpoints/step_0000002 differs from this run in preset tiny -> "
            "cpu-demo "
            "(earlier -> now); start a new --run-dir for other settings",
        ),
        "resume with another MLP width": (
            ["--resume", str(used), "--run-dir", str(used), "--ffn-dim", "48", "--steps", "6"],
            {},
            f"--resume {used}: {used}/checkpoints/step_0000002 differs from this run in ffn_dim 64 -> 48 "
            "(earlier -> now); start a new --run-dir for other settings",
        ),
        "new run into a used run dir": (
            ["--run-dir", str(used)],
            {},
            f"--run-dir {used} already holds a run (config.json, metrics.jsonl, summary.json, checkpoints): "
            f"continue it with --resume {used}, or pass --overwrite to delete it",
        ),
    }


CASE_NAMES = list(cases(Path("/x")))


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input_is_one_line_and_changes_nothing(workspace, name, monkeypatch, capsys):
    argv, env, message = cases(workspace)[name]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = tree_digest(workspace)
    fresh = workspace / "fresh-run"
    argv = [*TINY, "--cache-dir", str(workspace / "cache"), "--steps", "6", "--run-dir", str(fresh), *argv]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"error: {message}\n")
    assert tree_digest(workspace) == before, "bad input changed files"


def test_under_torchrun_a_rank_exits_2_and_its_line_is_all_the_recipe_prints(workspace):
    # Launched by path, as nanoGPT's users type it (the other torchrun tests launch the module).
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "recipes/pretrain.py",
        *TINY,
        "--batch-size",
        "3",
        "--cache-dir",
        str(workspace / "cache"),
        "--run-dir",
        str(workspace / "torchrun"),
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # torchrun's status whenever a rank fails
    message = "error: --batch-size 3 must be divisible by ranks x --grad-accum (2 x 1 = 2)"
    assert only_torchruns_report(output, status=2, error=message) in ([], [message])
    assert not (workspace / "torchrun").exists(), output


@pytest.mark.parametrize("script", ["pretrain", "sample", "report"])
def test_the_recipes_scripts_run_by_path_from_anywhere(script, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / f"{script}.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr


def test_a_corrupt_checkpoint_is_named_and_the_run_dir_left_as_it_was(workspace, capsys):
    run = workspace / "corrupt"
    shutil.copytree(workspace / "used", run)
    shard = run / "checkpoints/step_0000002/__0_0.distcp"
    shard.write_bytes(b"not a checkpoint" + shard.read_bytes()[16:])
    before = tree_digest(run)
    argv = [
        *TINY,
        "--cache-dir",
        str(workspace / "cache"),
        "--steps",
        "6",
        "--run-dir",
        str(run),
        "--resume",
        str(run),
    ]
    assert main(argv) == 1
    out, err = capsys.readouterr()
    prefix = f"error: checkpoint {run}/checkpoints/step_0000002 could not be loaded: "
    assert err.startswith(prefix) and err.endswith("(rank 0)\n") and err.count("\n") == 1, err
    assert tree_digest(run) == before


def test_a_resume_keeps_the_runs_settings_and_names_every_change(workspace, capsys):
    # The checkpoint restores the optimizer's and scheduler's hyperparameters; the flags given
    # again must win from the first resumed step on, and the flags not given again (here
    # --save-every, the schedule's shape, the preset) keep the run's own values.
    run = workspace / "relearn"
    schedule = ["--warmup", "0", "--decay", "linear", "--min-lr-ratio", "0", "--save-every", "2"]
    first = [*TINY, "--cache-dir", str(workspace / "cache"), "--run-dir", str(run), *schedule]
    assert main([*first, "--steps", "4", "--lr", "0.01"]) == 0
    capsys.readouterr()
    assert main(["--resume", str(run), "--steps", "8", "--lr", "0.05", "--no-progress"]) == 0
    out = capsys.readouterr().out
    # linear decay to 0 over 8 steps, at 0-based index 4: 0.05 * (1 - 4 / 8); the 4-step run's
    # schedule had reached 0
    note = "resuming with changed settings: --steps 4 -> 8, --lr 0.01 -> 0.05, the lr of step 5 is 0.025 (0 "
    assert note in out, out
    logged = {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert list(logged) == list(range(1, 9))
    assert logged[2] == pytest.approx(0.01 * (1 - 1 / 4))
    for step in range(5, 9):
        assert logged[step] == pytest.approx(0.05 * (1 - (step - 1) / 8)), logged
    saved = json.loads((run / "config.json").read_text())["args"]
    assert (saved["lr"], saved["steps"], saved["save_every"], saved["preset"]) == (0.05, 8, 2, "tiny")
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == [f"step_{n:07d}" for n in (2, 4, 6, 8)], "--save-every 2 kept after the resume"
