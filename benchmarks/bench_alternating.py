"""A model whose set of parameters with gradients alternates, against the same model without.

Spawned CPU ranks (gloo, one thread each) hold two copies of one FSDP2 model: a trunk of
``--layers`` square Linear layers and two branches, each a layer of ``--experts`` experts (stacks
``[E, hidden, dim]`` and ``[E, dim, hidden]``, orthogonalized per expert), as MoE blocks used on
some steps or conditional branches. Each copy has its own DMuonFSDP. The ``fixed`` copy runs the
trunk and branch A every step; the ``alternating`` copy runs branch A on even steps and branch B
on odd ones, so its gradient set (the step key) changes every step while the work per step is
the same. The copies take turns step by step; each ``opt.step()`` is timed (medians over
``--steps`` after ``--warmup``), and the collectives each step launches are counted (a rebuilt
program shows as a plan-agreement ``all_reduce`` and a wasted exchange). Memory: the buffers of
the step programs rank 0 keeps (``StepStats.buffer_bytes``; the alternating copy keeps one per
gradient set) against its optimizer state (local shards).

    python -m benchmarks.bench_alternating --world-size 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP, StepStats
from dmuon_fsdp._step import comm
from dmuon_fsdp._step.state import local_shard
from instruments.counters import CollectiveCalls
from recipes.stop import let_threads_run


class Experts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # every expert sees every token
        return torch.einsum("eoh,ebh->bo", self.w_out, torch.relu(torch.einsum("ehd,bd->ebh", self.w_in, x)))


class Branched(nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.ModuleList(nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.layers))
        self.branches = nn.ModuleList(Experts(args.experts, args.dim, args.hidden) for _ in range(2))

    def forward(self, x: torch.Tensor, branch: int) -> torch.Tensor:
        for layer in self.trunk:
            x = torch.relu(layer(x))
        return self.branches[branch](x)

    def groups(self) -> list[dict]:
        return [{"params": self.trunk.parameters()}, {"params": self.branches.parameters(), "flatten": False}]


def last_stats(opt: DMuonFSDP) -> StepStats:
    """``opt.last_step_stats`` of an optimizer that has stepped."""
    assert opt.last_step_stats is not None  # (set by opt's first step)
    return opt.last_step_stats


def run(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    runs = {}
    for name in ("fixed", "alternating"):
        model = Branched(args)
        for module in [*model.trunk, *model.branches]:
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs[name] = (model, DMuonFSDP(model.groups(), ns_dtype=torch.float32))
    times: dict[str, list[float]] = {name: [] for name in runs}
    calls: dict[str, list[dict[str, int]]] = {name: [] for name in runs}
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))
    for step in range(args.warmup + args.steps):
        for name, (model, opt) in runs.items():
            branch = step % 2 if name == "alternating" else 0
            model(x, branch).square().mean().backward()
            with CollectiveCalls() as counted:
                start = time.perf_counter()
                opt.step()
                elapsed = time.perf_counter() - start
            opt.zero_grad()
            if step >= args.warmup:
                times[name].append(elapsed)
                calls[name].append(dict(counted.calls))
    comm.all_max(torch.zeros(1), None)  # the last collective settles before the group goes
    let_threads_run()  # gloo's threads drop the tensors of plain collectives first
    dist.destroy_process_group()
    if rank == 0:
        result = {
            name: {
                "step_ms": statistics.median(t) * 1e3,
                "calls": calls[name][-1],
                "buffer_mib": last_stats(runs[name][1]).buffer_bytes / 2**20,
                "state_mib": sum(
                    local_shard(v).numel() * v.element_size()
                    for st in runs[name][1].state.values()
                    for v in st.values()
                )
                / 2**20,
            }
            for name, t in times.items()
        }
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--out", default="runs/bench/alternating.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.world_size, port, args, str(out)), nprocs=args.world_size)
    result = json.loads(out.read_text())
    print(
        f"\nW={args.world_size}, dim {args.dim}, {args.layers} trunk layers, 2 branches of {args.experts} "
        f"experts (hidden {args.hidden}), medians of {args.steps} steps"
    )
    print("| contender | opt.step ms | collectives in the last step | program buffers, MiB | state, MiB |")
    print("|---|---:|---|---|---:|")
    for name, r in result.items():
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items()) if v)
        print(f"| {name} | {r['step_ms']:.2f} | {calls} | {r['buffer_mib']:.2f} | {r['state_mib']:.2f} |")
    print(f"\nalternating / fixed: {result['alternating']['step_ms'] / result['fixed']['step_ms']:.2f}x")


if __name__ == "__main__":
    main()
