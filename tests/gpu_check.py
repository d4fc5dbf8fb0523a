"""The GPU check: every collective path of the step on CUDA, in one command and one table.

    bash scripts/gpu_check.sh [OUT_DIR]          # python -m tests.gpu_check --out OUT_DIR
    python -m tests.gpu_check --dry-run          # the same parts on CPU, to check the script

On one GPU, four processes share it over gloo with CUDA tensors (gloo carries them, all-to-all
included, and its ``wait()`` orders the current stream after the collective, as NCCL's does), so
that the exchanges, the reused buffer slots, the check flags, the verdict's read and the side
stream of steps begun in backward all run:

- ``job``: FSDP and HSDP layouts with at least 6 buckets, ``overlap`` on and off, a bf16 and an
  fp32 wire, Muon and NorMuon, ``overlap_backward``: each case against the float64 reference on
  the full matrices, and bitwise against the same run serialized (every collective completed
  and the device synchronized before the next op: a race shows as a bit difference);
- ``syncs``: host-device synchronizations per steady step (``torch.cuda.set_sync_debug_mode``),
  with a float lr and with a tensor lr on the GPU;
- ``memory``: 50 steps of two alternating gradient sets: ``memory_reserved`` and the optimizer's
  ``buffer_bytes`` after the first 10;
- ``step time``: the ``124m`` preset, DMuonFSDP against AdamW (``benchmarks.bench_optimizer``);
- ``sanitizer``: ``TORCH_CUDA_SANITIZER=1`` over FSDP2 training with ``overlap_backward`` and a
  clipping step (one process, NCCL).

With several GPUs, the job also runs on NCCL, one rank per GPU, at every GPU count from 2, with
a device bound to the default group (eager initialization, where a group made by part of the
job would hang). Meant to take under 10 minutes on one H200 (not yet run on one: 51 s on 2 CPU
cores as a dry run). The job's CPU form (four gloo ranks on CPU, the serialized comparison
included) runs in the suite: ``tests/test_cuda_semantics.py``.

Self-contained but for ``tests.support.cuda`` and ``tests.support.reference``: it needs torch
and the repository, not pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from dmuon_fsdp import DMuonFSDP, clip_grad_norm_
from tests.support.cuda import Serialized, bits
from tests.support.reference import reference_muon_step
from tests.support.spawn import free_port, join

# (5, 16) leaves an empty shard at 4 ranks; (13, 9) and (9, 13) split unevenly
BASE = {"w5": (5, 16), "w13": (13, 9), "w9": (9, 13), "conv": (6, 3, 3, 3), "tall": (40, 8)}
# seven copies: at 256 bytes a bucket, FSDP at 4 ranks makes 6 buckets or more; and an AdamW vector
SHAPES = {f"{n}_{copy}": s for copy in "abcdefg" for n, s in BASE.items()} | {"scale": (16,)}
OPTIONS = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, bucket_bytes=256)
NORMUON = dict(normuon_beta2=0.9, normuon_eps=1e-6)
STEPS = 4
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 5e-3}  # against float64, by the wire's dtype
WORLD = 4  # processes sharing one GPU


@dataclass(frozen=True)
class Case:
    layout: str  # "fsdp" (1-D mesh) or "hsdp" (2 x W/2)
    overlap: bool
    wire: str  # the comm dtype's name
    variant: str
    overlap_backward: bool

    @property
    def name(self) -> str:
        parts = [self.layout, self.wire, self.variant, "overlap" if self.overlap else "serial"]
        return " ".join(parts + (["in backward"] if self.overlap_backward else []))


# Every pair of options together at least once
CASES = (
    Case("fsdp", True, "float32", "muon", False),
    Case("fsdp", False, "bfloat16", "normuon", False),
    Case("fsdp", True, "bfloat16", "muon", True),
    Case("fsdp", False, "float32", "normuon", True),
    Case("hsdp", True, "float32", "normuon", True),
    Case("hsdp", False, "bfloat16", "muon", True),
    Case("hsdp", True, "bfloat16", "normuon", False),
    Case("hsdp", False, "float32", "muon", False),
)


def _gradient(step: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = 1000 * step + sum(ord(c) for c in name)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _block(p: torch.Tensor) -> tuple[slice, ...]:
    """This rank's block of a DTensor's global tensor."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _model(layout: str, device: torch.device) -> nn.ParameterDict:
    gen = torch.Generator().manual_seed(0)
    model = nn.ParameterDict(
        {n: nn.Parameter(torch.randn(s, generator=gen) * 0.1) for n, s in SHAPES.items()}
    )
    world = dist.get_world_size()
    if layout == "fsdp":
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    else:
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model.to(device), mesh=mesh)
    return model


