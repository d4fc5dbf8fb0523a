"""Host work of one optimizer step: aten ops dispatched, device-to-host reads and host time.

Builds the recipe's decoder with the 124M structure (12 blocks of q, k, v, o, gate, up, down and
two norms, plus embedding, head and final norm: 111 parameters) at tiny dims (``DIMS``: model
width 16, GQA with 2 query and 1 key/value heads, MLP width 32), so that Newton-Schulz costs next
to nothing and the step is host work (Python, dispatch, launches).
DMuonFSDP (``param_groups`` routing, default settings; also with ``check_grads=False,
nonfinite="ignore"``, and with ``variant="normuon"``) is compared with fused ``torch.optim.AdamW``
on the same parameters, in one run, for:

- W=1: one process, no process group;
- W=2: FSDP2 over gloo, two spawned CPU ranks (the figures are rank 0's);
- W=64 and W=1024: torch's fake process group, one process standing in for rank 0, FSDP2 on a
  CPU mesh of that size; collectives return at once, so only host work is timed;
- the same model with 80 blocks (the 70B structure, 723 parameters) at W=1 and W=2.

Ops are counted with a ``TorchDispatchMode`` over one steady-state ``step()`` (after warm-up
steps); device-to-host reads are ``Tensor.item``/``tolist``/``__bool__`` calls made inside it
(on a CPU these read host memory, but each is a synchronizing read on an accelerator). Host time
is the median wall time of ``step()`` over ``--steps`` steps, contenders interleaved; also
reported without the time spent inside torch.distributed calls (gloo's waits at W=2; with the
fake backend, its per-peer cost of an all-to-all launch).

    python -m benchmarks.bench_host                 # every case, ~1 minute on 2 cores
    python -m benchmarks.bench_host --cases w1 w2   # a subset

The instruments are the ones the tests use (``instruments/counters.py``), so that the tests'
bounds and these figures are counted alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import _disable_current_modes

from dmuon_fsdp import DMuonFSDP, param_groups
from instruments.counters import CollectiveCalls, HostReads, OpCounter
from recipes.model import Transformer, preset
from recipes.stop import let_threads_run

# case -> (world size, process group kind, blocks)
CASES = {
    "w1": (1, None, 12),
    "w2": (2, "gloo", 12),
    "fake64": (64, "fake", 12),
    "fake1024": (1024, "fake", 12),
    "w1-80": (1, None, 80),
    "w2-80": (2, "gloo", 80),
}
DIMS = dict(dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32)
CONTENDERS = {
    "dmuon": lambda model: DMuonFSDP(param_groups(model)),
    "dmuon-nochecks": lambda model: DMuonFSDP(param_groups(model), check_grads=False, nonfinite="ignore"),
    "dmuon-normuon": lambda model: DMuonFSDP(param_groups(model), variant="normuon"),
    "adamw-fused": lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True),
}


def build_model(blocks: int, world: int, kind: str | None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", n_layers=blocks, **DIMS))
    if kind is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def measure(names: list[str], model: torch.nn.Module, steps: int, warmup: int) -> dict:
    """Ops, host reads and host time per step of each contender on the same parameters and
    gradients. Timed in interleaved rounds (each contender a few steps in turn), so that all
    see the same load on a shared machine; the median over every timed step is reported."""
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizers = {name: CONTENDERS[name](model) for name in names}
    result = {}
    for name, opt in optimizers.items():
        for _ in range(warmup):
            opt.step()
        with OpCounter() as counter, HostReads() as reads:
            opt.step()
        top = ", ".join(f"{op} {n}" for op, n in counter.ops.most_common(6))
        result[name] = {
            "ops": sum(counter.ops.values()),
            "host_reads": reads.count,
            "top_ops": top,
            "times": [],
            "in_collectives": [],
        }
    rounds = max(1, steps // 5)
    for _ in range(rounds):
        for name, opt in optimizers.items():
            for _ in range(5):
                with CollectiveCalls() as calls:
                    start = time.perf_counter()
                    opt.step()
                    elapsed = time.perf_counter() - start
                result[name]["times"].append(elapsed)
                result[name]["in_collectives"].append(calls.seconds)
    for name, opt in optimizers.items():
        times, inside = result[name].pop("times"), result[name].pop("in_collectives")
        result[name]["host_ms"] = statistics.median(times) * 1e3
        result[name]["outside_collectives_ms"] = (
            statistics.median(t - c for t, c in zip(times, inside, strict=True)) * 1e3
        )
        if isinstance(opt, DMuonFSDP):  # the Newton-Schulz share, timed separately
            opt.time_phases = True
            ns = []
            for _ in range(10):
                opt.step()
                assert opt.last_step_stats is not None  # (set by the step just taken)
                ns.append(opt.last_step_stats.seconds.get("newton_schulz", 0.0))
            opt.time_phases = False
            result[name]["ns_ms"] = statistics.median(ns) * 1e3
    return result


def mirror_fake_all_to_all() -> None:
    """Make the fake backend's all-to-all write what it would if every peer were this rank.

    What a fake collective writes is the backend's choice (torch 2.14's fills each peer's chunk
    with the rank's own first chunk, 2.15's copies the input over as it is), and the step's
    check flags ride at the head of every chunk: each output chunk gets the head of the rank's
    chunk to itself, so that the checks agree, and the step runs, on any torch."""
    original = dist.all_to_all_single

    def mirrored(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> Any:
        work = original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        if output_split_sizes and input_split_sizes:
            # numpy's views are taken with the op counter off (Tensor.numpy dispatches a detach),
            # and numpy copies, which are faster than torch's per chunk (timed with the step)
            assert output.is_contiguous(), "written in place through a flat view"
            with _disable_current_modes():
                own, out = input.numpy().reshape(-1)[: input_split_sizes[0]], output.numpy().reshape(-1)
            start = 0
            for n in output_split_sizes:
                k = min(n, own.size)
                out[start : start + k] = own[:k]
                start += n
        return work

    cast(Any, dist).all_to_all_single = mirrored  # (Any: torch's signature differs by release)


def run_case(
    rank: int, world: int, kind: str | None, blocks: int, args: argparse.Namespace, out: str
) -> None:
    torch.set_num_threads(1)
    if kind == "gloo":
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world
        )
    elif kind == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        mirror_fake_all_to_all()
    try:
        model = build_model(blocks, world, kind)
        result = measure(args.contenders, model, args.steps, args.warmup)
        result["params"] = sum(1 for _ in model.parameters())
    finally:
        if dist.is_initialized():
            let_threads_run()  # gloo's threads drop the tensors of plain collectives first
            dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--steps", type=int, default=200, help="timed steps per contender")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="runs/bench/host.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in args.cases:
        world, kind, blocks = CASES[case]
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
        part = out.with_name(f"host_{case}.json")
        nprocs = world if kind == "gloo" else 1
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(run_case, args=(world, kind, blocks, args, str(part)), nprocs=nprocs)
        results[case] = json.loads(part.read_text())
        part.unlink()
    out.write_text(json.dumps(results, indent=2))
    report(results)


def report(results: dict) -> None:
    names = [n for n in CONTENDERS if all(n in r for r in results.values())]
    print("\n| case | params | " + " | ".join(f"{n} ops | reads | host ms" for n in names) + " |")
    print("|---|---:|" + "---:|---:|---:|" * len(names))
    for case, r in results.items():
        cells = " | ".join(f"{r[n]['ops']} | {r[n]['host_reads']} | {r[n]['host_ms']:.3f}" for n in names)
        print(f"| {case} | {r['params']} | {cells} |")
    ns = [f"{case} {r['dmuon']['ns_ms']:.3f}" for case, r in results.items() if "ns_ms" in r.get("dmuon", {})]
    print("\nof which Newton-Schulz (dmuon, ms, timed with time_phases): " + ", ".join(ns))
    outside = [
        f"{case} {r['dmuon']['outside_collectives_ms']:.3f}" for case, r in results.items() if "dmuon" in r
    ]
    print("dmuon host ms outside torch.distributed calls: " + ", ".join(outside))
    if "adamw-fused" in names:
        print("\nhost time / fused AdamW's, same case:")
        for case, r in results.items():
            ratios = ", ".join(
                f"{n} {r[n]['host_ms'] / r['adamw-fused']['host_ms']:.2f}x"
                for n in names
                if n != "adamw-fused"
            )
            print(f"- {case}: {ratios}")
    if "w2" in results:
        print("\nagainst W=2 (ops, host time, host time outside torch.distributed calls):")
        for case in ("fake64", "fake1024", "w2-80"):
            if case in results:
                ratios = ", ".join(
                    f"{n} "
                    + " / ".join(
                        f"{results[case][n][k] / results['w2'][n][k]:.2f}x"
                        for k in ("ops", "host_ms", "outside_collectives_ms")
                    )
                    for n in names
                    if n != "adamw-fused"
                )
                print(f"- {case}: {ratios}")
    print("\nmost frequent ops (dmuon):")
    for case, r in results.items():
        if "dmuon" in r:
            print(f"- {case}: {r['dmuon']['top_ops']}")


if __name__ == "__main__":
    main()
