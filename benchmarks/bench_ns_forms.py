"""Standard against Gram Newton-Schulz: per matrix shape on one device, and the whole DMuonFSDP step.

Shapes (default): for every distinct Muon matrix shape of the presets, the NS of a stack of such
matrices (as the owner rank batches them) in the standard form and in the Gram form
(``ns_algorithm="gram"``: its restarts for the dtype), timed in one run, the two forms taking
turns, best of --repeats each.
Prints flops, times and both ratios (standard / Gram); "time / flop ratio" below 1 means the
Gram form's s x s products run slower per flop than the standard form's products.

Step (--step): the FSDP2-sharded preset model on --world-size ranks, one DMuonFSDP per
--algorithms entry stepping the same parameters, steps interleaved (the order alternates every
round, so drift of the machine hits all alike), median of the slowest rank's step time, and
each optimizer's NS flops on the busiest rank.

    python -m benchmarks.bench_ns_forms --presets cpu-bench 124m 1b --dtype float32
    python -m benchmarks.bench_ns_forms --step --preset cpu-bench --world-size 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench_optimizer import sharded_model
from benchmarks.matmul_floor import sync
from dmuon_fsdp import DMuonFSDP, param_groups
from dmuon_fsdp._step import comm
from dmuon_fsdp.config import NS_ALGORITHMS
from dmuon_fsdp.newton_schulz import (
    MUON_COEFFICIENTS,
    Coefficients,
    Workspace,
    default_ns_dtype,
    ns_segments,
    orthogonalize_,
    resolve_coefficients,
    segments_flops,
)
from recipes.model import PRESETS, Transformer, preset
from recipes.stop import let_threads_run


def preset_shapes(name: str) -> Counter:
    """(short side, long side) -> count of the preset's Muon matrices (built on the meta device)."""
    with torch.device("meta"):
        model = Transformer(preset(name))
    return Counter((min(p.shape), max(p.shape)) for _, p in param_groups(model)[0]["params"])


