"""The benchmark scripts run end to end on a tiny configuration (speed is not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, check=True, capture_output=True, text=True)


def test_bench_optimizer_reports_every_contender_and_plan_bytes(tmp_path):
    out = tmp_path / "optimizer.json"
    _run("scripts/bench_optimizer.py", "--world-size", "2", "--preset", "tiny", "--steps", "1", "--warmup", "0",
         "--slow-steps", "1", "--out", out)  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["contenders"]) == {"adamw", "adamw-fused", "torch-muon", "gather-muon", "dmuon", "dmuon-no-overlap"}
    for rank in result["dmuon_breakdown"]["ranks"]:
        assert rank["bytes_sent"] == rank["bytes_received"] == rank["bytes_bound"] > 0
        assert rank["floor_s"] > 0 and rank["seconds"]["newton_schulz"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_simulate_scale_predicts_dmuon_below_gather_all(tmp_path):
    out = tmp_path / "sim.json"
    _run("scripts/simulate_scale.py", "--models", "llama-1b", "--world-sizes", "8", "64", "--out", out)
    rows = json.loads(out.read_text())["results"]["llama-1b"]
    for row in rows:
        assert row["busiest_over_l2_bound"] >= 1 - 1e-9
        assert row["dmuon_ms"]["standard"] < row["gather_ms"]
        # llama-1b's MLP matrices (2048 x 8192) carry fewer flops in the Gram form, square ones the same
        assert row["dmuon_ms"]["auto"] < row["dmuon_ms"]["standard"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_hsdp_deduplication_moves_less_than_repeating_ns_per_replica():
    sys.path.insert(0, str(ROOT / "scripts"))
    from hsdp_bytes import compare
    from model_shapes import LLAMA_SHAPES

    # Job totals: per-replica minus ours = N (R - 1)(S - 2) / S elements, N = all matrices' size.
    for replicas, shards in [(2, 4), (4, 2), (3, 8)]:
        schemes = compare(LLAMA_SHAPES["gpt2-124m"], replicas, shards)
        ours, repeated, two_step = schemes["DMuonFSDP"], schemes["per-replica"], schemes["a2a + all-gather"]
        total = sum(r * c for r, c in LLAMA_SHAPES["gpt2-124m"]) * 2 / 2**20
        saved = total * (replicas - 1) * (shards - 2) / shards / (replicas * shards)
        assert abs((repeated[1] - ours[1]) - saved) < 1e-6 * total, (replicas, shards)
        assert abs(ours[1] - two_step[1]) < 1e-9, "the same total bytes as a2a + all-gather"
        assert ours[2] <= repeated[2] / replicas * 1.1, "NS spread over every replica's ranks"


def test_bench_host_counts_ops_and_host_reads(tmp_path):
    out = tmp_path / "host.json"
    _run("scripts/bench_host.py", "--cases", "w1", "fake64", "--steps", "5", "--warmup", "1", "--out", out)
    result = json.loads(out.read_text())
    for case in ("w1", "fake64"):
        dmuon, quiet = result[case]["dmuon"], result[case]["dmuon-nochecks"]
        assert dmuon["ops"] <= 150 and dmuon["host_reads"] == 1 and quiet["host_reads"] == 0, result[case]
        assert result[case]["params"] == 111
