"""The other side of ``benchmarks.paper.e2e.plans_before``: an earlier revision of the package
(first on ``sys.path`` in a process of its own) plans the meshes, and its owners and buckets are
written out. Imports nothing that only this checkout's package has."""

from __future__ import annotations

import argparse
import json

from benchmarks.paper.costs import WIRE_BYTES, ns_costs
from benchmarks.paper.shapes import MODELS, mesh_layouts
from dmuon_fsdp._step.planner import build_plan


def plan_here(out: str, models: list[str], meshes: list[list[int]], settings: dict) -> None:
    """Plan ``models`` on ``meshes`` (replicas, shards) with ``settings`` (the e2e report's
    planning options) and write [model, mesh, owners, buckets] per plan to ``out``."""
    args = argparse.Namespace(**settings)
    found = []
    for model in models:
        costs = ns_costs(MODELS[model], args.ns_algorithms[0], args.ns_steps)
        for replicas, shards in meshes:
            matrices = mesh_layouts(MODELS[model], replicas, shards)
            world, bucket = replicas * shards, args.bucket_mib * 2**20
            plan = build_plan(matrices, costs, world, bucket, WIRE_BYTES, None, args.ns_flops_per_byte)
            buckets = [list(b.matrices) for b in plan.buckets]
            found.append([model, [replicas, shards], list(plan.owners), buckets])
    with open(out, "w") as f:
        json.dump(found, f)
