"""MoE models with expert parallelism, on paper: ``--report moe``.

``--report moe``: MoE models (``benchmarks.paper.shapes.MOE_MODELS``: DeepSeek-V3 and Mixtral
8x7B, their shapes, simplifications and expert-parallel layout described there) with expert
parallelism (--ep, default 8, capped at a model's experts per layer), per world size (default 64
256 1024), DMuonFSDP's plan with every expert matrix its own matrix and owners anywhere in the job
(the planner's choice; an expert held whole by one rank, efsdp = 1, is owned there): the busiest
rank's NS flops (and ms at --ns-efficiency) over ``assignment_lower_bound`` and
``makespan_lower_bound``, bf16 bytes each rank sends per step (max and mean, both exchanges, as
``Plan.elements_moved``), the share of expert matrices owned by a rank that holds none of them,
and the host side: matrices owned per rank, distinct shapes owned, and NS batches per step
(distinct shapes per owner per --bucket-mib bucket). --moe-layers runs fewer MoE layers
(DeepSeek-V3 keeps its 3 dense ones). The "plan s" column is the planner's own time here (host
time, not a prediction).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

from benchmarks.paper.costs import WIRE_BYTES, ns_costs, ns_rate, print_header, print_row, resolve_gpu, spread
from benchmarks.paper.shapes import MOE_MODELS, Stack, ep_layouts
from dmuon_fsdp._step.planner import build_plan
from instruments.plans import assignment_lower_bound, makespan_lower_bound, rank_loads


def moe_scale(stacks: list[Stack], world: int, ep: int, args: argparse.Namespace) -> dict:
    """DMuonFSDP's plan (every expert matrix its own matrix, owners chosen by the planner over all
    W ranks) for ``stacks`` on ``world`` ranks with expert parallelism ``ep``: the busiest rank's
    NS against the lower bounds, bytes sent per rank (bf16, both exchanges), the expert matrices
    owned outside the ranks that hold them, matrices owned and NS batches per rank."""
    algorithm = args.ns_algorithms[0]
    started = time.perf_counter()
    layouts, holders, is_expert, param_of = ep_layouts(stacks, world, ep)
    cost_of: dict[tuple[int, int], int] = {}
    for m in layouts:
        if (m.rows, m.cols) not in cost_of:
            cost_of[m.rows, m.cols] = ns_costs([(m.rows, m.cols)], algorithm, args.ns_steps)[0]
    costs = [cost_of[m.rows, m.cols] for m in layouts]
    plan = build_plan(layouts, costs, world, args.bucket_mib * 2**20, WIRE_BYTES, param_of)
    plan_seconds = time.perf_counter() - started
    # Plan.elements_moved per rank, summed over the holders only (one pass; senders = holders, as
    # every matrix here is held once): a holder sends its piece to another owner, and the owner
    # sends every other holder's piece back.
    sent = [0] * world
    outside = 0
    for m, holder, expert, owner in zip(layouts, holders, is_expert, plan.owners, strict=True):
        for r in holder:
            if r != owner:
                sent[r] += m.pieces[r].numel
        sent[owner] += m.numel - m.pieces[owner].numel
        outside += expert and m.pieces[owner].numel == 0
    loads = rank_loads(plan)
    owned = [0] * world
    shapes: list[set] = [set() for _ in range(world)]
    batches = [0] * world  # NS batches a step runs: distinct shapes per owner per bucket
    for bucket in plan.buckets:
        in_bucket: dict[int, set] = defaultdict(set)
        for j in bucket.matrices:
            shape = (plan.matrices[j].rows, plan.matrices[j].cols)
            in_bucket[plan.owners[j]].add(shape)
            owned[plan.owners[j]] += 1
            shapes[plan.owners[j]].add(shape)
        for owner, owned_shapes in in_bucket.items():
            batches[owner] += len(owned_shapes)
    experts = sum(is_expert)
    return {
        "world": world,
        "ep": ep,
        "efsdp": world // ep,
        "algorithm": algorithm,
        "matrices": len(layouts),
        "expert_matrices": experts,
        "params": sum(m.numel for m in layouts),
        "busiest_ns_gflop": max(loads) / 1e9,
        "busiest_ns_ms": max(loads) / ns_rate(args) * 1e3,
        "busiest_over_bound": max(loads) / assignment_lower_bound(costs, world),
        "busiest_over_l2_bound": max(loads) / makespan_lower_bound(costs, world),
        "max_over_mean": max(loads) * world / sum(loads),
        **spread(sent),
        "expert_owned_outside": outside / experts if experts else 0.0,
        "owned_max": max(owned),
        "owned_mean": sum(owned) / world,
        "shapes_max": max(len(s) for s in shapes),
        "buckets": len(plan.buckets),
        "ns_batches_max": max(batches),
        "plan_seconds": plan_seconds,
    }


def moe_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    results: dict[str, dict[str, Any]] = {}
    print(
        f"## MoE at scale: DMuonFSDP, every expert matrix its own, --ep {args.ep} (capped at a model's "
        f"experts), NS {args.ns_algorithms[0]} at {args.ns_efficiency:g} of {args.tflops:g} TFLOP/s, "
        f"bf16 on the wire, {args.bucket_mib} MiB buckets\n"
    )
    header = [
        "model",
        "layers",
        "W",
        "ep x efsdp",
        "matrices",
        "busiest NS GFLOP",
        "busiest NS ms",
        "busiest / bound",
        "busiest / L2 bound",
        "max / mean",
        "MiB sent / rank: max",
        "mean",
        "expert owners outside EP group",
        "matrices owned / rank: max",
        "mean",
        "shapes owned / rank: max",
        "NS batches / rank / step: max",
        "buckets",
        "plan s",
    ]
    print_header(header)
    for model in args.moe_models:
        stacks_of, default_layers, dense_layers = MOE_MODELS[model]
        layers = args.moe_layers or default_layers
        stacks = stacks_of(layers)
        experts = max(n for _, n in stacks)
        ep = min(args.ep, experts)
        label = (
            f"{layers + dense_layers} ({dense_layers} dense + {layers} MoE)" if dense_layers else str(layers)
        )
        results[model] = {"layers": label, "rows": []}
        for world in args.world_sizes:
            if world % ep or experts % ep:
                print(f"| {model} | {label} | {world} | ep {ep} does not divide W and {experts} experts |")
                continue
            r = moe_scale(stacks, world, ep, args)
            results[model]["rows"].append(r)
            cells = [
                model,
                label,
                world,
                f"{r['ep']} x {r['efsdp']}",
                r["matrices"],
                f"{r['busiest_ns_gflop']:.0f}",
                f"{r['busiest_ns_ms']:.1f}",
                f"{r['busiest_over_bound']:.3f}",
                f"{r['busiest_over_l2_bound']:.3f}",
                f"{r['max_over_mean']:.3f}",
                f"{r['max_mib']:.1f}",
                f"{r['mean_mib']:.1f}",
                f"{r['expert_owned_outside']:.1%}",
                r["owned_max"],
                f"{r['owned_mean']:.1f}",
                r["shapes_max"],
                r["ns_batches_max"],
                r["buckets"],
                f"{r['plan_seconds']:.1f}",
            ]
            print_row(cells)
    return results