def _backward(model: nn.ParameterDict, step: int) -> None:
    """A loss whose gradients are the step's chosen ones, each rank multiplying its own block
    (no collective: FSDP2's forward is not run), so that each lands through autograd and fires
    the hooks of steps begun in backward."""
    loss = sum(
        (p.to_local() * _gradient(step, n, p.shape)[_block(p)].to(p.device, p.dtype)).sum()
        for n, p in model.items()
    )
    loss.backward()


def _train(case: Case, device: torch.device, serialized: bool) -> tuple[nn.ParameterDict, DMuonFSDP]:
    model = _model(case.layout, device)
    opt = DMuonFSDP(
        list(model.items()),
        comm_dtype=getattr(torch, case.wire),
        overlap=case.overlap,
        overlap_backward=case.overlap_backward,
        variant=case.variant,
        **OPTIONS,
        **(NORMUON if case.variant == "normuon" else {}),
    )
    with Serialized() if serialized else contextlib.nullcontext():
        for step in range(STEPS):
            _backward(model, step)
            opt.step()
            opt.zero_grad()
    return model, opt


def _reference(case: Case) -> dict[str, torch.Tensor]:
    """The Muon matrices after STEPS steps of the float64 reference on full tensors."""
    gen = torch.Generator().manual_seed(0)
    params = {n: (torch.randn(s, generator=gen) * 0.1).double() for n, s in SHAPES.items()}
    del params["scale"]  # AdamW's: checked by torch's own AdamW tests
    bufs = {n: torch.zeros_like(p) for n, p in params.items()}
    moments = {n: torch.zeros(p.shape[0], dtype=torch.float64) for n, p in params.items()}
    for step in range(STEPS):
        for n, p in params.items():
            extra = dict(second_moment=moments[n], **NORMUON) if case.variant == "normuon" else {}
            lr, weight_decay = OPTIONS["lr"], OPTIONS["weight_decay"]
            reference_muon_step(
                p, _gradient(step, n, p.shape), bufs[n], lr=lr, weight_decay=weight_decay, **extra
            )
    return params


def _local_tensors(model: nn.ParameterDict, opt: DMuonFSDP) -> list[torch.Tensor]:
    out = []
    for p in model.values():
        out.append(p.to_local())
        out += [v.to_local() if isinstance(v, DTensor) else v for v in opt.state[p].values()]
    return out


def check_case(case: Case, device: torch.device) -> dict[str, Any]:
    """One case on every rank of the job (a collective): its largest relative error from the
    float64 reference, the tensors whose bits differ from the serialized run, its buckets and
    the buckets started in backward at its last step; the same on every rank."""
    model, opt = _train(case, device, serialized=False)
    twin, twin_opt = _train(case, device, serialized=True)
    expected = _reference(case)
    sums = torch.zeros(2 * len(expected) + 1, dtype=torch.float64)  # per matrix |d|^2, |ref|^2; differing
    for i, (n, want) in enumerate(expected.items()):
        p = model[n]
        got = p.to_local().detach().double().cpu()
        ref = want[_block(p)]
        sums[2 * i], sums[2 * i + 1] = (got - ref).square().sum(), ref.square().sum()
    ours, theirs = _local_tensors(model, opt), _local_tensors(twin, twin_opt)
    sums[-1] = sum(not torch.equal(bits(a), bits(b)) for a, b in zip(ours, theirs, strict=True))
    sums = sums.to(device)  # NCCL reduces device tensors only
    dist.all_reduce(sums)
    sums = sums.cpu()
    errors = [(sums[2 * i] / sums[2 * i + 1]).sqrt().item() for i in range(len(expected))]
    return {
        "case": case.name,
        "error": max(errors),
        "bound": BOUNDS[getattr(torch, case.wire)],
        "differing": int(sums[-1]),
        "buckets": len(opt.plan.buckets),
        "started_in_backward": opt.last_step_stats.started_in_backward,
    }


def check_syncs(device: torch.device) -> dict[str, Any]:
    """Host-device synchronizations (on CPU: host reads) of each of 10 steady steps, FSDP, with a
    float lr and with a tensor lr on the device; the same on every rank (rank 0's)."""
    from instruments.counters import HostReads

    out = {}
    for kind in ("float", "tensor"):
        model = _model("fsdp", device)
        lr = OPTIONS["lr"] if kind == "float" else torch.tensor(OPTIONS["lr"], device=device)
        opt = DMuonFSDP(list(model.items()), **{**OPTIONS, "lr": lr})
        counts = []
        for step in range(13):
            _backward(model, step)
            if step < 3:
                opt.step()
            elif device.type == "cuda":
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        opt.step()
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                counts.append(sum("synchroniz" in str(w.message) for w in caught))
            else:
                with HostReads() as reads:
                    opt.step()
                counts.append(reads.count)
            opt.zero_grad()
        out[kind] = max(counts)
    return out


