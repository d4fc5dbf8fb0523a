"""bf16 weights under DDP: where the float32 main weights live, and what they cost a step.

A pi0-shaped policy (``recipes.policy``, routed by its ``routing()``) in bfloat16 under DDP-style
replication (plain tensors, every rank a replica), stepped by DMuonFSDP with ``main_weights`` on
and off, the two taking turns step by step on the same random gradients, in one run (spawned CPU
ranks with gloo). Reported per rank: the bytes of the main weights it holds, against what holding
them on every rank would take (4 bytes per element of every 16-bit parameter: Megatron's and
DeepSpeed's float32 main weights under plain data parallelism), and the median step time of each
contender with their ratio.

    python -m benchmarks.bench_main_weights --world-size 2 --preset small
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dmuon_fsdp import DMuonFSDP, param_groups
from recipes.policy import Policy, preset

LOW = (torch.bfloat16, torch.float16)


def _rank(rank: int, world: int, port: int, name: str, steps: int, queue: mp.SimpleQueue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        runs: list[tuple[Policy, DMuonFSDP, list[float]]] = []
        for main_weights in (True, False):
            torch.manual_seed(0)
            policy = Policy(preset(name)).to(torch.bfloat16)
            routing = policy.routing()
            groups = param_groups(policy, head=routing["head"], adamw=routing["adamw"])
            opt = DMuonFSDP(groups, lr=2e-3, main_weights=main_weights)
            runs.append((policy, opt, []))
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            for policy, opt, times in runs:
                for p in policy.parameters():
                    p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
                gen.manual_seed(step)  # (the same gradients for both)
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
        policy, opt, _ = runs[0]
        held = sum(s["main_weight"].nbytes for s in opt.state.values() if "main_weight" in s)
        everywhere = sum(4 * p.numel() for p in policy.parameters() if p.dtype in LOW)
        medians = [statistics.median(times[2:]) for _, _, times in runs]
        queue.put((rank, held, everywhere, medians))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, (args.world_size, port, args.preset, args.steps, queue), nprocs=args.world_size)
    rows = sorted(queue.get() for _ in range(args.world_size))
    mib = 2**20
    print(f"preset {args.preset}, DDP over {args.world_size} CPU ranks, bf16 weights, {args.steps} steps")
    print(
        "rank | main weights held (MiB) | on every rank (MiB) | held / every rank | step on / off (ms) | "
        "ratio"
    )
    for rank, held, everywhere, (on, off) in rows:
        print(
            f"{rank:4d} | {held / mib:23.2f} | {everywhere / mib:19.2f} | {held / everywhere:17.3f} | "
            f"{1e3 * on:7.1f} / {1e3 * off:7.1f} | {on / off:5.2f}"
        )


if __name__ == "__main__":
    main()
