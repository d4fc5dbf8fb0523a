"""recipes.report on hand-written run directories; recipes.sample on a tiny saved model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from recipes import report, sample
from recipes.model import Transformer, preset

# dcp.save in a single process warns that it assumes a single process, as intended here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def one_thread():
    # A tiny model's forward is ~1 ms on one thread and many times slower on a busy machine's cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_run(run_dir: Path, optimizer: str, lr: float, steps: int, done: int, finished: bool) -> None:
    run_dir.mkdir(parents=True)
    config = {
        "run_id": run_dir.name,
        "created": "2025-01-01T00:00:00+00:00",
        "world_size": 2,
        "args": {"preset": "tiny", "optimizer": optimizer, "lr": lr, "steps": steps},
        "data": "python stdlib source, 12 files",
        "loss_unit": "nats per byte",
        "tokens_per_step": 256,
        "model": {},
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    records = [
        {
            "step": s,
            "train_loss": 5.0 / s,
            "grad_norm": 1.0,
            "lr": lr,
            "tokens_per_s": 1e4,
            "fwd_bwd_ms": 10.0,
            "opt_ms": 2.0 + (s > 5),
            "time_s": 0.5 * s,
            "peak_memory_mb": 100.0 + s,
        }
        for s in range(1, done + 1)
    ]
    for r in records[4::5]:
        r["val_loss"] = 4.0 / r["step"]
    lines = [json.dumps(r) + "\n" for r in records]
    partial = "" if finished else '{"step": 9'  # a line being written while the report reads
    (run_dir / "metrics.jsonl").write_text("".join(lines) + partial)
    if finished:
        summary = {
            "name": run_dir.name,
            "optimizer": optimizer,
            "preset": "tiny",
            "world_size": 2,
            "steps": steps,
            "lr": lr,
            "final_val_loss": 0.4,
            "median_step_ms": 12.5,
            "optimizer_share": 0.25,
            "peak_memory_mb": [110.0, 120.0],
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_report_finds_runs_at_any_depth(tmp_path, capsys):
    write_run(tmp_path / "a", "dmuon", 0.01, 10, 10, finished=True)
    write_run(tmp_path / "sweep/lr/b", "adamw", 0.003, 20, 8, finished=False)
    (tmp_path / "not_a_run").mkdir()
    (tmp_path / "not_a_run/metrics.jsonl").write_text("")
    assert report.main([str(tmp_path)]) == 0
    rows = (tmp_path / "summary.md").read_text().splitlines()
    assert len(rows) == 4 and rows[0].startswith("| run | optimizer | lr | ranks | steps |")
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]
    assert cells[0] == [
        "a",
        "dmuon",
        "0.01",
        "2",
        "10",
        "0.4000",
        "12.5",
        "25.0%",
        "110, 120",
        "python stdlib source, 12 files",
        "nats per byte",
    ]
    assert cells[1] == [
        "sweep/lr/b",
        "adamw",
        "0.003",
        "2",
        "8/20 (unfinished)",
        "0.8000",
        "13.0",
        "23.1%",
        "108",
        "python stdlib source, 12 files",
        "nats per byte",
    ]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "sweep/lr/b" in out and str(tmp_path / "summary.md") in out and str(tmp_path / "loss.png") in out


def test_report_on_a_run_directory_and_label_clashes(tmp_path):
    write_run(tmp_path / "x/run", "dmuon", 0.01, 10, 10, finished=True)
    write_run(tmp_path / "y/run", "dmuon", 0.01, 10, 10, finished=True)
    assert report.main([str(tmp_path / "x/run")]) == 0
    assert "| run | dmuon |" in (tmp_path / "x/run/summary.md").read_text()
    runs = report.find_runs(tmp_path)
    assert report.labels(runs) == ["dmuon lr=0.01 (x/run)", "dmuon lr=0.01 (y/run)"]
    assert report.title(runs) == (
        "preset tiny; 2 ranks; data: python stdlib source, 12 files; 256 tokens per step"
    )


def test_report_without_runs_fails(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no runs (directories with config.json and metrics.jsonl) under {tmp_path}" in err
    assert not (tmp_path / "summary.md").exists()


def save_tiny_run(run_dir: Path, byte_level: bool, **overrides) -> Transformer:
    """A run directory with config.json and one checkpoint of a tiny model, written in one process
    the way recipes/checkpoint.py saves (model state under "model")."""
    torch.manual_seed(0)
    cfg = preset("tiny", **overrides)
    model = Transformer(cfg).eval()
    state = {"model": model.state_dict(), "step": 3}
    dcp.save(state, checkpoint_id=run_dir / "checkpoints/step_0000003", no_dist=True)
    config = {
        "world_size": 1,
        "args": {},
        "data": "test",
        "tokens_per_step": 8,
        "loss_unit": "nats per byte" if byte_level else "nats per token",
        "model": dataclasses.asdict(cfg),
    }
    (run_dir / "config.json").write_text(json.dumps(config))
    return model


@torch.no_grad()
def greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    for _ in range(n):
        window = torch.tensor([ids[-model.cfg.seq_len :]])
        ids = ids + [int(model(window)[0, -1].argmax())]
    return ids


def run_sample(capsys, *argv: str) -> str:
    assert sample.main(list(argv)) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_sample_text_is_seeded_and_greedy_matches_the_weights(tmp_path, capsys):
    model = save_tiny_run(tmp_path, byte_level=True)
    args = ("--run-dir", str(tmp_path), "--prompt", "def ", "--tokens", "40")  # more than seq_len 32
    first = run_sample(capsys, *args, "--seed", "1")
    assert first.startswith("def ")
    assert run_sample(capsys, *args, "--seed", "1") == first
    assert run_sample(capsys, *args, "--seed", "2") != first
    expected = bytes(greedy(model, list(b"def "), 40)).decode("utf-8", errors="replace")
    assert run_sample(capsys, *args, "--temperature", "0") == expected


def test_sample_token_ids_with_tied_embeddings(tmp_path, capsys):
    model = save_tiny_run(tmp_path, byte_level=False, vocab_size=300, tie_embeddings=True)
    out = run_sample(
        capsys, "--run-dir", str(tmp_path), "--prompt-ids", "1,299,7", "--tokens", "35", "--temperature", "0"
    )
    ids = [int(i) for i in out.split(",")]
    assert len(ids) == 3 + 35 and ids == greedy(model, [1, 299, 7], 35)
    sampled = run_sample(
        capsys, "--run-dir", str(tmp_path), "--prompt-ids", "5", "--tokens", "12", "--top-k", "3"
    )
    assert len(sampled.split(",")) == 13


ERRORS = {  # case -> the message; RUN stands for the run directory
    "no dir": "--run-dir RUN: no such directory",
    "no config": "--run-dir RUN: no config.json",
    "no checkpoint": "no complete checkpoint (step_*/.metadata) under RUN/checkpoints",
    "incomplete": "--checkpoint RUN/checkpoints/step_0000003: not a complete checkpoint",
    "missing shard": "checkpoint RUN/checkpoints/step_0000003 could not be loaded: FileNotFoundError",
    "empty": "empty prompt",
    "token run": "--prompt: RUN/config.json is a token-file run (no tokenizer here); pass --prompt-ids",
}


@pytest.mark.parametrize("case", ERRORS)
def test_sample_errors_name_the_problem(tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints/step_0000003"
    argv = ["--run-dir", str(run_dir), "--prompt", "" if case == "empty" else "x"]
    if case != "no dir":
        run_dir.mkdir()
    if case not in ("no dir", "no config"):
        save_tiny_run(run_dir, byte_level=case != "token run")
    if case in ("no checkpoint", "incomplete"):
        (step / ".metadata").unlink()
    if case == "incomplete":
        argv += ["--checkpoint", str(step)]
    if case == "missing shard":
        (step / "__0_0.distcp").unlink()
    assert sample.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: ") and ERRORS[case].replace("RUN", str(run_dir)) in err
