"""overlap_backward on an emulated link: end-to-end steps and the optimizer time left exposed.

Loopback hides the network, so every ``all_to_all_single`` (only DMuonFSDP's exchanges use it;
FSDP2 reduce-scatters and all-gathers) completes ``--latency-ms + bytes / --link-gbs`` of wall
time after its launch at the earliest: its work's ``wait`` sleeps out the rest and
``is_completed`` is False until then, so the delay costs no CPU. Spawned CPU ranks (gloo, one
thread each) train the recipe model (FSDP2, one unit per block, ``param_groups``) with AdamW,
DMuonFSDP's plain step (at its default bucket size and at ``--bucket-mib``) and with
``overlap_backward=True`` (at ``--bucket-mib``), taking turns step by step at every latency.

Reported per latency, medians over ``--steps`` (after ``--warmup``): the end-to-end step
(forward + backward + ``step``), the exposed optimizer time (end-to-end minus AdamW's forward +
backward, whose median over every latency is the baseline: AdamW moves nothing on the link),
the time of the ``step()`` call and the buckets started in backward. The clipped contenders
clip every step to a norm every step exceeds, so the overlap redoes every step: its cost, with
``dmuon_fsdp.clip_grad_norm_`` (the redo known on the host) and with torch's (seen on the
device only).

    python -m benchmarks.bench_overlap --world-size 2 --latency-ms 0 10 50
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP, clip_grad_norm_, param_groups
from dmuon_fsdp._step import comm
from recipes.model import ModelConfig, Transformer, preset
from recipes.stop import let_threads_run

# The plain step at its default buckets and at --bucket-mib, the overlap at --bucket-mib; both
# also clipped every step, which makes the overlap redo every step: clipped with
# dmuon_fsdp.clip_grad_norm_ (the redo is known on the host: the first attempt skips its NS) and
# with torch's (seen only on the device: the first attempt runs its NS).
CONTENDERS = (
    "adamw",
    "dmuon",
    "dmuon-small-buckets",
    "dmuon-overlap",
    "dmuon-clipped",
    "dmuon-overlap-clipped",
    "dmuon-overlap-torch-clip",
)
CLIPS: dict[str, Callable[[Iterable[torch.Tensor], float], torch.Tensor]] = {
    "dmuon-clipped": torch.nn.utils.clip_grad_norm_,
    "dmuon-overlap-clipped": clip_grad_norm_,
    "dmuon-overlap-torch-clip": torch.nn.utils.clip_grad_norm_,
}


class DelayedWork:
    """A collective's work that completes no sooner than ``ready_at`` (time.monotonic)."""

    def __init__(self, work: dist.Work, ready_at: float) -> None:
        self.work, self.ready_at = work, ready_at

    def wait(self, *args: Any) -> bool:
        self.work.wait(*args)
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return True

    def is_completed(self) -> bool:
        return time.monotonic() >= self.ready_at and self.work.is_completed()


class EmulatedLink:
    """Wraps ``dist.all_to_all_single`` while ``latency_s`` is set (None: the real call)."""

    def __init__(self, gbs: float) -> None:
        self.gbs, self.original = gbs, dist.all_to_all_single
        self.latency_s: float | None = None
        cast(Any, dist).all_to_all_single = self.call  # (Any: torch's signature differs by release)

    def call(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> dist.Work | DelayedWork | bool:
        work = self.original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=True)
        assert work is not None  # (async_op=True)
        if self.latency_s is None:
            return work if async_op else work.wait()
        moved = max(input.numel(), output.numel()) * input.element_size()
        delayed = DelayedWork(work, time.monotonic() + self.latency_s + moved / (self.gbs * 1e9))
        return delayed if async_op else delayed.wait()


def contenders(
    cfg: ModelConfig, mesh: DeviceMesh, bucket_bytes: int
) -> dict[str, tuple[Transformer, torch.optim.Optimizer]]:
    """name -> (model, optimizer), each model sharded by FSDP2 one block per unit, alike."""
    out: dict[str, tuple[Transformer, torch.optim.Optimizer]] = {}
    for name in CONTENDERS:
        torch.manual_seed(0)
        model = Transformer(cfg)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt: torch.optim.Optimizer
        if name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95))
        else:
            small: dict[str, Any] = (
                dict(bucket_bytes=bucket_bytes) if "overlap" in name or "small" in name else {}
            )
            opt = DMuonFSDP(param_groups(model), overlap_backward="overlap" in name, **small)
        out[name] = (model, opt)
    return out


