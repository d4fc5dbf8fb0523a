"""The optimizer step alone, on paper: ``--report step``, ``balance`` and ``hsdp``.

``--report step`` (default): for real model shape tables and world sizes up to 1024, the NS load
balance, the bytes each rank sends per step and a predicted optimizer-step time for DMuonFSDP,
gather-all ("vanilla") Muon and AdamW; plots step time against W. Per rank, per optimizer step,
matrices only, with the costs of ``benchmarks.paper.costs``:
- DMuonFSDP: the busiest rank's owned matrices' NS (one plan per --ns-algorithms entry) and the
  plan's bytes for the busiest sender (bf16 shards to owners and rows back);
- gather-all: every matrix's NS on every rank, standard form, and an all-gather of every matrix,
  (W-1)/W of all matrix bytes;
- AdamW: element-wise only.
- Step = element-wise + NS + exchange, with no credit for overlapping exchange and NS
  (DMuonFSDP overlaps them, so its real time is lower, down to element-wise + max of the two).

``--report balance``: per model and world size, the busiest rank's NS flops over the assignment
lower bound max(total / W, largest matrix, W-th + (W+1)-th largest), and over the mean load.

``--report hsdp``: HSDP (replicas R x shards S, ``--meshes RxS``), bf16 on the wire, bytes sent
per rank per step (max and mean, MiB) and the busiest rank's NS GFLOP of four ways to run Muon:
per-replica (DMuonFSDP inside each replica group, NS repeated R times in the job); DMuonFSDP
(owners over all R*S ranks, results back inside the owner's replica and by relay across
replicas: ``dmuon_fsdp._step.relay``); direct return (the same owners, each result from its
owner to every holder, as before the relay); gather-all (every rank gathers every matrix in its
shard group and runs all NS).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.paper.costs import (
    WIRE_BYTES,
    dmuon_step,
    elementwise_seconds,
    link_rate,
    ns_costs,
    ns_rate,
    plan_for,
    print_header,
    print_row,
    resolve_gpu,
    spread,
)
from benchmarks.paper.shapes import MODELS, Shape, row_sharded
from dmuon_fsdp._step.planner import build_plan
from instruments.plans import assignment_lower_bound, makespan_lower_bound, rank_loads, replicated


def predict_step(shapes: list[Shape], world: int, args: argparse.Namespace) -> dict:
    """A DMuonFSDP step time per --ns-algorithms entry; balance and bytes of the first one's plan."""
    params = sum(r * c for r, c in shapes)
    elementwise = elementwise_seconds(params, world, args)
    standard = ns_costs(shapes, "standard", args.ns_steps)
    exchange = params * WIRE_BYTES * (world - 1) / world / link_rate(args)
    gather = elementwise + sum(standard) / ns_rate(args) + exchange
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
        seconds, loads, sent = dmuon_step(plan, world, elementwise, args)
        row["dmuon_ms"][algorithm] = seconds * 1e3
        if algorithm == args.ns_algorithms[0]:
            costs = list(plan.costs)
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


def balance(shapes: list[Shape], world: int) -> dict:
    """The busiest rank's NS load over the assignment lower bound and over the mean."""
    loads = rank_loads(plan_for(shapes, world, 2**62))
    bound = assignment_lower_bound(ns_costs(shapes), world)
    return {
        "world": world,
        "matrices": len(shapes),
        "over_bound": max(loads) / bound,
        "over_mean": max(loads) * world / sum(loads),
    }


def hsdp(shapes: list[Shape], replicas: int, shards: int) -> dict:
    """{scheme: MiB sent per rank (max, mean) and the busiest rank's NS GFLOP} on R x S HSDP."""
    world, costs = replicas * shards, ns_costs(shapes)
    rows_only = row_sharded(shapes, shards)
    per_replica = build_plan(rows_only, costs, shards, 2**40, WIRE_BYTES)
    ours = build_plan([replicated(m, replicas) for m in rows_only], costs, world, 2**40, WIRE_BYTES)
    direct = []
    for rank in range(world):
        sent = 0
        for j, m in enumerate(ours.matrices):
            owner = ours.owners[j]
            if owner != rank and rank in ours.senders[j]:  # forward: one copy to the owner
                sent += m.pieces[rank].numel
            if owner == rank:  # back: every other holder its piece, in every replica
                sent += sum(p.numel for r, p in enumerate(m.pieces) if r != rank)
        direct.append(sent)
    gather_all = [sum(m.pieces[s].numel for m in rows_only) * (shards - 1) for s in range(shards)]
    busiest = max(rank_loads(ours)) / 1e9
    return {
        "per-replica": {
            **spread([per_replica.elements_moved(r) for r in range(shards)]),
            "ns_gflop": max(rank_loads(per_replica)) / 1e9,
        },
        "DMuonFSDP": {**spread([ours.elements_moved(r) for r in range(world)]), "ns_gflop": busiest},
        "direct return": {**spread(direct), "ns_gflop": busiest},
        "gather-all": {**spread(gather_all), "ns_gflop": sum(costs) / 1e9},
    }


def step_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama-1b", "llama3-8b", "llama3-70b", "mixtral-8x7b"]
    results = {m: [predict_step(MODELS[m], w, args) for w in args.world_sizes] for m in models}
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
            print_row(
                [
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
            )
    plot(results, Path(args.out).with_suffix(".png"), title)
    return results


def balance_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama-1b", "llama3-8b", "llama3-70b"]
    results = {m: [balance(MODELS[m], w) for w in args.world_sizes] for m in models}
    print_header(["model", "matrices", "W", "busiest / lower bound", "busiest / mean"])
    for model, rows in results.items():
        for r in rows:
            print_row([model, r["matrices"], r["world"], f"{r['over_bound']:.4f}", f"{r['over_mean']:.4f}"])
    return results


def hsdp_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama3-8b"]
    results: dict[str, dict[str, Any]] = {}
    header = ["model", "R x S", "scheme", "MiB sent / rank / step: max", "mean", "busiest rank NS GFLOP"]
    print_header(header, left=3)
    for model in models:
        results[model] = {"elements": sum(r * c for r, c in MODELS[model]), "meshes": {}}
        for mesh in args.meshes:
            replicas, shards = (int(n) for n in mesh.split("x"))
            schemes = results[model]["meshes"][mesh] = hsdp(MODELS[model], replicas, shards)
            for scheme, r in schemes.items():
                print_row(
                    [
                        model,
                        mesh,
                        scheme,
                        f"{r['max_mib']:.1f}",
                        f"{r['mean_mib']:.1f}",
                        f"{r['ns_gflop']:.1f}",
                    ]
                )
    return results
