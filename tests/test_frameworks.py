"""DMuonFSDP inside the trainers people use, each run as users run it: torchrun, 2 CPU ranks, a tiny
Llama from a config (scripts in tests/frameworks/). Every run must exit 0 after a normal
``destroy_process_group()`` and interpreter exit, with training and a checkpoint resume that match
exactly."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

HERE = os.path.join(os.path.dirname(__file__), "frameworks")


def torchrun(script: str, tmp_path) -> dict:
    """Run ``script`` on 2 ranks; its exit status must be 0 (a clean teardown and exit)."""
    out = str(tmp_path / "result.pt")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(HERE, script),
        out,
    ]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{script} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )
    return torch.load(out, weights_only=False)


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
