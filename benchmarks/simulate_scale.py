"""DMuonFSDP at scale, on paper: the planner alone, no processes.

For real model shape tables and world sizes up to 1024, prints the NS load balance, the bytes each
rank sends per step and a predicted optimizer-step time for DMuonFSDP, gather-all ("vanilla")
Muon and AdamW, and plots step time against W.

The model (per rank, per optimizer step; matrices only: embeddings, head and vectors are left
out, they cost the same under every optimizer):
- Newton-Schulz time = NS flops on the rank / (peak bf16 TFLOP/s x --ns-efficiency).
  DMuonFSDP: the busiest rank's owned matrices, each in the form ``ns_algorithm`` picks for it in
  bf16 (one plan per --ns-algorithms entry: "auto" runs Gram Newton-Schulz where it needs fewer
  flops, with its restarts; the same efficiency is assumed for both forms); gather-all: every
  matrix on every rank, standard form.
- Exchange time = bytes sent / --link-gbs (links are full duplex; sent = received here).
  DMuonFSDP: the plan's bytes for the busiest sender (bf16 shards to owners and rows back);
  gather-all: an all-gather of every matrix, (W-1)/W of all matrix bytes.
- Element-wise time = 28 bytes of optimizer-state traffic per local parameter / --hbm-gbs
  (AdamW: read p, g, m, v, write p, m, v in fp32; Muon momentum + update moves about as much).
- Step = element-wise + NS + exchange, with no credit for overlapping exchange and NS
  (DMuonFSDP overlaps them, so its real time is lower, down to element-wise + max of the two).
GPU defaults: H100 (989 bf16 TFLOP/s dense, 3350 GB/s HBM) and H200 (989, 4800), 50 GB/s of
network per GPU (400 Gb/s), NS at 50% of peak.

    python scripts/simulate_scale.py --gpu h200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), os.path.dirname(__file__)]

import torch  # noqa: E402

from dmuon_fsdp.layouts import MatrixLayout, chunk_row_counts  # noqa: E402
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, NS_ALGORITHMS, ns_segments, resolve_coefficients  # noqa: E402
from dmuon_fsdp.planner import assignment_lower_bound, build_plan, makespan_lower_bound  # noqa: E402
from model_shapes import LLAMA_SHAPES, MOE_SHAPES  # noqa: E402

GPUS = {"h100": {"tflops": 989.0, "hbm_gbs": 3350.0}, "h200": {"tflops": 989.0, "hbm_gbs": 4800.0}}
MODELS = {"llama-1b": LLAMA_SHAPES["llama-1b"], "llama3-8b": LLAMA_SHAPES["llama3-8b"],
          "llama3-70b": LLAMA_SHAPES["llama3-70b"], **MOE_SHAPES}  # fmt: skip
STATE_BYTES_PER_PARAM = 28
WIRE_BYTES = 2  # bf16


def layouts_for(shapes: list[tuple[int, int]], world: int, algorithm: str, ns_steps: int) -> list[MatrixLayout]:
    coefficients = resolve_coefficients(MUON_COEFFICIENTS, ns_steps)
    return [MatrixLayout.row_sharded(str(i), r, c, chunk_row_counts(r, world),
                                     ns_segments(algorithm, coefficients, torch.bfloat16, r, c))
            for i, (r, c) in enumerate(shapes)]  # fmt: skip


def simulate(shapes: list[tuple[int, int]], world: int, args: argparse.Namespace) -> dict:
    """A DMuonFSDP step time per --ns-algorithms entry; balance and bytes of the first one's plan."""
    rate = args.tflops * 1e12 * args.ns_efficiency
    link = args.link_gbs * 1e9
    params = sum(r * c for r, c in shapes)
    elementwise = params / world * STATE_BYTES_PER_PARAM / (args.hbm_gbs * 1e9)
    standard = [m.cost for m in layouts_for(shapes, world, "standard", args.ns_steps)]
    gather = elementwise + sum(standard) / rate + params * WIRE_BYTES * (world - 1) / world / link
    row: dict = {"world": world, "matrices": len(shapes), "params": params, "gather_ms": gather * 1e3,
                 "adamw_ms": elementwise * 1e3, "dmuon_ms": {}}  # fmt: skip
    for algorithm in args.ns_algorithms:
        layouts = layouts_for(shapes, world, algorithm, args.ns_steps)
        plan = build_plan(layouts, world, args.bucket_mib * 2**20, WIRE_BYTES)
        loads, costs = plan.loads(), [m.cost for m in layouts]
        sent = max(plan.elements_moved(r) for r in range(world)) * WIRE_BYTES
        row["dmuon_ms"][algorithm] = (elementwise + max(loads) / rate + sent / link) * 1e3
        if algorithm == args.ns_algorithms[0]:
            row.update(busiest_over_bound=max(loads) / assignment_lower_bound(costs, world),
                       busiest_over_l2_bound=max(loads) / makespan_lower_bound(costs, world),
                       max_over_mean=max(loads) * world / sum(loads), sent_mib=sent / 2**20)  # fmt: skip
    return row


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (model, rows) in enumerate(results.items()):
        color = f"C{i}"
        ws = [r["world"] for r in rows]
        for algorithm, marker in zip(rows[0]["dmuon_ms"], "os^"):
            ax.plot(ws, [r["dmuon_ms"][algorithm] for r in rows], f"-{marker}", color=color,
                    label=f"{model} DMuonFSDP {algorithm}")  # fmt: skip
        ax.plot(ws, [r["gather_ms"] for r in rows], "--", color=color, label=f"{model} gather-all Muon")
        ax.plot(ws, [r["adamw_ms"] for r in rows], ":", color=color, label=f"{model} AdamW")
    ax.set(xscale="log", yscale="log", xlabel="world size W", ylabel="predicted optimizer step (ms)", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: the GPU's)")
    parser.add_argument("--hbm-gbs", type=float, default=None, help="memory bandwidth GB/s (default: the GPU's)")
    parser.add_argument("--link-gbs", type=float, default=50.0, help="network GB/s per GPU, each direction")
    parser.add_argument("--ns-efficiency", type=float, default=0.5, help="achieved fraction of peak in NS")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--ns-algorithms", nargs="+", default=["standard", "auto"], choices=NS_ALGORITHMS,
                        help="DMuonFSDP's ns_algorithm, one predicted step per entry")  # fmt: skip
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out", default="runs/bench/simulate_scale.json")
    args = parser.parse_args()
    args.tflops = args.tflops or GPUS[args.gpu]["tflops"]
    args.hbm_gbs = args.hbm_gbs or GPUS[args.gpu]["hbm_gbs"]
    results = {m: [simulate(MODELS[m], w, args) for w in args.world_sizes] for m in args.models}
    title = (f"{args.gpu}: {args.tflops:g} TFLOP/s x {args.ns_efficiency:g}, {args.link_gbs:g} GB/s link, "
             f"{args.hbm_gbs:g} GB/s HBM")  # fmt: skip
    print(f"## Predicted optimizer step, {title}\n")
    algorithms, first = args.ns_algorithms, args.ns_algorithms[0]
    header = ["model", "W", "matrices", "busiest / bound", "busiest / L2 bound", "max / mean", "MiB sent per rank",
              *(f"DMuonFSDP {a} ms" for a in algorithms), "gather-all Muon ms", "AdamW ms",
              f"gather-all / DMuonFSDP {first}", *(f"{first} / {a}" for a in algorithms[1:])]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for model, rows in results.items():
        for r in rows:
            ms = r["dmuon_ms"]
            cells = [model, r["world"], r["matrices"], f"{r['busiest_over_bound']:.3f}", f"{r['busiest_over_l2_bound']:.3f}",
                     f"{r['max_over_mean']:.2f}", f"{r['sent_mib']:.0f}", *(f"{ms[a]:.1f}" for a in algorithms),
                     f"{r['gather_ms']:.1f}", f"{r['adamw_ms']:.2f}", f"{r['gather_ms'] / ms[first]:.1f}x",
                     *(f"{ms[first] / ms[a]:.2f}x" for a in algorithms[1:])]  # fmt: skip
            print("| " + " | ".join(map(str, cells)) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    plot(results, out.with_suffix(".png"), title)
    print(f"\nJSON: {out}\nplot: {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
