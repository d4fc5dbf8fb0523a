"""What a step costs on paper, per rank: GPU figures and the time of each part of the optimizer
step, from the planner's plan alone (no processes).

- Newton-Schulz time = NS flops on the rank / (peak bf16 TFLOP/s x --ns-efficiency); each matrix
  in the form ``ns_algorithm`` picks for it in bf16 ("auto" runs Gram Newton-Schulz where it needs
  fewer flops, with its restarts; the same efficiency is assumed for both forms).
- Exchange time = bytes sent / --link-gbs (links are full duplex; sent = received here), bf16 on
  the wire.
- Element-wise time = 28 bytes of optimizer-state traffic per local parameter / --hbm-gbs
  (AdamW: read p, g, m, v, write p, m, v in fp32; Muon momentum + update moves about as much).
GPU defaults: H100 (989 bf16 TFLOP/s dense, 3350 GB/s HBM) and H200 (989, 4800), 50 GB/s of
network per GPU (400 Gb/s), NS at 50% of peak.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.paper.shapes import Shape, row_sharded
from dmuon_fsdp._step.planner import Plan, build_plan
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, ns_segments, resolve_coefficients, segments_flops
from instruments.plans import rank_loads

GPUS = {"h100": {"tflops": 989.0, "hbm_gbs": 3350.0}, "h200": {"tflops": 989.0, "hbm_gbs": 4800.0}}

STATE_BYTES_PER_PARAM = 28

WIRE_BYTES = 2  # bf16


def resolve_gpu(args: argparse.Namespace) -> None:
    """Fill --tflops and --hbm-gbs from --gpu where not given."""
    args.tflops = args.tflops or GPUS[args.gpu]["tflops"]
    args.hbm_gbs = args.hbm_gbs or GPUS[args.gpu]["hbm_gbs"]


def ns_rate(args: argparse.Namespace) -> float:
    """NS flops per second: peak x --ns-efficiency."""
    return args.tflops * 1e12 * args.ns_efficiency


def link_rate(args: argparse.Namespace) -> float:
    """Bytes per second each way on a GPU's link."""
    return args.link_gbs * 1e9


def ns_costs(shapes: list[Shape], algorithm: str = "standard", ns_steps: int = 5) -> list[int]:
    """NS flops of each matrix in the form ``algorithm`` picks for it in bf16."""
    coefficients = resolve_coefficients(MUON_COEFFICIENTS, ns_steps)
    return [
        segments_flops(r, c, ns_segments(algorithm, coefficients, torch.bfloat16, r, c)) for r, c in shapes
    ]


def plan_for(
    shapes: list[Shape],
    world: int,
    bucket_bytes: int,
    algorithm: str = "standard",
    ns_steps: int = 5,
    flops_per_byte: float = 0.0,
) -> Plan:
    """The planner's plan for ``shapes`` row-sharded over ``world`` ranks, bf16 on the wire (its
    buckets shaped at ``flops_per_byte``, DMuonFSDP's ``ns_flops_per_byte``; 0: the plain cut)."""
    costs = ns_costs(shapes, algorithm, ns_steps)
    return build_plan(
        row_sharded(shapes, world), costs, world, bucket_bytes, WIRE_BYTES, None, flops_per_byte
    )


def elementwise_seconds(params: int, world: int, args: argparse.Namespace) -> float:
    """Optimizer-state traffic of a rank's 1/W share of ``params`` through HBM."""
    return params / world * STATE_BYTES_PER_PARAM / (args.hbm_gbs * 1e9)


def dmuon_step(
    plan: Plan, world: int, elementwise: float, args: argparse.Namespace
) -> tuple[float, list[int], int]:
    """(DMuonFSDP's optimizer step in seconds with no credit for overlap: element-wise + the busiest
    rank's NS + the busiest sender's exchange, both ways; every rank's NS flops; that sender's
    bytes) under ``plan``."""
    loads = rank_loads(plan)
    sent = max(plan.elements_moved(r) for r in range(world)) * WIRE_BYTES
    return elementwise + max(loads) / ns_rate(args) + sent / link_rate(args), loads, sent


def spread(sent: list[int]) -> dict:
    """MiB sent per rank, max and mean, of elements sent per rank."""
    return {"max_mib": max(sent) * WIRE_BYTES / 2**20, "mean_mib": sum(sent) / len(sent) * WIRE_BYTES / 2**20}


def print_header(columns: list[str], left: int = 1) -> None:
    """A markdown table's header: the first ``left`` columns left-aligned, the others right-aligned."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * left + "---:|" * (len(columns) - left))


def print_row(cells: list) -> None:
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)
