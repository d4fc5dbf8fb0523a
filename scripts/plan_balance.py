"""NS load balance of the owner assignment for Llama-style models, from the planner alone.

    python scripts/plan_balance.py --world-sizes 8 16 64

Prints, per model and world size, the busiest rank's NS flops over the assignment lower bound
max(total / W, largest matrix, W-th + (W+1)-th largest), and over the mean load.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dmuon_fsdp.layouts import MatrixLayout, chunk_row_counts  # noqa: E402
from dmuon_fsdp.newton_schulz import standard_segments  # noqa: E402
from dmuon_fsdp.planner import assignment_lower_bound, build_plan  # noqa: E402
from model_shapes import LLAMA_SHAPES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--ns-steps", type=int, default=5)
    args = parser.parse_args()
    print("| model | matrices | W | busiest / lower bound | busiest / mean |")
    print("|---|---:|---:|---:|---:|")
    for model, shapes in LLAMA_SHAPES.items():
        for world in args.world_sizes:
            matrices = [
                MatrixLayout.row_sharded(f"m{i}", r, c, chunk_row_counts(r, world), standard_segments(args.ns_steps))
                for i, (r, c) in enumerate(shapes)
            ]
            loads = build_plan(matrices, world, 2**62, 2).loads()
            bound = assignment_lower_bound([m.cost for m in matrices], world)
            print(f"| {model} | {len(shapes)} | {world} | {max(loads) / bound:.4f} | "
                  f"{max(loads) * world / sum(loads):.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
