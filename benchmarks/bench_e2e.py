"""End-to-end training step time (forward + backward + optimizer) of the recipe model.

Runs recipes.pretrain under torchrun for each optimizer and world size, one thread per rank,
then reports the median step time, DMuonFSDP's and torch-muon's overhead over AdamW, and the
analytic lower bound of DMuonFSDP's overhead: the busiest rank's Newton-Schulz flops divided by
this machine's matmul rate for those shapes (plain torch.bmm, measured in the same run).

    python -m benchmarks.bench_e2e --world-sizes 1 2 4 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.matmul_floor import bmm_seconds
from dmuon_fsdp import param_groups
from dmuon_fsdp._step.planner import build_plan
from instruments.plans import chunk_row_counts, newton_schulz_flops, rank_loads, row_sharded_layout
from recipes.model import PRESETS, ModelConfig, Transformer, preset

ROOT = Path(__file__).resolve().parents[1]

OPTIMIZERS = ["adamw", "torch-muon", "dmuon"]


def run(optimizer: str, world: int, args: argparse.Namespace) -> dict:
    run_dir = Path(args.out) / f"{optimizer}-w{world}"
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "recipes.pretrain",
        "--preset",
        args.preset,
        "--optimizer",
        optimizer,
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--val-every",
        str(10**9),
        "--val-batches",
        "1",
        "--threads",
        "1",
        "--no-progress",
        "--run-dir",
        str(run_dir),
        "--overwrite",
    ]
    subprocess.run(
        cmd,
        check=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return json.loads((run_dir / "summary.json").read_text())


def dmuon_ns_floor_ms(cfg: ModelConfig, world: int) -> tuple[float, float]:
    """(busiest rank's NS GFLOP, its bmm floor in ms) for the model's Muon matrices."""
    torch.set_num_threads(1)
    shapes = [tuple(p.shape) for _, p in param_groups(Transformer(cfg))[0]["params"]]
    layouts = [
        row_sharded_layout(str(i), r, c, chunk_row_counts(r, world)) for i, (r, c) in enumerate(shapes)
    ]
    plan = build_plan(layouts, [newton_schulz_flops(r, c, 5) for r, c in shapes], world, 128 * 2**20, 4)
    loads = rank_loads(plan)
    busiest = max(range(world), key=loads.__getitem__)
    floor = bmm_seconds(plan, busiest, torch.float32, torch.device("cpu"))
    return loads[busiest] / 1e9, floor * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16, help="global sequences per step")
    parser.add_argument("--out", default="runs/bench/e2e")
    parser.add_argument("--from-json", action="store_true", help="only re-print the report of an earlier run")
    args = parser.parse_args()
    cfg = preset(args.preset)
    out = Path(args.out, "e2e.json")
    if args.from_json:
        results = {int(w): r for w, r in json.loads(out.read_text()).items()}
    else:
        results = {}
        for world in args.world_sizes:
            summaries = {opt: run(opt, world, args) for opt in args.optimizers}
            gflop, floor_ms = dmuon_ns_floor_ms(cfg, world)
            results[world] = {"summaries": summaries, "busiest_ns_gflop": gflop, "ns_floor_ms": floor_ms}
        out.write_text(json.dumps(results, indent=2))
    report(results, cfg, args)
    print(f"\nJSON: {out}")


def report(results: dict, cfg: ModelConfig, args: argparse.Namespace) -> None:
    total_flops = sum(
        newton_schulz_flops(p.shape[0], p.shape[1], 5) for _, p in param_groups(Transformer(cfg))[0]["params"]
    )
    print(
        f"\n## End-to-end step, preset {args.preset}, global batch {args.batch_size} x {cfg.seq_len} tokens, "
        f"1 thread per rank, {args.steps} steps (median after 5)\n"
    )
    print(
        f"NS per step: {total_flops / 1e9:.2f} GFLOP in all. Forward+backward is the same work for every "
        "optimizer, so the overhead is measured on the optimizer phase: (optimizer ms - AdamW's optimizer "
        "ms) "
        "/ AdamW's step ms; the whole-step ratio is shown beside it.\n"
    )
    print(
        "| W | optimizer | step ms | optimizer ms | optimizer share | overhead vs AdamW | step / AdamW step "
        "| lower bound of the overhead (NS floor) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for world, r in sorted(results.items()):
        base = r["summaries"].get("adamw")
        for opt, s in r["summaries"].items():
            over = ratio = bound = "-"
            if base:
                over = f"{(s['median_opt_ms'] - base['median_opt_ms']) / base['median_step_ms']:+.1%}"
                ratio = f"{s['median_step_ms'] / base['median_step_ms']:.2f}x"
                if opt == "dmuon":
                    bound = f"{r['ns_floor_ms'] / base['median_step_ms']:+.1%} ({r['ns_floor_ms']:.1f} ms)"
            print(
                f"| {world} | {opt} | {s['median_step_ms']:.1f} | {s['median_opt_ms']:.1f} | "
                f"{s['optimizer_share']:.1%} | {over} | {ratio} | {bound} |"
            )


if __name__ == "__main__":
    main()
