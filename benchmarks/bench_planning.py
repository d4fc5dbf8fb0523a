"""Planning at the scale of the job: the time and host memory of one rank's plan for Llama-3 70B
on W = 16384 ranks, flat FSDP and HSDP 2048 x 8 (and any other --meshes), one process standing
for one rank of the job under torch's fake process group.

What is timed is planning as the optimizer does it at its first step
(``dmuon_fsdp._step.planning``): every rank's piece of each Muon matrix read from the parameters'
DTensor placements (``layouts.describe_params``), owners, buckets and relays (``planner.build_plan``),
and this rank's wire schedule (``schedule.rank_schedule``); memory is the peak of Python's
allocations meanwhile (``tracemalloc``), beyond what the parameters hold. The parameters are
DTensors made from their local shards alone (70B at W=16384: a few MB per rank), so nothing
global is ever allocated.

    python -m benchmarks.bench_planning                       # 70B: 1 x 16384 and 2048 x 8
    python -m benchmarks.bench_planning --meshes 1x1024 8x128 --model llama3-8b
    python -m benchmarks.bench_planning --before ec845b2      # also the package at that revision
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.emulate_scale import export
from benchmarks.paper.shapes import MODELS


def parameters(model: str, mesh: object) -> list[torch.Tensor]:
    """The model's matrices as DTensors of ``mesh`` (rows sharded over its last dim, replicated
    over the others), made from this rank's local shard alone."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    assert isinstance(mesh, DeviceMesh)
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    out: list[torch.Tensor] = []
    local_of: dict[tuple[int, int], torch.Tensor] = {}
    for rows, cols in MODELS[model]:
        if (rows, cols) not in local_of:
            shape, _ = compute_local_shape_and_global_offset((rows, cols), mesh, placements)
            local_of[rows, cols] = torch.empty(shape)
        full = torch.Size((rows, cols))
        out.append(DTensor.from_local(local_of[rows, cols], mesh, placements, shape=full, stride=(cols, 1)))
    return out


def plan_once(model: str, replicas: int, shards: int, rank: int, traced: bool) -> dict:
    """One rank's planning of ``model`` on an R x S mesh (R = 1: flat), timed, or measured
    (``traced``); run in a process of its own (``in_process``: no cache of the package warm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dmuon_fsdp._step.layouts import describe_params
    from dmuon_fsdp._step.planner import build_plan
    from dmuon_fsdp._step.schedule import rank_schedule
    from dmuon_fsdp.newton_schulz import segments_flops, standard_segments

    torch.set_num_threads(1)
    world = replicas * shards
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        shape = (replicas, shards) if replicas > 1 else (world,)
        mesh = init_device_mesh("cpu", shape)
        params = parameters(model, mesh)
        group = {"flatten": True, "split_sizes": None, "num_heads": None}
        described = [(p, f"layers.{i}", group) for i, p in enumerate(params)]
        costs = [segments_flops(rows, cols, standard_segments(5)) for rows, cols in MODELS[model]]

        gc.collect()
        if traced:  # (memory in a process of its own: tracing slows Python down)
            tracemalloc.start()
        started = time.perf_counter()
        layouts, param_of = describe_params(described, list(range(world)))
        described_s = time.perf_counter() - started
        plan = build_plan(layouts, costs, world, 128 * 2**20, 2, param_of, 1e4)  # (bf16 wire)
        planned_s = time.perf_counter() - started - described_s
        schedule = rank_schedule(plan, rank, list(range(world)))
        seconds = time.perf_counter() - started
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
        tracemalloc.stop()
        return {
            "mesh": f"{replicas}x{shards}",
            "world": world,
            "matrices": len(layouts),
            "buckets": len(plan.buckets),
            "relays": len(getattr(plan, "relays", ())),  # (none before the relay)
            "transfers": sum(len(seg) for wire in _wires(schedule) for seg in wire.send),
            "layouts_s": described_s,
            "plan_s": planned_s,
            "schedule_s": seconds - described_s - planned_s,
            "seconds": seconds,
            "peak_mb": peak / 2**20,
        }
    finally:
        dist.destroy_process_group()


def _wires(schedule: Any) -> list[Any]:
    if hasattr(schedule, "wires"):
        return list(schedule.wires)
    ways = [w for b in schedule.buckets for w in (b.to_owners, b.from_owners)]  # (before the relay)
    return [w for w in ways if w is not None]


def in_process(model: str, replicas: int, shards: int, rank: int, traced: bool, package: str | None) -> dict:
    """``plan_once`` in a new process (that imports ``package``, a folder holding ``dmuon_fsdp``,
    before this checkout's)."""
    code = (
        f"import json, sys; sys.path.insert(0, {package!r}) if {package!r} else None; "
        "from benchmarks.bench_planning import plan_once; "
        f"print(json.dumps(plan_once({model!r}, {replicas}, {shards}, {rank}, {traced})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"planning failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama3-70b", choices=list(MODELS))
    parser.add_argument("--meshes", nargs="+", default=["1x16384", "2048x8"], help="replicas x shards")
    parser.add_argument("--rank", type=int, default=None, help="the rank planned (default: the last)")
    parser.add_argument("--before", default=None, help="also the package at this git revision")
    parser.add_argument("--out", default="runs/bench/planning.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"## Planning {args.model}: one rank, fake process group\n")
    columns = ["R x S", "package", "W", "matrices", "buckets", "relays", "transfers", "layouts s", "plan s"]
    print("| " + " | ".join([*columns, "schedule s", "total s", "peak MB"]) + " |")
    print("|---|---|" + "---:|" * 10)
    packages = ([("before", export(args.before))] if args.before else []) + [("after", None)]
    for text in args.meshes:
        replicas, shards = (int(n) for n in text.split("x"))
        rank = args.rank if args.rank is not None else replicas * shards - 1
        for label, package in packages:
            r = in_process(args.model, replicas, shards, rank, False, package)
            r["peak_mb"] = in_process(args.model, replicas, shards, rank, True, package)["peak_mb"]
            r["package"] = label
            rows.append(r)
            counts = [
                r[k] for k in ("mesh", "package", "world", "matrices", "buckets", "relays", "transfers")
            ]
            times = [f"{r[k]:.2f}" for k in ("layouts_s", "plan_s", "schedule_s", "seconds")]
            print("| " + " | ".join(map(str, [*counts, *times, f"{r['peak_mb']:.0f}"])) + " |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
