"""What the ``simulate_*`` reports share: real models' hidden-matrix shapes, GPU figures, and
the pieces of the cost model (row-sharded layouts, NS flops per form, a plan, element-wise time).
See ``benchmarks.simulate_scale`` for the model itself."""

from __future__ import annotations

import argparse

import torch

from dmuon_fsdp.layouts import MatrixLayout
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, ns_segments, resolve_coefficients, segments_flops
from dmuon_fsdp.planner import Plan, build_plan
from instruments.plans import chunk_row_counts, row_sharded_layout


def llama_matrices(layers: int, dim: int, kv_dim: int, ffn: int, experts: int = 0) -> list[tuple[int, int]]:
    """Hidden matrices of a Llama decoder (q, k, v, o, gate, up, down per layer) as (out, in); with
    ``experts``, that many SwiGLU experts per layer instead of one MLP, each expert's three
    matrices orthogonalized on their own (an expert stack [E, m, n] is E matrices)."""
    attention = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim)]
    return (attention + [(ffn, dim), (ffn, dim), (dim, ffn)] * max(experts, 1)) * layers


LLAMA_CONFIGS = {  # layers, dim, kv_dim, ffn, experts
    "gpt2-124m": (12, 768, 768, 3072, 0),
    "llama-1b": (16, 2048, 512, 8192, 0),
    "llama3-8b": (32, 4096, 1024, 14336, 0),
    "llama3-70b": (80, 8192, 1024, 28672, 0),
    "mixtral-8x7b": (32, 4096, 1024, 14336, 8),
}


MODELS = {name: llama_matrices(*config) for name, config in LLAMA_CONFIGS.items()}


GPUS = {"h100": {"tflops": 989.0, "hbm_gbs": 3350.0}, "h200": {"tflops": 989.0, "hbm_gbs": 4800.0}}


STATE_BYTES_PER_PARAM = 28


WIRE_BYTES = 2  # bf16


def row_sharded(shapes: list[tuple[int, int]], world: int) -> list[MatrixLayout]:
    return [row_sharded_layout(str(i), r, c, chunk_row_counts(r, world)) for i, (r, c) in enumerate(shapes)]


def ns_costs(shapes: list[tuple[int, int]], algorithm: str = "standard", ns_steps: int = 5) -> list[int]:
    """NS flops of each matrix in the form ``algorithm`` picks for it in bf16."""
    coefficients = resolve_coefficients(MUON_COEFFICIENTS, ns_steps)
    return [
        segments_flops(r, c, ns_segments(algorithm, coefficients, torch.bfloat16, r, c)) for r, c in shapes
    ]


def plan_for(
    shapes: list[tuple[int, int]],
    world: int,
    bucket_bytes: int,
    algorithm: str = "standard",
    ns_steps: int = 5,
) -> Plan:
    return build_plan(
        row_sharded(shapes, world), ns_costs(shapes, algorithm, ns_steps), world, bucket_bytes, WIRE_BYTES
    )


def elementwise_seconds(params: int, world: int, args: argparse.Namespace) -> float:
    """Optimizer-state traffic of a rank's 1/W share of ``params`` through HBM."""
    return params / world * STATE_BYTES_PER_PARAM / (args.hbm_gbs * 1e9)


def resolve_gpu(args: argparse.Namespace) -> None:
    """Fill --tflops and --hbm-gbs from --gpu where not given."""
    args.tflops = args.tflops or GPUS[args.gpu]["tflops"]
    args.hbm_gbs = args.hbm_gbs or GPUS[args.gpu]["hbm_gbs"]


def spread(sent: list[int]) -> dict:
    return {"max_mib": max(sent) * WIRE_BYTES / 2**20, "mean_mib": sum(sent) / len(sent) * WIRE_BYTES / 2**20}


def print_header(columns: list[str]) -> None:
    """A markdown table's header: the first column left-aligned, the others right-aligned."""
    print("| " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * (len(columns) - 1))