def timed_step(
    model: Transformer,
    opt: torch.optim.Optimizer,
    tokens: torch.Tensor,
    clip: Callable[[Iterable[torch.Tensor], float], torch.Tensor] | None,
) -> tuple[float, float, int]:
    """(forward + backward seconds, clip + step seconds, buckets started in backward); ``clip``:
    None, or a clip_grad_norm_ to call with a norm every step exceeds."""
    start = time.perf_counter()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    middle = time.perf_counter()
    if clip is not None:
        clip(model.parameters(), 1e-3)
    opt.step()
    end = time.perf_counter()
    opt.zero_grad()
    stats = getattr(opt, "last_step_stats", None)
    return middle - start, end - middle, stats.started_in_backward if stats is not None else 0


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    cfg = preset(args.preset)
    link = EmulatedLink(args.link_gbs)
    runs = contenders(cfg, init_device_mesh("cpu", (world,)), int(args.bucket_mib * 2**20))
    gen = torch.Generator().manual_seed(rank)
    samples: dict = {}
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1), generator=gen)
        for latency in args.latency_ms:
            link.latency_s = latency / 1000
            for name, (model, opt) in runs.items():
                comm.all_max(torch.zeros(1), None)  # ranks start each contender's step together
                result = timed_step(model, opt, tokens, CLIPS.get(name))
                if step >= args.warmup:
                    samples.setdefault((latency, name), []).append(result)
    link.latency_s = None
    overlap = runs["dmuon-overlap"][1]
    assert isinstance(overlap, DMuonFSDP) and overlap.plan is not None  # (a DMuonFSDP that has stepped)
    buckets = len(overlap.plan.buckets)
    if rank == 0:
        report(args, samples, buckets)
    comm.all_max(torch.zeros(1), None)
    let_threads_run()  # gloo's threads drop the tensors of plain collectives first
    dist.destroy_process_group()


def report(args: argparse.Namespace, samples: dict, buckets: int) -> None:
    def median_ms(values: list[float]) -> float:
        return 1000 * statistics.median(values)

    # AdamW runs no all-to-all: its forward + backward over every latency is one baseline.
    base = median_ms([fb for latency in args.latency_ms for fb, _, _ in samples[(latency, "adamw")]])
    rows = []
    for latency in args.latency_ms:
        for name in CONTENDERS:
            got = samples[(latency, name)]
            e2e = median_ms([fb + st for fb, st, _ in got])
            rows.append(
                {
                    "latency_ms": latency,
                    "optimizer": name,
                    "end_to_end_ms": round(e2e, 1),
                    "forward_backward_ms": round(median_ms([fb for fb, _, _ in got]), 1),
                    "step_ms": round(median_ms([st for _, st, _ in got]), 1),
                    "exposed_ms": round(e2e - base, 1),
                    "started_in_backward": min(s for _, _, s in got),
                }
            )
    print(
        f"preset {args.preset}, W={args.world_size}, fp32, batch {args.batch_size}, link "
        f"{args.link_gbs} GB/s + latency per exchange; --bucket-mib {args.bucket_mib} ({buckets} buckets "
        f"with the overlap); medians of {args.steps} steps each, taking turns"
    )
    columns = {
        "latency_ms": "latency",
        "optimizer": "optimizer",
        "end_to_end_ms": "e2e ms",
        "forward_backward_ms": "fwd+bwd",
        "step_ms": "step",
        "exposed_ms": "exposed",
        "started_in_backward": "in bwd",
    }
    widths = {key: 20 if key == "optimizer" else 8 for key in columns}
    print(" ".join(f"{label:>{widths[key]}}" for key, label in columns.items()))
    for r in rows:
        print(" ".join(f"{r[key]!s:>{widths[key]}}" for key in columns))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "buckets": buckets, "rows": rows}, indent=1))
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="cpu-bench")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, nargs="+", default=[0, 10, 50])
    parser.add_argument("--link-gbs", type=float, default=1.0, help="emulated link, GB/s per direction")
    parser.add_argument(
        "--bucket-mib",
        type=float,
        default=1.0,
        help="buckets of the overlap and of the second plain run",
    )
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/overlap.json")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world_size, port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
