"""The recipe on several nodes, played on this machine: two torchrun agents (--nnodes 2, one
rank each) meeting at a c10d rendezvous on 127.0.0.1, as docs/recipe.md ("Several nodes")
launches them on a cluster, then resumed the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--preset", "tiny", "--batch-size", "4", "--val-every", "4", "--val-batches", "1", "--no-progress"]


def recipe(cache: Path, run: Path, *extra: str) -> list[str]:
    return ["-m", "recipes.pretrain", *TINY, "--cache-dir", str(cache), "--run-dir", str(run), *extra]


def on_nodes(args: list[str], nodes: int) -> None:
    """One torchrun agent per node (one rank each), all started before any is waited on."""
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                str(nodes),
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "nodes-test",
                *args,
            ],
            cwd=ROOT,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(nodes)
    ]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(outputs)


def on_one_agent(args: list[str], ranks: int) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    done = subprocess.run([*command, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def logged(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_agents_with_a_c10d_rendezvous_train_and_resume_as_one_agent_of_two_ranks(tmp_path, cache):
    one, nodes = tmp_path / "one", tmp_path / "nodes"
    for run, launch in (
        (one, lambda args: on_one_agent(args, ranks=2)),
        (nodes, lambda args: on_nodes(args, 2)),
    ):
        launch(recipe(cache, run, "--steps", "4"))  # ends with a checkpoint
        launch(recipe(cache, run, "--steps", "8", "--resume", str(run)))

    assert json.loads((nodes / "config.json").read_text())["world_size"] == 2
    expected, got = logged(one), logged(nodes)
    assert [r["step"] for r in got] == list(range(1, 9))
    assert [r["train_loss"] for r in got] == [r["train_loss"] for r in expected]  # bitwise
    assert [r.get("val_loss") for r in got] == [r.get("val_loss") for r in expected]
    assert [r["step"] for r in got if "val_loss" in r] == [4, 8]
