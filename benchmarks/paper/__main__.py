"""The one command of the paper model: ``python -m benchmarks.paper --report ...`` (see
``benchmarks.paper`` for the reports and their modules)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import benchmarks.paper
from benchmarks.paper.costs import GPUS
from benchmarks.paper.e2e import e2e_report
from benchmarks.paper.embodied import embodied_report
from benchmarks.paper.moe import moe_report
from benchmarks.paper.shapes import MODELS, MOE_MODELS, VLA_MODELS
from benchmarks.paper.step import balance_report, hsdp_report, step_report
from dmuon_fsdp._step.buffers import SLOTS
from dmuon_fsdp.config import NS_ALGORITHMS, Options

REPORTS = {
    "step": step_report,
    "balance": balance_report,
    "hsdp": hsdp_report,
    "e2e": e2e_report,
    "moe": moe_report,
    "embodied": embodied_report,
}

DEFAULT_WORLD_SIZES = {"e2e": [64, 512, 1024], "moe": [64, 256, 1024], "embodied": []}
DEFAULT_MESHES = {
    "e2e": ["64x8", "16x64", "32x32"],
    "hsdp": ["2x4", "4x8", "8x8"],
    "embodied": ["128x1", "1x128", "16x8"],  # DDP, flat FSDP2, HSDP on 16 nodes of 8
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.paper",
        description=benchmarks.paper.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--report", default="step", choices=list(REPORTS))
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument(
        "--tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: the GPU's)"
    )
    parser.add_argument(
        "--hbm-gbs", type=float, default=None, help="memory bandwidth GB/s (default: the GPU's)"
    )
    parser.add_argument(
        "--link-gbs", type=float, default=50.0, help="network GB/s per GPU between nodes, each direction"
    )
    parser.add_argument(
        "--node-gbs",
        type=float,
        default=450.0,
        help="e2e: GB/s per GPU within a node (NVLink), each direction",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="e2e: GPUs a node (consecutive ranks)")
    parser.add_argument("--latency-us", type=float, default=5.0, help="e2e: latency per peer of an exchange")
    parser.add_argument("--ns-efficiency", type=float, default=0.5, help="achieved fraction of peak in NS")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument(
        "--ns-algorithms",
        nargs="+",
        default=["standard", "auto"],
        choices=NS_ALGORITHMS,
        help="DMuonFSDP's ns_algorithm, one predicted step per entry (e2e, moe: the first)",
    )
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument(
        "--ns-flops-per-byte",
        type=float,
        default=Options().ns_flops_per_byte,
        help="DMuonFSDP's ns_flops_per_byte, which shapes its buckets (default: as shipped; 0: plain cut)",
    )
    parser.add_argument(
        "--backward-buckets",
        type=int,
        default=SLOTS - 1,
        help="e2e: buckets whose exchange to the owners overlap_backward starts in backward (default: as "
        "shipped; each more takes one more bucket's buffers)",
    )
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="*",
        default=None,
        help="default: 8 16 ... 1024 (e2e: flat FSDP on 64 512 1024; moe: 64 256 1024; embodied: none)",
    )
    parser.add_argument(
        "--tokens-per-rank", type=int, default=8192, help="e2e: tokens per rank per step (one backward)"
    )
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="e2e: achieved fraction of peak in forward and backward"
    )
    parser.add_argument(
        "--meshes",
        nargs="*",
        default=None,
        help="HSDP meshes, replicas x shards (hsdp: default 2x4 4x8 8x8; e2e: 64x8 16x64 32x32, after the "
        "flat --world-sizes; embodied: 128x1 1x128 16x8, DDP, FSDP2 and HSDP on 16 nodes)",
    )
    parser.add_argument(
        "--before",
        default=None,
        help="e2e: also the package at this git revision (its owners and buckets; each result from its owner "
        "to every holder)",
    )
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
    parser.add_argument(
        "--vla-models", nargs="+", default=list(VLA_MODELS), choices=list(VLA_MODELS), help="embodied: models"
    )
    parser.add_argument(
        "--samples-per-rank",
        type=int,
        default=48,
        help="embodied: samples per rank per step (one backward; each stack's tokens per sample times this)",
    )
    parser.add_argument("--out", default=None, help="JSON (default: runs/bench/paper_<report>.json)")
    args = parser.parse_args(argv)
    args.world_sizes = (
        args.world_sizes
        if args.world_sizes is not None
        else DEFAULT_WORLD_SIZES.get(args.report, [8, 16, 32, 64, 128, 256, 512, 1024])
    )
    args.meshes = args.meshes if args.meshes is not None else DEFAULT_MESHES.get(args.report, [])
    return args


def main() -> None:
    args = parse_args()
    out = Path(args.out or f"runs/bench/paper_{args.report}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    results = REPORTS[args.report](args)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nJSON: {out}" + (f"\nplot: {out.with_suffix('.png')}" if args.report == "step" else ""))


if __name__ == "__main__":
    main()
