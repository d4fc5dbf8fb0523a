"""HSDP: bytes each rank sends per step and NS flops on the busiest rank, from the planner alone.

    python scripts/hsdp_bytes.py --meshes 2x4 4x8 8x8 --models gpt2-124m llama3-8b

Three ways to run Muon on an HSDP (replicas R x shards S) layout, bf16 on the wire:
- per-replica: every replica group runs DMuonFSDP over its own S shards, so each matrix's NS runs
  R times in the job;
- DMuonFSDP (what it does): owners spread over all R*S ranks, one all-to-all over the job brings
  one copy of each matrix to its owner, a second sends every rank (all replicas) its rows;
- a2a + all-gather: the same owners, the result returned inside the owner's shard group, then an
  all-gather across the replicate dim (two collectives for the return);
- gather-all: every rank all-gathers every matrix in its shard group and runs all NS.
Bytes are sent per rank per step (max and mean over ranks, MiB); NS is the busiest rank's GFLOP.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dmuon_fsdp.layouts import MatrixLayout, chunk_row_counts, replicated  # noqa: E402
from dmuon_fsdp.newton_schulz import standard_segments  # noqa: E402
from dmuon_fsdp.planner import build_plan  # noqa: E402
from model_shapes import LLAMA_SHAPES  # noqa: E402

BYTES = 2  # bf16


def _spread(sent: list[int]) -> tuple[float, float]:
    return max(sent) * BYTES / 2**20, sum(sent) / len(sent) * BYTES / 2**20


def compare(shapes: list[tuple[int, int]], replicas: int, shards: int) -> dict[str, tuple[float, float, float]]:
    """{scheme: (max and mean MiB sent per rank, busiest rank's NS GFLOP)}."""
    world = replicas * shards
    rows_only = [MatrixLayout.row_sharded(str(i), r, c, chunk_row_counts(r, shards), standard_segments(5))
                 for i, (r, c) in enumerate(shapes)]
    per_replica = build_plan(rows_only, shards, 2**40, BYTES)
    ours = build_plan([replicated(m, replicas) for m in rows_only], world, 2**40, BYTES)
    two_step = []
    for rank in range(world):
        replica, shard = divmod(rank, shards)
        sent = 0
        for j, m in enumerate(ours.matrices):
            owner = ours.owners[j]
            if owner != rank and rank in ours.senders[j]:  # forward: one copy to the owner
                sent += m.pieces[rank].numel
            if owner == rank:  # return inside the owner's shard group
                sent += sum(m.pieces[r].numel for r in range(replica * shards, (replica + 1) * shards) if r != rank)
            if owner // shards == replica:  # all-gather across replicas: my rows to R-1 others
                sent += (replicas - 1) * m.pieces[rank].numel
        two_step.append(sent)
    gather_all = [sum(m.pieces[s].numel for m in rows_only) * (shards - 1) for s in range(shards)]
    busiest = max(ours.loads()) / 1e9
    return {
        "per-replica": (*_spread([per_replica.elements_moved(r) for r in range(shards)]),
                        max(per_replica.loads()) / 1e9),
        "DMuonFSDP": (*_spread([ours.elements_moved(r) for r in range(world)]), busiest),
        "a2a + all-gather": (*_spread(two_step), busiest),
        "gather-all": (*_spread(gather_all), sum(m.cost for m in rows_only) / 1e9),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8", "8x8"], help="replicas x shards")
    parser.add_argument("--models", nargs="+", default=["gpt2-124m", "llama3-8b"], choices=sorted(LLAMA_SHAPES))
    args = parser.parse_args()
    print("| model | R x S | scheme | MiB sent / rank / step: max | mean | busiest rank NS GFLOP |")
    print("|---|---|---|---:|---:|---:|")
    for model in args.models:
        for mesh in args.meshes:
            replicas, shards = (int(n) for n in mesh.split("x"))
            for scheme, (most, mean, flops) in compare(LLAMA_SHAPES[model], replicas, shards).items():
                print(f"| {model} | {mesh} | {scheme} | {most:.1f} | {mean:.1f} | {flops:.1f} |")


if __name__ == "__main__":
    main()
