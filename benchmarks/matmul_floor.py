"""The matmul floor under Newton-Schulz, measured on this device with plain torch.bmm / torch.mm."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dmuon_fsdp import DMuonFSDP, param_groups
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp.newton_schulz import default_ns_dtype, standard_segments
from instruments.plans import newton_schulz_flops

if TYPE_CHECKING:
    from recipes.model import ModelConfig


def sync(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU), so that a timer brackets the work."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _best_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def bmm_chain_seconds(
    batch: int, s: int, l: int, segments: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> float:
    """Time of the NS products alone for a batch of s x l matrices run as ``segments`` (see
    ``newton_schulz.segments_flops``): per segment X X^T and one s x s by s x l product, and
    4k - 3 s x s products for k iterations."""
    x = torch.randn(batch, s, l, dtype=dtype, device=device)
    a = torch.randn(batch, s, s, dtype=dtype, device=device)

    def products() -> None:
        for k in segments:
            torch.bmm(x, x.mT)
            for _ in range(4 * k - 3):
                torch.bmm(a, a)
            torch.bmm(a, x)

    return _best_seconds(products, device)


def bmm_seconds(
    plan: Plan,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    segments: Callable[[int, int], tuple[int, ...]] = lambda rows, cols: standard_segments(5),
) -> float:
    """Least NS time of ``rank`` under ``plan``: its owned batches, per bucket, (short, long)
    side (DMuonFSDP stacks tall matrices transposed with wide ones) and NS form (``segments(rows,
    cols)``, as the optimizer's ``ns_algorithm`` picks it; default: five standard iterations), as bmm."""
    total = 0.0
    for bucket in plan.buckets:
        matrices = [plan.matrices[j] for j in plan.owned_by(bucket, rank)]
        shapes = Counter(
            (min(m.rows, m.cols), max(m.rows, m.cols), segments(m.rows, m.cols)) for m in matrices
        )
        for (s, l, form), batch in shapes.items():
            total += bmm_chain_seconds(batch, s, l, form, dtype, device)
    return total


def ns_throughput_report(cfg: ModelConfig, path: Path) -> None:
    """One device: TFLOP/s of torch.mm, of our batched NS and of torch.optim.Muon, per model."""
    from recipes.model import Transformer

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = default_ns_dtype(device)
    model = Transformer(cfg).to(device)
    matrices = [p for _, p in param_groups(model)[0]["params"]]
    flops = sum(newton_schulz_flops(p.shape[0], p.shape[1], 5) for p in matrices)
    n = 4096 if device.type == "cuda" else 1024
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    mm_rate = 2 * n**3 / _best_seconds(lambda: torch.mm(a, b), device)
    for p in matrices:
        p.grad = torch.randn_like(p)
    ours = DMuonFSDP(matrices, ns_dtype=dtype)
    ours_rate = flops / _best_seconds(ours.step, device, repeats=3)
    vanilla = torch.optim.Muon(matrices)
    vanilla_rate = flops / _best_seconds(vanilla.step, device, repeats=3)
    result = {
        "device": str(device),
        "dtype": str(dtype),
        "matrices": len(matrices),
        "ns_gflop": flops / 1e9,
        "mm_tflops": mm_rate / 1e12,
        "dmuon_ns_tflops": ours_rate / 1e12,
        "torch_muon_tflops": vanilla_rate / 1e12,
    }
    path.write_text(json.dumps(result, indent=2))
    print(
        f"| device | dtype | torch.mm {n}^2 TFLOP/s | DMuonFSDP step (batched NS) TFLOP/s | "
        "torch.optim.Muon step TFLOP/s |"
    )
    print("|---|---|---:|---:|---:|")
    print(
        f"| {device} | {dtype} | {result['mm_tflops']:.3f} | {result['dmuon_ns_tflops']:.3f} | "
        f"{result['torch_muon_tflops']:.3f} |"
    )
    print(f"\n{len(matrices)} matrices, {result['ns_gflop']:.1f} GFLOP of NS per step; JSON: {path}")
