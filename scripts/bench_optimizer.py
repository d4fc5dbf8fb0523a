"""Optimizer step time of DMuonFSDP vs AdamW, gather-all Muon and torch.optim.Muon on FSDP2.

Every contender steps the same FSDP2-sharded parameters with the same gradients. Reports, per
contender, the median over timed steps of the slowest rank's step time, and ratios against
DMuonFSDP measured in the same run.

    python scripts/bench_optimizer.py --world-size 2 --dim 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dmuon_fsdp import DMuonFSDP  # noqa: E402
from gather_muon import GatherAllMuon  # noqa: E402


class Block(nn.Module):
    """Llama-shaped matrices (q, k, v, o, gate, up, down) and a norm vector; only its parameters
    matter here, the benchmark sets gradients directly."""

    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.linears = nn.ModuleDict({n: nn.Linear(dim, dim, bias=False) for n in ("q", "k", "v", "o")})
        self.linears.update({n: nn.Linear(dim, ffn, bias=False) for n in ("gate", "up")})
        self.linears["down"] = nn.Linear(ffn, dim, bias=False)
        self.norm = nn.LayerNorm(dim, bias=False)

    def forward(self, x):
        raise NotImplementedError


class Stack(nn.Module):
    def __init__(self, dim: int, layers: int, ffn: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, ffn) for _ in range(layers))

    def forward(self, x):
        raise NotImplementedError


def make_optimizer(name: str, params, dtype: torch.dtype):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    muon = [p for p in params if p.ndim >= 2]
    adamw = [p for p in params if p.ndim < 2]
    if name == "dmuon":
        return DMuonFSDP(params, ns_dtype=dtype)
    if name == "dmuon-no-overlap":
        return DMuonFSDP(params, ns_dtype=dtype, overlap=False)
    if name == "gather-muon":
        return [GatherAllMuon(muon, ns_dtype=dtype), torch.optim.AdamW(adamw, foreach=True)]
    if name == "torch-muon":
        return [torch.optim.Muon(muon), torch.optim.AdamW(adamw, foreach=True)]
    raise ValueError(name)


def worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world_size)  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    model = Stack(args.dim, args.layers, args.ffn).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    params = list(model.parameters())
    results = {}
    for name in args.contenders:
        steps = args.slow_steps if name == "torch-muon" and not cuda else args.steps
        opts = make_optimizer(name, params, dtype)
        opts = opts if isinstance(opts, list) else [opts]
        torch.manual_seed(1)
        for p in params:
            p.grad = torch.randn_like(p)
        times = []
        for i in range(args.warmup + steps):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for opt in opts:
                opt.step()
            if cuda:
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times.append(elapsed.item())
        results[name] = {"median_s": statistics.median(times), "min_s": min(times),
                         "max_s": max(times), "steps": steps}  # fmt: skip
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--slow-steps", type=int, default=2, help="timed steps of torch-muon on CPU (bf16 NS)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--contenders", nargs="+",
                        default=["adamw", "dmuon", "dmuon-no-overlap", "gather-muon", "torch-muon"])  # fmt: skip
    parser.add_argument("--out", default="runs/bench_optimizer.json")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world_size, port, args, args.out), nprocs=args.world_size)
    with open(args.out) as f:
        results = json.load(f)
    base = results.get("dmuon", {}).get("median_s")
    print(f"\nOptimizer step, W={args.world_size}, dim={args.dim}, ffn={args.ffn}, layers={args.layers} "
          f"(median of slowest rank; {args.threads} thread(s) per rank)\n")  # fmt: skip
    print("| contender | median ms | min ms | max ms | steps | time / DMuonFSDP |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        ratio = f"{r['median_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} "
              f"| {r['steps']} | {ratio} |")  # fmt: skip
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
