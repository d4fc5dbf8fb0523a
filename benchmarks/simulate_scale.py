"""DMuonFSDP at scale, on paper: the planner alone, no processes. Five reports; ``e2e`` and ``moe`` are
described in ``benchmarks.simulate_e2e`` and ``benchmarks.simulate_moe``:

``--report step`` (default): for real model shape tables and world sizes up to 1024, the NS load
balance, the bytes each rank sends per step and a predicted optimizer-step time for DMuonFSDP,
gather-all ("vanilla") Muon and AdamW; plots step time against W. The model (per rank, per
optimizer step; matrices only: embeddings, head and vectors cost the same under every optimizer):
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

``--report balance``: per model and world size, the busiest rank's NS flops over the assignment
lower bound max(total / W, largest matrix, W-th + (W+1)-th largest), and over the mean load.

``--report hsdp``: HSDP (replicas R x shards S, ``--meshes RxS``), bf16 on the wire, bytes sent
per rank per step (max and mean, MiB) and the busiest rank's NS GFLOP of four ways to run Muon:
per-replica (DMuonFSDP inside each replica group, NS repeated R times in the job); DMuonFSDP
(owners over all R*S ranks, one all-to-all over the job each way); a2a + all-gather (the same
owners, results returned inside the owner's shard group and then all-gathered across replicas);
gather-all (every rank gathers every matrix in its shard group and runs all NS).

``--report e2e``: a whole training step with backward, AdamW against DMuonFSDP with and without
``overlap_backward`` (``benchmarks.simulate_e2e``).

``--report moe``: MoE models with expert parallelism (``benchmarks.simulate_moe``).

    python -m benchmarks.simulate_scale --gpu h200
    python -m benchmarks.simulate_scale --report balance --world-sizes 8 16 64
    python -m benchmarks.simulate_scale --report hsdp --meshes 2x4 4x8 8x8 --models gpt2-124m llama3-8b
    python -m benchmarks.simulate_scale --report e2e --tokens-per-rank 8192 --mfu 0.4 --models llama3-70b
    python -m benchmarks.simulate_scale --report moe --ep 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.scale_model import (
    GPUS,
    MODELS,
    WIRE_BYTES,
    elementwise_seconds,
    ns_costs,
    plan_for,
    print_header,
    resolve_gpu,
    row_sharded,
    spread,
)
from benchmarks.simulate_e2e import e2e_report
from benchmarks.simulate_moe import MOE_MODELS, moe_report
from dmuon_fsdp.newton_schulz import NS_ALGORITHMS
from dmuon_fsdp.planner import build_plan
from instruments.plans import assignment_lower_bound, makespan_lower_bound, rank_loads, replicated


def simulate(shapes: list[tuple[int, int]], world: int, args: argparse.Namespace) -> dict:
    """A DMuonFSDP step time per --ns-algorithms entry; balance and bytes of the first one's plan."""
    rate = args.tflops * 1e12 * args.ns_efficiency
    link = args.link_gbs * 1e9
    params = sum(r * c for r, c in shapes)
    elementwise = elementwise_seconds(params, world, args)
    standard = ns_costs(shapes, "standard", args.ns_steps)
    gather = elementwise + sum(standard) / rate + params * WIRE_BYTES * (world - 1) / world / link
    row: dict = {
        "world": world,
        "matrices": len(shapes),
        "params": params,
        "gather_ms": gather * 1e3,
        "adamw_ms": elementwise * 1e3,
        "dmuon_ms": {},
    }
    for algorithm in args.ns_algorithms:
        plan = plan_for(shapes, world, args.bucket_mib * 2**20, algorithm, args.ns_steps)
        loads, costs = rank_loads(plan), list(plan.costs)
        sent = max(plan.elements_moved(r) for r in range(world)) * WIRE_BYTES
        row["dmuon_ms"][algorithm] = (elementwise + max(loads) / rate + sent / link) * 1e3
        if algorithm == args.ns_algorithms[0]:
            row.update(
                busiest_over_bound=max(loads) / assignment_lower_bound(costs, world),
                busiest_over_l2_bound=max(loads) / makespan_lower_bound(costs, world),
                max_over_mean=max(loads) * world / sum(loads),
                sent_mib=sent / 2**20,
            )
    return row


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (model, rows) in enumerate(results.items()):
        color = f"C{i}"
        ws = [r["world"] for r in rows]
        for algorithm, marker in zip(rows[0]["dmuon_ms"], "os^"[: len(rows[0]["dmuon_ms"])], strict=True):
            ax.plot(
                ws,
                [r["dmuon_ms"][algorithm] for r in rows],
                f"-{marker}",
                color=color,
                label=f"{model} DMuonFSDP {algorithm}",
            )
        ax.plot(ws, [r["gather_ms"] for r in rows], "--", color=color, label=f"{model} gather-all Muon")
        ax.plot(ws, [r["adamw_ms"] for r in rows], ":", color=color, label=f"{model} AdamW")
    ax.set(
        xscale="log", yscale="log", xlabel="world size W", ylabel="predicted optimizer step (ms)", title=title
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def balance(shapes: list[tuple[int, int]], world: int) -> dict:
    """The busiest rank's NS load over the assignment lower bound and over the mean."""
    loads = rank_loads(plan_for(shapes, world, 2**62))
    bound = assignment_lower_bound(ns_costs(shapes), world)
    return {
        "world": world,
        "matrices": len(shapes),
        "over_bound": max(loads) / bound,
        "over_mean": max(loads) * world / sum(loads),
    }


def hsdp(shapes: list[tuple[int, int]], replicas: int, shards: int) -> dict:
    """{scheme: MiB sent per rank (max, mean) and the busiest rank's NS GFLOP} on R x S HSDP."""
    world, costs = replicas * shards, ns_costs(shapes)
    rows_only = row_sharded(shapes, shards)
    per_replica = build_plan(rows_only, costs, shards, 2**40, WIRE_BYTES)
    ours = build_plan([replicated(m, replicas) for m in rows_only], costs, world, 2**40, WIRE_BYTES)
    two_step = []
    for rank in range(world):
        replica = rank // shards
        sent = 0
        for j, m in enumerate(ours.matrices):
            owner = ours.owners[j]
            if owner != rank and rank in ours.senders[j]:  # forward: one copy to the owner
                sent += m.pieces[rank].numel
            if owner == rank:  # return inside the owner's shard group
                sent += sum(
                    m.pieces[r].numel for r in range(replica * shards, (replica + 1) * shards) if r != rank
                )
            if owner // shards == replica:  # all-gather across replicas: my rows to R-1 others
                sent += (replicas - 1) * m.pieces[rank].numel
        two_step.append(sent)
    gather_all = [sum(m.pieces[s].numel for m in rows_only) * (shards - 1) for s in range(shards)]
    busiest = max(rank_loads(ours)) / 1e9
    return {
        "per-replica": {
            **spread([per_replica.elements_moved(r) for r in range(shards)]),
            "ns_gflop": max(rank_loads(per_replica)) / 1e9,
        },
        "DMuonFSDP": {**spread([ours.elements_moved(r) for r in range(world)]), "ns_gflop": busiest},
        "a2a + all-gather": {**spread(two_step), "ns_gflop": busiest},
        "gather-all": {**spread(gather_all), "ns_gflop": sum(costs) / 1e9},
    }


def step_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama-1b", "llama3-8b", "llama3-70b", "mixtral-8x7b"]
    results = {m: [simulate(MODELS[m], w, args) for w in args.world_sizes] for m in models}
    title = (
        f"{args.gpu}: {args.tflops:g} TFLOP/s x {args.ns_efficiency:g}, {args.link_gbs:g} GB/s link, "
        f"{args.hbm_gbs:g} GB/s HBM"
    )
    print(f"## Predicted optimizer step, {title}\n")
    algorithms, first = args.ns_algorithms, args.ns_algorithms[0]
    header = [
        "model",
        "W",
        "matrices",
        "busiest / bound",
        "busiest / L2 bound",
        "max / mean",
        "MiB sent per rank",
        *(f"DMuonFSDP {a} ms" for a in algorithms),
        "gather-all Muon ms",
        "AdamW ms",
        f"gather-all / DMuonFSDP {first}",
        *(f"{first} / {a}" for a in algorithms[1:]),
    ]
    print_header(header)
    for model, rows in results.items():
        for r in rows:
            ms = r["dmuon_ms"]
            cells = [
                model,
                r["world"],
                r["matrices"],
                f"{r['busiest_over_bound']:.3f}",
                f"{r['busiest_over_l2_bound']:.3f}",
                f"{r['max_over_mean']:.2f}",
                f"{r['sent_mib']:.0f}",
                *(f"{ms[a]:.1f}" for a in algorithms),
                f"{r['gather_ms']:.1f}",
                f"{r['adamw_ms']:.2f}",
                f"{r['gather_ms'] / ms[first]:.1f}x",
                *(f"{ms[first] / ms[a]:.2f}x" for a in algorithms[1:]),
            ]
            print("| " + " | ".join(map(str, cells)) + " |")
    plot(results, Path(args.out).with_suffix(".png"), title)
    return results


def balance_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama-1b", "llama3-8b", "llama3-70b"]
    results = {m: [balance(MODELS[m], w) for w in args.world_sizes] for m in models}
    print("| model | matrices | W | busiest / lower bound | busiest / mean |")
    print("|---|---:|---:|---:|---:|")
    for model, rows in results.items():
        for r in rows:
            print(
                f"| {model} | {r['matrices']} | {r['world']} | {r['over_bound']:.4f} | {r['over_mean']:.4f} |"
            )
    return results


def hsdp_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama3-8b"]
    results = {}
    print("| model | R x S | scheme | MiB sent / rank / step: max | mean | busiest rank NS GFLOP |")
    print("|---|---|---|---:|---:|---:|")
    for model in models:
        results[model] = {"elements": sum(r * c for r, c in MODELS[model]), "meshes": {}}
        for mesh in args.meshes:
            replicas, shards = (int(n) for n in mesh.split("x"))
            schemes = results[model]["meshes"][mesh] = hsdp(MODELS[model], replicas, shards)
            for scheme, r in schemes.items():
                print(
                    f"| {model} | {mesh} | {scheme} | {r['max_mib']:.1f} | {r['mean_mib']:.1f} | "
                    f"{r['ns_gflop']:.1f} |"
                )
    return results


REPORTS = {
    "step": step_report,
    "balance": balance_report,
    "hsdp": hsdp_report,
    "e2e": e2e_report,
    "moe": moe_report,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", default="step", choices=list(REPORTS))
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument(
        "--tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: the GPU's)"
    )
    parser.add_argument(
        "--hbm-gbs", type=float, default=None, help="memory bandwidth GB/s (default: the GPU's)"
    )
    parser.add_argument("--link-gbs", type=float, default=50.0, help="network GB/s per GPU, each direction")
    parser.add_argument("--ns-efficiency", type=float, default=0.5, help="achieved fraction of peak in NS")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument(
        "--ns-algorithms",
        nargs="+",
        default=["standard", "auto"],
        choices=NS_ALGORITHMS,
        help="DMuonFSDP's ns_algorithm, one predicted step per entry",
    )
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=None,
        help="default: 8 16 ... 1024 (e2e: 8 64 256 1024; moe: 64 256 1024)",
    )
    parser.add_argument(
        "--tokens-per-rank", type=int, default=8192, help="e2e: tokens per rank per step (one backward)"
    )
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="e2e: achieved fraction of peak in forward and backward"
    )
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8", "8x8"], help="HSDP replicas x shards")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default: per report")
    parser.add_argument(
        "--moe-models", nargs="+", default=list(MOE_MODELS), choices=list(MOE_MODELS), help="moe: models"
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=8,
        help="moe: expert-parallel degree (capped at a model's experts per layer)",
    )
    parser.add_argument(
        "--moe-layers",
        type=int,
        default=None,
        help="moe: MoE layers (default: all; DeepSeek-V3 58, Mixtral 32)",
    )
    parser.add_argument("--out", default=None, help="JSON (default: runs/bench/simulate_<report>.json)")
    args = parser.parse_args()
    args.world_sizes = args.world_sizes or {"e2e": [8, 64, 256, 1024], "moe": [64, 256, 1024]}.get(
        args.report, [8, 16, 32, 64, 128, 256, 512, 1024]
    )
    out = Path(args.out or f"runs/bench/simulate_{args.report}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    results = REPORTS[args.report](args)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nJSON: {out}" + (f"\nplot: {out.with_suffix('.png')}" if args.report == "step" else ""))


if __name__ == "__main__":
    main()
