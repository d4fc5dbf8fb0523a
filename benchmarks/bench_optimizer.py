"""Optimizer step cost of DMuonFSDP against AdamW, gather-all Muon and torch.optim.Muon on FSDP2.

Every contender steps the same FSDP2-sharded recipe model with the same gradients, at one world
size, in one run, the contenders taking turns step by step (spawned CPU ranks with gloo here,
one GPU per rank with NCCL when CUDA is present). Reported per contender, after warm-up: median
and spread of the slowest rank's step time and the total CPU time of all ranks; for DMuonFSDP
also a phase breakdown, NS flops per rank (max/mean = load imbalance), bytes per rank against the
plan's bound, and the matmul floor: the time plain ``torch.bmm`` takes for this rank's NS
products, measured in the same run, giving
NS efficiency = floor / measured NS time. ``dmuon-qk-clip`` is DMuonFSDP followed by QK-clip on
every attention layer with every head over tau: the clip's cost after the step (not the forward's
logit tracking, which is the training loop's). ``dmuon-normuon`` is DMuonFSDP with
``variant="normuon"``.

    python -m benchmarks.bench_optimizer --world-size 2
    python -m benchmarks.bench_optimizer --world-size 4 --contenders adamw dmuon gather-muon
    python -m benchmarks.bench_optimizer --ns-throughput       # one device: batched NS vs torch.mm
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.gather_muon import GatherAllMuon
from benchmarks.matmul_floor import bmm_seconds, ns_throughput_report
from dmuon_fsdp import AttentionWeights, DMuonFSDP, QKClip, StepStats, param_groups
from dmuon_fsdp._step import comm
from dmuon_fsdp._step.run import PHASES
from dmuon_fsdp.newton_schulz import default_ns_dtype
from recipes.model import PRESETS, Transformer, preset
from recipes.stop import let_threads_run

CONTENDERS = [
    "adamw",
    "adamw-fused",
    "torch-muon",
    "gather-muon",
    "dmuon",
    "dmuon-no-overlap",
    "dmuon-qk-clip",
    "dmuon-normuon",
]


class ClippedStep:
    """DMuonFSDP's step, then QK-clip on every attention layer with logits over tau on every head
    (so every step scales every q and k row), its all_reduce included."""

    def __init__(self, model: Transformer, ns_dtype: torch.dtype) -> None:
        self.opt = DMuonFSDP(param_groups(model), ns_dtype=ns_dtype)
        attention = [block.attention for block in model.blocks()]
        self.clip = QKClip(
            self.opt,
            [AttentionWeights(a.wq.weight, a.wk.weight, a.n_heads, a.n_kv_heads) for a in attention],
            tau=1.0,
        )
        self.logits = [torch.full((a.n_heads,), 2.0, device=a.wq.weight.device) for a in attention]

    def step(self) -> None:
        self.opt.step()
        self.clip.clip(self.logits)


def make_optimizers(
    name: str, model: Transformer, ns_dtype: torch.dtype
) -> list[torch.optim.Optimizer | ClippedStep]:
    if name == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)]
    if name == "adamw-fused":
        return [torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)]
    groups = param_groups(model)
    if name in ("dmuon", "dmuon-no-overlap"):
        return [DMuonFSDP(groups, ns_dtype=ns_dtype, overlap=name == "dmuon")]
    if name == "dmuon-normuon":
        return [DMuonFSDP(groups, ns_dtype=ns_dtype, variant="normuon")]
    if name == "dmuon-qk-clip":
        return [ClippedStep(model, ns_dtype)]
    muon, adamw = ([p for _, p in g["params"]] for g in groups)
    rest = torch.optim.AdamW(adamw, lr=1e-3, foreach=True)
    if name == "gather-muon":
        return [GatherAllMuon(muon, ns_dtype=ns_dtype), rest]
    if name == "torch-muon":
        return [torch.optim.Muon(muon), rest]
    raise ValueError(f"unknown contender {name!r}")


# The benchmarks' own reductions go through dmuon_fsdp._step.comm, which returns only once gloo's worker
# thread has let go of the tensors: a release left for interpreter exit aborts a rank ("terminate
# called without an active exception"), as torch.distributed's plain calls could at the end of a run.


def timed_steps(
    contenders: dict[str, list[torch.optim.Optimizer | ClippedStep]],
    steps: dict[str, int],
    warmup: int,
    device: torch.device,
) -> dict:
    """Each contender's ``warmup + steps[name]`` steps, interleaved (a step of each in turn, so
    that all see the same load on a shared machine); the timings of those after warm-up."""
    group = dist.group.WORLD
    assert group is not None  # (the workers initialize the default process group first)
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for i in range(warmup + max(steps.values())):
        for name, optimizers in contenders.items():
            if i >= warmup + steps[name]:
                continue
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.process_time()
            for opt in optimizers:
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            sample = torch.tensor(
                [time.perf_counter() - start, time.process_time() - start_cpu],
                dtype=torch.float64,
                device=device,
            )  # NCCL reduces device tensors only
            table = comm.all_rows(sample, group)  # every rank's (wall, cpu); see below
            if i >= warmup:
                wall[name].append(table[:, 0].max().item())
                cpu[name].append(table[:, 1].sum().item())
    return {
        name: {
            "median_s": statistics.median(wall[name]),
            "min_s": min(wall[name]),
            "max_s": max(wall[name]),
            "cpu_total_s": statistics.median(cpu[name]),
            "steps": steps[name],
        }
        for name in contenders
    }


def dmuon_breakdown(
    model: Transformer, ns_dtype: torch.dtype, steps: int, device: torch.device, world: int
) -> dict:
    """Phase times, flops and bytes of DMuonFSDP with phase timing on, plus the bmm floor."""
    opt = DMuonFSDP(param_groups(model), ns_dtype=ns_dtype, time_phases=True)
    per_step: list[StepStats] = []
    for _ in range(steps + 1):
        dist.barrier()
        opt.step()
        assert opt.last_step_stats is not None  # (set by the step just taken)
        per_step.append(opt.last_step_stats)
    per_step = per_step[1:]
    stats = per_step[-1]
    plan, me = opt.plan, opt.exchange_rank
    assert plan is not None  # (opt has stepped)
    group = dist.group.WORLD
    assert group is not None  # (the workers initialize the default process group first)
    element = torch.empty((), dtype=ns_dtype).element_size()
    floor = bmm_seconds(plan, me, ns_dtype, device)
    seconds = [statistics.median(s.seconds.get(ph, 0.0) for s in per_step) for ph in PHASES]
    counts = [stats.ns_flops, stats.bytes_sent, stats.bytes_received, plan.elements_moved(me) * element]
    mine = torch.tensor([*seconds, *counts, floor], dtype=torch.float64, device=device)
    everyone = []
    for row in comm.all_rows(mine, group).tolist():
        names = ("ns_flops", "bytes_sent", "bytes_received", "bytes_bound")
        numbers = dict(zip(names, map(int, row[len(PHASES) : -1]), strict=True))  # the floor is last
        phase_seconds = dict(zip(PHASES, row[: len(PHASES)], strict=True))
        everyone.append({"seconds": phase_seconds, **numbers, "floor_s": row[-1]})
    return {"ranks": everyone, "buckets": len(plan.buckets), "matrices": len(plan.matrices)}


def sharded_model(
    rank: int, world: int, port: int, preset_name: str, cpu: bool, threads: int
) -> tuple[torch.device, Transformer]:
    """(device, model): this rank's process group (NCCL on its GPU, else gloo with ``threads``
    torch threads) and the preset model with every block and the root under ``fully_shard``."""
    cuda = torch.cuda.is_available() and not cpu
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = Transformer(preset(preset_name)).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return device, model


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    device, model = sharded_model(rank, world, port, args.preset, args.cpu, args.threads)
    cuda = device.type == "cuda"
    ns_dtype = default_ns_dtype(device) if args.ns_dtype == "auto" else getattr(torch, args.ns_dtype)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    contenders = {name: make_optimizers(name, model, ns_dtype) for name in args.contenders}
    steps = {
        name: args.slow_steps if name == "torch-muon" and not cuda else args.steps for name in contenders
    }
    results: dict = {"contenders": timed_steps(contenders, steps, args.warmup, device)}
    if "dmuon" in args.contenders:
        results["dmuon_breakdown"] = dmuon_breakdown(model, ns_dtype, args.steps, device, world)
    if rank == 0:
        results.update(
            world_size=world,
            preset=args.preset,
            device=str(device),
            ns_dtype=str(ns_dtype),
            threads_per_rank=args.threads,
        )
        Path(args.out).write_text(json.dumps(results, indent=2))
    let_threads_run()  # gloo's threads drop the tensors of plain collectives first
    dist.destroy_process_group()


def report(results: dict, out: Path) -> None:
    contenders = results["contenders"]
    base = contenders.get("dmuon")
    print(
        f"\n## Optimizer step, preset {results['preset']}, W={results['world_size']}, {results['device']}, "
        f"NS in {results['ns_dtype']}\n"
    )
    print(
        "| contender | median ms | min ms | max ms | steps | wall / DMuonFSDP | CPU time, all ranks (ms) | "
        "CPU / DMuonFSDP |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in contenders.items():
        wall = f"{r['median_s'] / base['median_s']:.2f}x" if base else "-"
        cpu = f"{r['cpu_total_s'] / base['cpu_total_s']:.2f}x" if base else "-"
        print(
            f"| {name} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} | "
            f"{r['steps']} | {wall} | {r['cpu_total_s'] * 1e3:.1f} | {cpu} |"
        )
    breakdown = results.get("dmuon_breakdown")
    if breakdown:
        ranks = breakdown["ranks"]
        flops = [r["ns_flops"] for r in ranks]
        print(
            f"\n## DMuonFSDP per rank ({breakdown['matrices']} matrices, {breakdown['buckets']} buckets; "
            "phase times with timing on)\n"
        )
        print(
            "| rank | " + " | ".join(f"{ph} ms" for ph in PHASES) + " | NS GFLOP | floor ms | NS efficiency "
            "| sent MiB | received MiB | plan bound MiB |"
        )
        print("|---:" * (len(PHASES) + 7) + "|")
        for i, r in enumerate(ranks):
            ns = r["seconds"]["newton_schulz"]
            eff = f"{r['floor_s'] / ns:.2f}" if ns > 0 else "-"
            print(
                f"| {i} | "
                + " | ".join(f"{r['seconds'][ph] * 1e3:.1f}" for ph in PHASES)
                + f" | {r['ns_flops'] / 1e9:.2f} | {r['floor_s'] * 1e3:.1f} | {eff} | "
                f"{r['bytes_sent'] / 2**20:.2f} "
                f"| {r['bytes_received'] / 2**20:.2f} | {r['bytes_bound'] / 2**20:.2f} |"
            )
        mean = sum(flops) / len(flops)
        ns_seconds = max(1e-12, sum(r["seconds"]["newton_schulz"] for r in ranks))
        efficiency = sum(r["floor_s"] for r in ranks) / ns_seconds
        print(f"\nNS load: max/mean = {max(flops) / mean:.3f}; total NS floor efficiency = {efficiency:.2f}")
    plot(results, out.with_suffix(".png"))
    print(f"\nJSON: {out}\nplot: {out.with_suffix('.png')}")


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["contenders"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(
        names,
        [results["contenders"][n]["median_s"] * 1e3 for n in names],
        color="lightgray",
        label="step (timing off)",
    )
    breakdown = results.get("dmuon_breakdown")
    if breakdown:
        slowest = max(breakdown["ranks"], key=lambda r: sum(r["seconds"].values()))
        bottom = 0.0
        for ph in PHASES:
            height = slowest["seconds"][ph] * 1e3
            ax.bar(["dmuon phases"], [height], bottom=bottom, label=ph)
            bottom += height
    ax.set_ylabel("ms per optimizer step (slowest rank)")
    ax.set_title(f"{results['preset']}, W={results['world_size']}, {results['device']}")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", default="cpu-bench", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--slow-steps", type=int, default=3, help="timed steps of torch-muon on CPU (bf16 NS)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is present")
    parser.add_argument(
        "--ns-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="NS dtype of DMuonFSDP and gather-all Muon (auto: bf16 on CUDA, fp32 on CPU)",
    )
    parser.add_argument("--contenders", nargs="+", default=CONTENDERS, choices=CONTENDERS)
    parser.add_argument(
        "--ns-throughput", action="store_true", help="single device: batched NS vs torch.mm peak"
    )
    parser.add_argument("--out", default="runs/bench/optimizer.json")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.ns_throughput:
        ns_throughput_report(preset(args.preset), out.with_name("ns_throughput.json"))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world_size, port, args), nprocs=args.world_size)
    report(json.loads(out.read_text()), out)


if __name__ == "__main__":
    main()
