"""DMuonFSDP on GPUs (NCCL, one rank per GPU) against its own float64 single-process step.

    torchrun --standalone --nproc-per-node <GPUs> -m benchmarks.check_cuda

Without CUDA it runs the same checks on CPU ranks with gloo (a smoke test of the script itself).

Each layout the job's GPU count allows (FSDP2 on all ranks; HSDP when the count is even; plain
tensors, DDP-style) runs three steps with fp32 Newton-Schulz (must agree to 1e-5) and with the
CUDA default, bf16 (its error is printed for reference), against DMuonFSDP in float64 in this
process on the full tensors (no process group involved: plain tensors on the CPU). That float64
single-process step is itself tested against an independent float64 Muon written from the
formulas (``tests/test_single_process.py``). Then ``overlap_backward=True`` (its hooks on the
side stream, fired by FSDP2's reduce) against the plain step, on an FSDP2 MLP stack trained with
real backward passes: the parameters must agree to 1e-6. Exits non-zero on disagreement.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from dmuon_fsdp import DMuonFSDP

SHAPES = {"w5": (5, 256), "tall": (1024, 384), "wide": (384, 1024), "conv": (64, 32, 3, 3), "sq": (512, 512)}
OPTIONS = dict(lr=0.02, weight_decay=0.1)
STEPS = 3


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _gradient(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + len(shape) * 7 + shape[0])
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _initial() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()}


def float64_reference() -> dict[str, torch.Tensor]:
    """The parameters after STEPS steps of DMuonFSDP in float64, one process, full tensors."""
    params = {n: torch.nn.Parameter(p.double()) for n, p in _initial().items()}
    opt = DMuonFSDP(list(params.items()), ns_dtype=torch.float64, **OPTIONS)
    for step in range(STEPS):
        for _n, p in params.items():
            p.grad = _gradient(step, p.shape)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def run(layout: str, ns_dtype: torch.dtype, device: torch.device, expected: dict[str, torch.Tensor]) -> float:
    module = torch.nn.ParameterDict({n: torch.nn.Parameter(p) for n, p in _initial().items()}).to(device)
    world = dist.get_world_size()
    if layout == "fsdp":
        fully_shard(module, mesh=init_device_mesh(device.type, (world,)))
    elif layout == "hsdp":
        fully_shard(
            module, mesh=init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("rep", "shard"))
        )
    params = dict(module.items())
    opt = DMuonFSDP(list(params.items()), ns_dtype=ns_dtype, **OPTIONS)
    for step in range(STEPS):
        for p in params.values():
            g = _gradient(step, p.shape).to(device, torch.float32)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
        opt.step()
    errors = []
    for n, p in params.items():
        got, want = _full(p).detach().double().cpu(), expected[n]
        errors.append(((got - want).norm() / want.norm()).item())
    return max(errors)


def overlap_against_plain(device: torch.device) -> tuple[float, int]:
    """(max relative difference, buckets started in backward at the last step) of an FSDP2 MLP
    stack trained with ``overlap_backward=True`` against the plain step, fp32 NS."""
    trained = []
    for overlap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(6))).to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = DMuonFSDP(
            model.parameters(), ns_dtype=torch.float32, bucket_bytes=2**18, overlap_backward=overlap
        )
        for step in range(STEPS + 1):
            x = torch.randn(32, 256, generator=torch.Generator().manual_seed(step)).to(device)
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        trained.append([_full(p).detach().double().cpu() for p in model.parameters()])
    difference = max(((a - b).norm() / a.norm()).item() for a, b in zip(*trained, strict=True))
    return difference, opt.last_step_stats.started_in_backward


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    expected = float64_reference()
    layouts = ["fsdp", "plain"] + (["hsdp"] if world % 2 == 0 else [])
    failed = False
    for layout in layouts:
        fp32 = run(layout, torch.float32, device, expected)
        bf16 = run(layout, torch.bfloat16, device, expected)
        failed |= not fp32 <= 1e-5
        if rank == 0:
            print(
                f"{layout:6s} W={world} {name}: max rel err vs float64 single-process DMuonFSDP: "
                f"fp32 NS {fp32:.2e} (bound 1e-5), bf16 NS {bf16:.2e}"
            )
    difference, started = overlap_against_plain(device)
    failed |= not (difference <= 1e-6 and started > 0)
    if rank == 0:
        print(
            f"overlap_backward W={world} {name}: max rel difference from the plain step {difference:.2e} "
            f"(bound 1e-6), {started} buckets started in backward"
        )
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