def ns_seconds(
    stack: torch.Tensor,
    coefficients: Sequence[Coefficients],
    forms: dict[str, tuple[int, ...]],
    repeats: int,
) -> dict[str, float]:
    """Best time of ``orthogonalize_`` on a copy of ``stack`` (the copy is not timed) per form,
    the forms taking turns so that the machine's drift hits them alike."""
    x = torch.empty_like(stack)
    works = {name: Workspace.for_stack(x, segments) for name, segments in forms.items()}
    best = dict.fromkeys(forms, float("inf"))
    for i in range(repeats + 1):  # the first round warms up
        for name, segments in forms.items():
            x.copy_(stack)
            sync(stack.device)
            start = time.perf_counter()
            orthogonalize_(x, coefficients, 1e-7, works[name], segments)
            sync(stack.device)
            if i:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def shape_table(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    coefficients = resolve_coefficients(MUON_COEFFICIENTS, args.ns_steps)
    rows = []
    for name in args.presets:
        for (s, l), count in sorted(preset_shapes(name).items()):
            batch = min(count, args.max_batch)
            stack = torch.randn(batch, s, l, device=device).to(dtype)
            forms = {alg: ns_segments(alg, coefficients, dtype, s, l) for alg in ("standard", "gram")}
            seconds = ns_seconds(stack, coefficients, forms, args.repeats)
            flops = {alg: batch * segments_flops(s, l, seg) for alg, seg in forms.items()}
            rows.append(
                {
                    "preset": name,
                    "shape": (s, l),
                    "batch": batch,
                    "segments": forms,
                    "flops": flops,
                    "seconds": seconds,
                    "auto": ns_segments("auto", coefficients, dtype, s, l) == forms["gram"],
                }
            )
            r = rows[-1]
            print(
                f"| {name} | {s} x {l} | {batch} | {forms['gram']} | {flops['standard'] / 1e9:.2f} | "
                f"{flops['gram'] / 1e9:.2f} | {seconds['standard'] * 1e3:.1f} | {seconds['gram'] * 1e3:.1f} "
                "| "
                f"{_ratio(r, 'flops'):.2f} | {_ratio(r, 'seconds'):.2f} | "
                f"{_ratio(r, 'seconds') / _ratio(r, 'flops'):.2f} | {'gram' if r['auto'] else 'standard'} |",
                flush=True,
            )
    return rows


def _ratio(row: dict, key: str) -> float:
    return row[key]["standard"] / row[key]["gram"]


def step_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    device, model = sharded_model(rank, world, port, args.preset, args.cpu, threads=1)
    dtype = getattr(torch, args.dtype) if args.dtype else default_ns_dtype(device)
    optimizers = {
        alg: DMuonFSDP(param_groups(model), ns_algorithm=alg, ns_dtype=dtype) for alg in args.algorithms
    }
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    samples: dict[str, list[float]] = {alg: [] for alg in args.algorithms}
    for i in range(args.warmup + args.steps):
        order = args.algorithms if i % 2 == 0 else args.algorithms[::-1]
        for alg in order:
            dist.barrier()
            sync(device)
            start = time.perf_counter()
            optimizers[alg].step()
            sync(device)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            comm.all_max(took, None)  # settled, as bench_optimizer's reductions
            if i >= args.warmup:
                samples[alg].append(took.item())
    flops: dict[str, float] = {}
    for alg, opt in optimizers.items():
        assert opt.last_step_stats is not None  # (every optimizer has stepped)
        mine = torch.tensor([opt.last_step_stats.ns_flops], dtype=torch.float64, device=device)
        flops[alg] = comm.all_max(mine, None).item()
    if rank == 0:
        result: dict[str, dict[str, float | int | str]] = {
            alg: {"median_s": statistics.median(v), "min_s": min(v), "busiest_ns_flops": flops[alg]}
            for alg, v in samples.items()
        }
        result["meta"] = {
            "preset": args.preset,
            "world_size": world,
            "device": str(device),
            "dtype": str(dtype),
            "steps": args.steps,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    let_threads_run()  # gloo's threads drop the tensors of plain collectives first
    dist.destroy_process_group()


def step_report(result: dict) -> None:
    meta = result.pop("meta")
    base = result[next(iter(result))]
    print(
        f"\n## DMuonFSDP step by ns_algorithm, preset {meta['preset']}, W={meta['world_size']}, "
        f"{meta['device']}, "
        f"NS in {meta['dtype']}, {meta['steps']} interleaved steps\n"
    )
    first = next(iter(result))
    print(
        f"| ns_algorithm | median ms | min ms | busiest rank NS GFLOP | {first} / this (time) | {first} / "
        "this (flops) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for alg, r in result.items():
        print(
            f"| {alg} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
            f"{r['busiest_ns_flops'] / 1e9:.3f} | "
            f"{base['median_s'] / r['median_s']:.2f}x | "
            f"{base['busiest_ns_flops'] / r['busiest_ns_flops']:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", nargs="+", default=["cpu-bench", "124m", "1b"], choices=sorted(PRESETS))
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="NS dtype (default: bf16 on CUDA, fp32 on CPU)",
    )
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--max-batch", type=int, default=4, help="matrices per stack at most (shapes mode)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape and form (shapes mode)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the shapes mode on CPU: 1, as each rank runs (2 threads on this "
        "2-core machine moved the ratios by 30%% between runs)",
    )
    parser.add_argument("--step", action="store_true", help="time the whole DMuonFSDP step instead")
    parser.add_argument("--preset", default="cpu-bench", choices=sorted(PRESETS), help="model of --step")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--algorithms", nargs="+", default=["standard", "auto"], choices=NS_ALGORITHMS)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is present")
    parser.add_argument("--out", default="runs/bench/ns_forms.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    if args.step:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(step_worker, args=(args.world_size, port, args), nprocs=args.world_size)
        step_report(json.loads(out.read_text()))
        print(f"\nJSON: {out}")
        return
    device = torch.device("cuda") if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else default_ns_dtype(device)
    print(
        f"## Newton-Schulz per shape, {args.ns_steps} iterations, {dtype}, {device} "
        f"({torch.get_num_threads()} threads), best of {args.repeats}\n"
    )
    print(
        "| preset | shape (s x l) | batch | Gram segments | standard GFLOP | Gram GFLOP | standard ms | "
        "Gram ms "
        "| flop ratio | time ratio | time / flop ratio | auto picks |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    rows = shape_table(args, device, dtype)
    out.write_text(json.dumps({"device": str(device), "dtype": str(dtype), "rows": rows}, indent=2))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
