"""The VLA recipe (``recipes.vla``): the pi0-shaped policy trains on 2 ranks with both optimizers
and both layouts, resumes bitwise, is routed as Muon intends, and a bad flag is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dmuon_fsdp import Routing
from recipes import episodes
from recipes.policy import Policy, preset
from recipes.vla import main, parse_args, train
from tests.support.spawn import run_ranks


def _args(run_dir: Path, cache: Path, *extra: str):
    return parse_args(
        [
            "--steps",
            "6",
            "--batch-size",
            "8",
            "--episodes",
            "40",
            "--eval-episodes",
            "4",
            "--val-every",
            "3",
            "--euler-steps",
            "2",
            "--run-dir",
            str(run_dir),
            "--cache-dir",
            str(cache),
            "--no-progress",
            *extra,
        ]  # fmt: skip
    )


def run_recipe(rank, world_size, run_dir, cache, extra):
    return train(_args(run_dir, cache, *extra))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "extra",
    [
        ["--optimizer", "dmuon", "--parallel", "ddp", "--dtype", "bfloat16"],
        ["--optimizer", "adamw", "--parallel", "fsdp"],
    ],
)
def test_trains_evaluates_and_resumes_bitwise(tmp_path, extra):
    cache = tmp_path / "cache"
    full = run_ranks(run_recipe, 2, tmp_path / "a", cache, [*extra, "--save-every", "3"])[0]
    logged = records(tmp_path / "a")
    assert [r["step"] for r in logged] == list(range(1, 7))
    assert [r["step"] for r in logged if "val_action_mse" in r] == [3, 6]
    assert all(torch.isfinite(torch.tensor([r["train_loss"], r["grad_norm"]])).all() for r in logged)
    summary = json.loads((tmp_path / "a/summary.json").read_text())
    assert 0.0 <= summary["success"] <= 1.0 and summary["success"] == full["success"]
    assert summary["eval_episodes"] == 4 and summary["world_size"] == 2
    assert (tmp_path / "a/rollouts.png").read_bytes()[:4] == b"\x89PNG"
    step3 = str(tmp_path / "a/checkpoints/step_0000003")
    resumed = run_ranks(run_recipe, 2, tmp_path / "b", cache, [*extra, "--resume", step3])[0]
    assert sorted(resumed["losses"]) == [4, 5, 6]
    for s in (4, 5, 6):
        assert resumed["losses"][s] == full["losses"][s]  # bitwise: draws come from (seed, step, rank)
    assert resumed["val"][6] == full["val"][6] and resumed["success"] == full["success"]


def test_routing_sends_input_and_output_layers_to_adamw():
    policy = Policy(preset("cpu-demo", vocab_size=episodes.vocab_size(), text_len=episodes.MAX_TOKENS))
    routing = Routing(policy, **policy.routing())
    muon = {route.name for route in routing.routes.values() if route.muon}
    assert muon and all(
        name.startswith(("vision.", "layers.", "projector.", "action_time_mlp")) for name in muon
    ), sorted(muon)
    for adamw in ("patch_embedding.weight", "state_proj.weight", "action_in_proj.weight"):
        assert adamw not in muon
    assert "action_out_proj.weight" not in muon and "embed_tokens.weight" not in muon
    assert "position" not in muon  # (1, patches, width): a one-row matrix goes to AdamW unnamed
    assert "layers.1.vlm.attn.k_proj.weight" in muon and "layers.1.vlm.mlp.up_proj.weight" not in {
        name for name, _ in policy.named_parameters()
    }  # the last joint layer's language stream only lends its keys and values


def test_a_bad_flag_is_one_line(tmp_path, capsys):
    assert main(["--eval-episodes", "0", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --eval-episodes must be at least 1 (got 0)"]
    assert not (tmp_path / "r").exists()