def check_memory(device: torch.device) -> dict[str, Any]:
    """50 steps of two alternating gradient sets (the ``_a`` matrices and the others): how much
    ``memory_reserved`` (CUDA) and ``buffer_bytes`` moved after step 10."""
    model = _model("fsdp", device)
    opt = DMuonFSDP(list(model.items()), **OPTIONS)
    reserved, buffers = [], []
    for step in range(50):
        used = [n for n in model if n.endswith("_a") == (step % 2 == 0)]  # the others get no gradient
        loss = sum(
            (p.to_local() * _gradient(step, n, p.shape)[_block(p)].to(p.device, p.dtype)).sum()
            for n, p in model.items()
            if n in used
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 10:
            reserved.append(torch.cuda.memory_reserved(device) if device.type == "cuda" else 0)
            buffers.append(opt.last_step_stats.buffer_bytes)
    return {"reserved_growth": max(reserved) - min(reserved), "buffer_growth": max(buffers) - min(buffers)}


def _job_rank(rank: int, world: int, port: int, backend: str, device_type: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    shared = backend == "gloo"  # all ranks on GPU 0 (gloo), or one GPU each (NCCL)
    device = (
        torch.device(device_type, 0 if shared else rank) if device_type == "cuda" else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL eagerly initialized, as trainers that bind a device at start do: every group the
    # optimizer makes is then a split of the default communicator ([Note: groups])
    bound = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, **bound)
    try:
        result: dict[str, Any] = {"unsupported": _unsupported(device)}
        if not result["unsupported"]:
            # HSDP takes two replicas of half the ranks
            result["cases"] = [check_case(c, device) for c in CASES if c.layout == "fsdp" or world % 2 == 0]
            if shared:
                result["syncs"] = check_syncs(device)
                result["memory"] = check_memory(device)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _unsupported(device: torch.device) -> list[str]:
    """The collectives the step uses that this job's backend refuses for ``device`` tensors."""
    missing = []
    world = dist.get_world_size()
    probes = {
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.zeros(world, device=device), torch.ones(world, device=device), [1] * world, [1] * world
        ),
        "all_reduce (max)": lambda: dist.all_reduce(
            torch.ones(2, dtype=torch.int64, device=device), op=dist.ReduceOp.MAX
        ),
    }
    for name, probe in probes.items():
        try:
            probe()
        except (RuntimeError, NotImplementedError) as e:
            missing.append(f"{name}: {str(e).splitlines()[0][:120]}")
    return missing


def run_job(world: int, backend: str, device_type: str, seconds: float = 420.0) -> dict[str, Any]:
    """The job's ranks as processes; rank 0's results."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "job.json")
        context = mp.start_processes(
            _job_rank,
            args=(world, port, backend, device_type, out),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        join(context, seconds, f"the {world}-rank {backend} job")
        return json.loads(Path(out).read_text())


def sanitized(device_type: str) -> None:
    """FSDP2 training with ``overlap_backward`` and ``dmuon_fsdp.clip_grad_norm_`` each step, one
    process (run under ``TORCH_CUDA_SANITIZER=1`` by ``--part sanitizer``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cuda = device_type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(6))).to(device)
        mesh = init_device_mesh(device.type, (1,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = DMuonFSDP(model.parameters(), bucket_bytes=2**14, overlap_backward=True)
        started = 0
        for step in range(6):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).to(device)
            model(x).pow(2).sum().backward()
            clip_grad_norm_(model.parameters(), 1.0 if step % 2 else 1e6)  # clips every other step
            opt.step()
            opt.zero_grad()
            started = max(started, opt.last_step_stats.started_in_backward)
        print(json.dumps({"started_in_backward": started}))
    finally:
        dist.destroy_process_group()


def _part(argv: list[str], env: dict[str, str], seconds: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], env={**os.environ, **env}, capture_output=True, text=True, timeout=seconds
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--dry-run", action="store_true", help="run the parts on CPU (no GPU needed)")
    parser.add_argument("--part", choices=["sanitizer"], help=argparse.SUPPRESS)  # a part's own process
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    device_type = "cuda" if cuda else "cpu"
    if args.part == "sanitizer":
        sanitized(device_type)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if cuda else 0
    where = f"{gpus} x {torch.cuda.get_device_name()}" if cuda else "CPU (dry run)"
    print(f"# GPU check: torch {torch.__version__}, {where}, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    rows: list[tuple[str, str, str]] = []
    results: dict[str, Any] = {"torch": torch.__version__, "device": where}

    def attempt(label: str, fn: Any) -> Any:
        start = time.monotonic()
        try:
            value = fn()
            print(f"{label}: done in {time.monotonic() - start:.0f} s", flush=True)
            return value
        except Exception as e:  # a part that fails is a row of the table, not the end of the check
            traceback.print_exc()
            rows.append((label, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"))
            return None

    jobs = [(WORLD, "gloo")] + [(n, "nccl") for n in range(2, gpus + 1)]
    for world, backend in jobs:
        label = f"job, {world} ranks, {backend}" + (" (one GPU)" if backend == "gloo" and cuda else "")
        job = attempt(label, lambda world=world, backend=backend: run_job(world, backend, device_type))
        if job is None:
            continue
        results[label] = job
        if job["unsupported"]:
            rows.append((label, "STAGED", "unsupported: " + "; ".join(job["unsupported"])))
            continue
        for c in job["cases"]:
            ok = c["error"] <= c["bound"] and c["differing"] == 0 and c["buckets"] >= 6
            ok &= c["started_in_backward"] > 0 or "in backward" not in c["case"]
            figures = (
                f"err {c['error']:.1e} (bound {c['bound']:g}), {c['differing']} tensors differ from "
                f"serialized, {c['buckets']} buckets, {c['started_in_backward']} begun in backward"
            )
            rows.append((f"{label}: {c['case']}", "ok" if ok else "FAIL", figures))
        if "syncs" in job:
            s = job["syncs"]
            what = "syncs" if cuda else "host reads"
            rows.append(
                (
                    f"{label}: {what} per steady step",
                    "ok" if s["tensor"] <= s["float"] else "FAIL",
                    f"float lr {s['float']}, tensor lr {s['tensor']}",
                )
            )
            m = job["memory"]
            flat = m["reserved_growth"] == 0 and m["buffer_growth"] == 0
            rows.append(
                (
                    f"{label}: memory over 50 alternating steps",
                    "ok" if flat else "FAIL",
                    f"memory_reserved grew {m['reserved_growth']} B, buffer_bytes {m['buffer_growth']} B",
                )
            )

    preset = "124m" if cuda else "cpu-bench"
    bench = out / "bench_124m.json"

    def step_time() -> None:
        argv = ["-m", "benchmarks.bench_optimizer", "--world-size", "1", "--preset", preset]
        argv += ["--contenders", "adamw", "adamw-fused", "dmuon", "--out", str(bench)]
        done = _part(argv, {}, 300)
        if done.returncode:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed")
        timed = json.loads(bench.read_text())["contenders"]
        ms = {name: timed[name]["median_s"] * 1e3 for name in ("adamw", "adamw-fused", "dmuon")}
        results["step_time_ms"] = ms
        rows.append(
            (
                f"step time, {preset} preset, 1 rank",
                "ok",
                f"DMuonFSDP {ms['dmuon']:.2f} ms, AdamW {ms['adamw']:.2f} ms, fused AdamW "
                f"{ms['adamw-fused']:.2f} ms ({ms['dmuon'] / ms['adamw-fused']:.2f}x fused)",
            )
        )

    attempt("step time", step_time)

    def sanitizer() -> None:
        argv = ["-m", "tests.gpu_check", "--part", "sanitizer"] + (["--dry-run"] if not cuda else [])
        done = _part(argv, {"TORCH_CUDA_SANITIZER": "1"} if cuda else {}, 300)
        report = (done.stdout + done.stderr).strip()
        races = "CSAN detected" in report or "data race" in report
        started = (
            json.loads(done.stdout.strip().splitlines()[-1])["started_in_backward"]
            if not done.returncode
            else 0
        )
        label = "sanitizer: overlap_backward with clipping" + ("" if cuda else " (no sanitizer off CUDA)")
        ok = done.returncode == 0 and not races and started > 0
        figures = f"{started} buckets begun in backward, no race reported" if ok else report[-300:]
        rows.append((label, "ok" if ok else "FAIL", figures))

    attempt("sanitizer", sanitizer)

    (out / "gpu_check.json").write_text(json.dumps({**results, "rows": rows}, indent=2))
    print("\n| check | result | figures |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    failed = [r for r in rows if r[1] == "FAIL"]
    print(
        f"\n{len(rows) - len(failed)} of {len(rows)} rows ok; table and figures in {out / 'gpu_check.json'}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
