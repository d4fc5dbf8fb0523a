"""A short multi-rank demo: a byte-level language model trained with FSDP2 + DMuonFSDP or AdamW.

The corpus is the Python standard library's own source (no download). Run under torchrun:

    torchrun --nproc-per-node 2 scripts/demo_train.py --optimizer dmuon

Prints the loss as it trains and, at the end, the validation loss and the median optimizer step
time. The full pretraining recipe (Llama-style model, checkpoints) is tracked separately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP, param_groups


def stdlib_bytes(limit: int) -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    data = bytearray()
    for path in files:
        data += path.read_bytes()
        if len(data) >= limit:
            break
    return torch.tensor(list(data[:limit]), dtype=torch.long)


class ByteMLP(nn.Module):
    """Predicts the next byte from the previous ``context`` bytes."""

    def __init__(self, context: int, dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.inp = nn.Linear(context * dim, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()) for _ in range(layers)
        )
        self.head = nn.Linear(hidden, 256)

    def forward(self, x):
        h = F.gelu(self.inp(self.embed(x).flatten(1)))
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def batches(data: torch.Tensor, context: int, batch: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(context + 1)
        window = data[idx]
        yield window[:, :-1], window[:, -1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", choices=["dmuon", "adamw"], default="dmuon")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64, help="sequences per rank per step")
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--out", default="runs/demo")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    model = ByteMLP(args.context, dim=32, hidden=384, layers=3).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if args.optimizer == "dmuon":
        opt = DMuonFSDP(param_groups(model, lr=args.lr or 0.02), adamw_lr=3e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / args.steps))

    data = stdlib_bytes(4_000_000)
    split = int(len(data) * 0.9)
    train = batches(data[:split], args.context, args.batch, torch.Generator().manual_seed(1 + rank))
    val = batches(data[split:], args.context, 512, torch.Generator().manual_seed(1000))
    opt_times = []
    for step in range(args.steps):
        x, y = next(train)
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        start = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        opt_times.append(time.perf_counter() - start)
        opt.zero_grad()
        sched.step()
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"[{args.optimizer}] step {step:4d} train loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        x, y = next(val)
        val_loss = F.cross_entropy(model(x.to(device)), y.to(device)).item()
    if rank == 0:
        result = {"optimizer": args.optimizer, "world_size": world, "steps": args.steps, "val_loss": val_loss,
                  "median_opt_step_ms": 1e3 * statistics.median(opt_times[5:])}  # fmt: skip
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.optimizer}.json"), "w") as f:
            json.dump(result, f)
        print(f"[{args.optimizer}] validation loss {val_loss:.4f}, median optimizer step "
              f"{result['median_opt_step_ms']:.2f} ms", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
