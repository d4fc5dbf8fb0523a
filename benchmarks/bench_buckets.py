"""What ``bucket_bytes`` sets, for a recipe model at W ranks: the buckets a step runs in (one
all-to-all each way per bucket; bucket k + 1 travels while bucket k is orthogonalized, so a
single bucket overlaps nothing), the largest share a rank holds or moves in one bucket, and the
optimizer's buffers (``last_step_stats.buffer_bytes``), against the Muon matrices' bytes a rank
holds of its own shards.

One process stands in for rank 0 of a W-rank FSDP2 job under torch's fake process group
(collectives return at once: counts and sizes are the job's, times are not measured); the model
has the preset's real dimensions, every gradient set, one step taken per ``bucket_bytes`` with
``ns_steps=1`` (buffers do not depend on the iteration count).

    python -m benchmarks.bench_buckets                                  # 124m at W=8, ~1 minute
    python -m benchmarks.bench_buckets --preset 124m --world-size 64 --mib 8 32 128

Writes the table's numbers to ``--out`` (JSON) too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP, param_groups
from recipes.model import Transformer, preset
from recipes.stop import let_threads_run

MIB = 2**20


def sharded_model(name: str, world: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(preset(name))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="124m")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument(
        "--mib", type=float, nargs="+", default=[4, 16, 64, 128, 512], help="bucket_bytes, MiB"
    )
    parser.add_argument("--out", default="runs/bench/buckets.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    try:
        model = sharded_model(args.preset, args.world_size)
        rows = []
        for mib in args.mib:
            # no check flags: what a fake exchange brings back is the backend's choice
            opt = DMuonFSDP(
                param_groups(model),
                bucket_bytes=int(mib * MIB),
                ns_steps=1,
                check_grads=False,
                nonfinite="ignore",
            )
            opt.step()
            muon = [p for group in opt.param_groups if group["use_muon"] for p in group["params"]]
            own = sum(p.to_local().numel() * p.element_size() for p in muon)
            assert opt.last_step_stats is not None and opt.plan is not None  # (opt has stepped)
            buffers = opt.last_step_stats.buffer_bytes
            rows.append((mib, len(opt.plan.buckets), own, buffers))
            del opt
    finally:
        let_threads_run()  # gloo's threads drop the tensors of plain collectives first
        dist.destroy_process_group()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    keys = ("bucket_mib", "buckets", "muon_shard_bytes", "buffer_bytes")
    out.write_text(json.dumps([dict(zip(keys, row, strict=True)) for row in rows], indent=2))
    print(f"\n{args.preset}, W={args.world_size}, rank 0 (fake process group), fp32 on the wire")
    print("| bucket_bytes | buckets | rank 0's Muon shards | buffers | / bucket_bytes | / shards |")
    print("|---:|---:|---:|---:|---:|---:|")
    for mib, buckets, own, buffers in rows:
        print(
            f"| {mib:g} MiB | {buckets} | {own / MIB:.1f} MiB | {buffers / MIB:.1f} MiB | "
            f"{buffers / (mib * MIB):.2f} | {buffers / own:.2f} |"
        )


if __name__ == "__main__":
    main()
