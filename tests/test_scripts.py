"""The benchmark scripts run end to end on a tiny configuration (speed is not asserted here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dmuon_fsdp.newton_schulz import newton_schulz, ns_segments, resolve_coefficients, segments_flops
from tests.support.reference import relative_error

ROOT = Path(__file__).resolve().parents[1]


def _run(module, *args):
    """``python -m benchmarks.<module> args`` from the repository root."""
    command = [sys.executable, "-m", f"benchmarks.{module}", *map(str, args)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command[1:])} exited {done.returncode}:\n{done.stderr[-4000:]}"


def test_bench_optimizer_reports_every_contender_and_plan_bytes(tmp_path):
    out = tmp_path / "optimizer.json"
    _run(
        "bench_optimizer",
        "--world-size",
        "2",
        "--preset",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--slow-steps",
        "1",
        "--out",
        out,
    )
    result = json.loads(out.read_text())
    assert set(result["contenders"]) == {
        "adamw",
        "adamw-fused",
        "torch-muon",
        "gather-muon",
        "dmuon",
        "dmuon-no-overlap",
        "dmuon-qk-clip",
        "dmuon-normuon",
    }
    for rank in result["dmuon_breakdown"]["ranks"]:
        assert rank["bytes_sent"] == rank["bytes_received"] == rank["bytes_bound"] > 0
        assert rank["floor_s"] > 0 and rank["seconds"]["newton_schulz"] > 0
    assert out.with_suffix(".png").stat().st_size > 0


def test_paper_step_predicts_dmuon_below_gather_all(tmp_path):
    out = tmp_path / "sim.json"
    _run("paper", "--models", "llama-1b", "--world-sizes", "8", "64", "--out", out)
    rows = json.loads(out.read_text())["results"]["llama-1b"]
    for row in rows:
        assert row["busiest_over_l2_bound"] >= 1 - 1e-9
        assert row["dmuon_ms"]["standard"] < row["gather_ms"]
        # llama-1b's MLP matrices (2048 x 8192) carry fewer flops in the Gram form, square ones the same
        assert row["dmuon_ms"]["auto"] < row["dmuon_ms"]["standard"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_paper_hsdp_deduplication_moves_less_than_repeating_ns_per_replica(tmp_path):
    out = tmp_path / "hsdp.json"
    _run(
        "paper",
        "--report",
        "hsdp",
        "--models",
        "gpt2-124m",
        "--meshes",
        "2x4",
        "4x2",
        "3x8",
        "--out",
        out,
    )
    result = json.loads(out.read_text())["results"]["gpt2-124m"]
    total = result["elements"] * 2 / 2**20  # all matrices, bf16, MiB
    # Job totals: per-replica minus ours = N (R - 1)(S - 2) / S elements, N = all matrices' size.
    for mesh, schemes in result["meshes"].items():
        replicas, shards = (int(n) for n in mesh.split("x"))
        ours, repeated, direct = schemes["DMuonFSDP"], schemes["per-replica"], schemes["direct return"]
        saved = total * (replicas - 1) * (shards - 2) / shards / (replicas * shards)
        assert abs((repeated["mean_mib"] - ours["mean_mib"]) - saved) < 1e-6 * total, mesh
        # the relay moves each piece across replicas once, as the direct return did
        assert abs(ours["mean_mib"] - direct["mean_mib"]) < 1e-9, "the same total bytes as the direct return"
        assert ours["ns_gflop"] <= repeated["ns_gflop"] / replicas * 1.1, (
            "NS spread over every replica's ranks"
        )


def test_paper_balance_is_near_the_lower_bound(tmp_path):
    out = tmp_path / "balance.json"
    _run(
        "paper",
        "--report",
        "balance",
        "--models",
        "gpt2-124m",
        "--world-sizes",
        "8",
        "16",
        "--out",
        out,
    )
    rows = json.loads(out.read_text())["results"]["gpt2-124m"]
    assert [r["world"] for r in rows] == [8, 16]
    assert all(1 - 1e-9 <= r["over_bound"] <= 1.05 and r["over_mean"] >= 1 - 1e-9 for r in rows)


def test_bench_host_counts_ops_and_host_reads(tmp_path):
    out = tmp_path / "host.json"
    _run("bench_host", "--cases", "w1", "fake64", "--steps", "5", "--warmup", "1", "--out", out)
    result = json.loads(out.read_text())
    for case in ("w1", "fake64"):
        dmuon, quiet = result[case]["dmuon"], result[case]["dmuon-nochecks"]
        assert dmuon["ops"] <= 150 and dmuon["host_reads"] == 1 and quiet["host_reads"] == 0, result[case]
        assert result[case]["params"] == 111


def test_bench_buckets_smaller_buckets_are_more_and_take_smaller_buffers(tmp_path):
    out = tmp_path / "buckets.json"
    _run("bench_buckets", "--preset", "tiny", "--world-size", "4", "--mib", "0.004", "1", "--out", out)
    small, large = json.loads(out.read_text())
    assert (small["bucket_mib"], large["bucket_mib"]) == (0.004, 1)
    assert small["buckets"] > large["buckets"] == 1, (small, large)
    assert 0 < small["buffer_bytes"] < large["buffer_bytes"], (small, large)
    assert small["muon_shard_bytes"] == large["muon_shard_bytes"] > 0


def test_bench_ns_forms_times_both_forms_per_shape_and_the_step(tmp_path):
    out = tmp_path / "forms.json"
    _run("bench_ns_forms", "--presets", "tiny", "--repeats", "1", "--out", out)
    rows = json.loads(out.read_text())["rows"]
    assert {tuple(r["shape"]) for r in rows} == {(32, 32), (16, 32), (32, 64)}  # tiny: square, k/v, MLP
    for r in rows:
        s, l = r["shape"]
        for form in ("standard", "gram"):
            assert r["flops"][form] == r["batch"] * segments_flops(s, l, r["segments"][form])
            assert r["seconds"][form] > 0
        assert r["auto"] == (r["flops"]["gram"] < r["flops"]["standard"])
    step = tmp_path / "step.json"
    _run(
        "bench_ns_forms",
        "--step",
        "--preset",
        "tiny",
        "--world-size",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--out",
        step,
    )
    result = json.loads(step.read_text())
    assert result["auto"]["busiest_ns_flops"] < result["standard"]["busiest_ns_flops"]


def test_ns_accuracy_reads_a_checkpoints_momentum(tmp_path):
    gen = torch.Generator().manual_seed(0)
    low_rank = torch.randn(24, 3, generator=gen) @ torch.randn(3, 40, generator=gen)
    state = {"optimizers": [{"state": {"w": {"momentum_buffer": low_rank}, "v": {"exp_avg": torch.ones(5)}}}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "step_0000001"), no_dist=True)
    out = tmp_path / "accuracy.json"
    _run("ns_accuracy", tmp_path / "step_0000001", "--dtypes", "float32", "--out", out)
    rows = json.loads(out.read_text())["table"]
    assert [(r["coefficients"], r["shape"]) for r in rows] == [
        ("muon", [24, 40]),
        ("polar_express", [24, 40]),
    ]
    for r in rows:  # the errors newton_schulz gives, in each form, against float64
        coefficients = resolve_coefficients(r["coefficients"], 5)
        expected = newton_schulz(low_rank.double(), coefficients, 1e-7, torch.float64)
        for form in ("standard", "gram"):
            got = newton_schulz(low_rank, coefficients, 1e-7, torch.float32, form)
            assert r[form] == pytest.approx(relative_error(got, expected), rel=1e-6)
        assert tuple(r["segments"]) == ns_segments("gram", coefficients, torch.float32, 24, 40)
    _run("ns_accuracy", tmp_path / "step_0000001", "--search", "3", "--dtypes", "float32", "--out", out)
    search = json.loads(out.read_text())["search"]
    assert sorted(tuple(r["segments"]) for r in search if r["coefficients"] == "muon") == sorted(
        [(3,), (1, 2), (2, 1), (1, 1, 1)]
    )
    command = [sys.executable, "-m", "benchmarks.ns_accuracy", str(tmp_path)]
    failed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert (
        failed.returncode != 0
        and f"error: {tmp_path} is not a complete checkpoint (no .metadata)" in failed.stderr
    )


def test_the_demo_sets_up_only_what_it_runs():
    """scripts/demo.sh installs the package with its `recipes` extra; the demo's three commands
    (pretrain, report with its figure, sample) import with nothing else present (distributions
    outside torch, that extra and what they require are hidden), and the test-only stack
    (trainers, TensorBoard, pytest, the scale extra) is not among those."""
    from importlib import metadata

    import tomllib

    assert "bash scripts/setup_env.sh recipes " in (ROOT / "scripts/demo.sh").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def name(requirement: str) -> str:  # "mpmath<1.4,>=1.1.0; extra == 'x'" -> "mpmath"
        return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")

    def closure(names: list[str]) -> set[str]:
        """The distributions these require, transitively (as installed here; extras not taken)."""
        seen, todo = set(), list(names)
        while todo:
            dist = todo.pop()
            if dist in seen:
                continue
            seen.add(dist)
            try:
                requires = metadata.requires(dist) or []
            except metadata.PackageNotFoundError:
                continue
            todo += [name(r) for r in requires if "extra ==" not in r]
        return seen

    demo = closure(["torch", *map(name, extras["recipes"])])
    assert (
        not {"transformers", "lightning", "accelerate", "tensorboard", "pytest", "torchtitan", "torchao"}
        & demo
    )
    # The demo's imports, with every distribution its set-up would not install hidden (as absent:
    # torch imports some, such as triton, when they are present): they must import all the same.
    owners = metadata.packages_distributions()
    allowed = demo | {"dmuon-fsdp"}
    hidden = sorted(m for m, ds in owners.items() if not {d.lower().replace("_", "-") for d in ds} & allowed)
    script = (
        "import sys, json, importlib.abc\n"
        f"HIDDEN = set({hidden!r})\n"
        "class Hide(importlib.abc.MetaPathFinder):  # each finder, finding no hidden module\n"
        "    def __init__(self, inner):\n"
        "        self.inner = inner\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in HIDDEN or not hasattr(self.inner, 'find_spec'):\n"
        "            return None\n"
        "        return self.inner.find_spec(name, path, target)\n"
        "    def invalidate_caches(self):\n"
        "        getattr(self.inner, 'invalidate_caches', lambda: None)()\n"
        "sys.meta_path[:] = [Hide(f) for f in sys.meta_path]\n"
        "import recipes.pretrain, recipes.report, recipes.sample\n"
        "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"the demo imports what its set-up does not install:\n{done.stderr[-3000:]}"
    imported = {d.lower().replace("_", "-") for m in json.loads(done.stdout) for d in owners.get(m, [])}
    assert imported - allowed == set()


def test_paper_e2e_spreads_buckets_and_the_overlap_never_costs_more(tmp_path):
    out = tmp_path / "e2e.json"
    meshes = ("--world-sizes", "8", "64", "256", "--meshes", "8x8")
    _run("paper", "--report", "e2e", "--models", "llama3-8b", *meshes, "--out", out)
    for row in json.loads(out.read_text())["results"]["llama3-8b"]:
        plain, overlap = row["plain_pipelined"], row["overlap"]
        assert overlap["step_ms"] <= plain["step_ms"] + 1e-9
        assert plain["exposed_ms"] >= row["busiest_ns_ms"] + row["elementwise_ms"] - 1e-9
        # no schedule of one owner per matrix beats the bound; every bucket spread over all
        # owners: at most a few percent above the busiest rank's NS
        assert overlap["exposed_ms"] >= row["one_owner_bound_ms"] - 1e-6
        if row["mesh"].startswith("1x"):
            assert plain["exposed_ms"] < 1.2 * (row["busiest_ns_ms"] + row["elementwise_ms"]) + 10
        else:  # HSDP: every rank sends about as much, and across nodes no more than it must
            assert row["sent_max_gib"] <= 1.15 * row["sent_mean_gib"]
            assert row["far_least_gib"] - 1e-9 <= row["far_mean_gib"] <= 1.1 * row["far_least_gib"]
        if row["world"] == 256:  # 224 matrices: one each, in one bucket
            assert row["buckets"] == 1


def test_paper_embodied_predicts_each_vla_on_ddp_fsdp_and_hsdp_against_adamw(tmp_path):
    out = tmp_path / "embodied.json"
    _run("paper", "--report", "embodied", "--meshes", "16x1", "1x16", "2x8", "--out", out)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"pi0", "wall-oss"}
    for model in results.values():
        assert model["measured"]["dmuon_ms"] > model["measured"]["adamw_ms"]
        rows = {row["mesh"]: row for row in model["rows"]}
        assert set(rows) == {"16x1", "1x16", "2x8"}
        for row in rows.values():  # Muon's step costs more than AdamW's; the overlap never more
            assert row["plain_pipelined"]["step_ms"] > row["adamw_ms"]
            assert row["overlap"]["step_ms"] <= row["plain_pipelined"]["step_ms"] + 1e-9
            assert row["far_mean_gib"] >= row["far_least_gib"] - 1e-9
        # replicated layouts relay (overlap_forward leaves the relays to the next forward), which
        # under DDP, a replica a rank, hides most of them
        assert "overlap_forward" in rows["2x8"] and "overlap_forward" not in rows["1x16"]
        assert rows["16x1"]["overlap_forward"]["step_ms"] < rows["16x1"]["plain_pipelined"]["step_ms"]


def test_emulate_scale_reports_the_step_against_the_floor_one_bucket_and_a_fast_link(tmp_path):
    out = tmp_path / "emulate.json"
    _run(
        "emulate_scale",
        *("--world-sizes", "2", "--layers", "2", "--deeper", "2", "--steps", "1", "--warmup", "1"),
        *("--rounds", "1", "--dilation", "1", "--fast-link", "1e6", "--out", out),
    )
    results = json.loads(out.read_text())["results"]
    default, one, plain = results["W=2 default"], results["W=2 one"], results["W=2 plain cut"]
    fast = results["W=2 default fast"]
    assert default["floor_s"] > 0 and default["step_s"] >= default["floor_s"] * 0.99
    # no schedule with one owner per matrix beats its bound, which is at least the NS floor
    assert default["bound_s"] >= default["floor_s"] * 0.99 and default["step_s"] >= default["bound_s"] * 0.99
    assert one["buckets"] == 1 and default["buckets"] >= 1 and plain["buckets"] >= 1
    assert default["buffer_bytes"] > 0 and default["deeper_buffer_bytes"] > 0
    # the link's busy time scales with its speed; the fast link leaves the NS floor and host work
    assert default["link_busy_s"] > 1e5 * fast["link_busy_s"] > 0 and fast["step_s"] >= fast["floor_s"] * 0.99


def test_paper_moe_plans_every_expert_matrix_on_its_own(tmp_path):
    out = tmp_path / "moe.json"
    report = ("--report", "moe", "--moe-models", "mixtral-8x7b", "--moe-layers", "2")
    _run("paper", *report, "--world-sizes", "16", "64", "--out", out)
    result = json.loads(out.read_text())["results"]["mixtral-8x7b"]
    assert [(r["world"], r["ep"], r["efsdp"]) for r in result["rows"]] == [(16, 8, 2), (64, 8, 8)]
    for r in result["rows"]:
        # per layer: q, k, v, o, the router and 8 experts' three matrices
        assert r["matrices"] == 2 * (5 + 3 * 8) and r["expert_matrices"] == 2 * 3 * 8
        assert r["busiest_over_l2_bound"] >= 1 - 1e-9 and r["max_mib"] >= r["mean_mib"] > 0
