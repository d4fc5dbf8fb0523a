"""DMuonFSDP on GPUs (NCCL, one rank per GPU) against the float64 single-process reference Muon.

    torchrun --standalone --nproc-per-node <GPUs> scripts/check_cuda.py

Without CUDA it runs the same checks on CPU ranks with gloo (a smoke test of the script itself).

Each layout the job's GPU count allows (FSDP2 on all ranks; HSDP when the count is even; plain
tensors, DDP-style) runs three steps with fp32 Newton-Schulz (must agree to 1e-5) and with the
CUDA default, bf16 (its error is printed for reference). Exits non-zero on disagreement.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")]
from reference import reference_muon_step, relative_error  # noqa: E402

from dmuon_fsdp import DMuonFSDP  # noqa: E402

SHAPES = {"w5": (5, 256), "tall": (1024, 384), "wide": (384, 1024), "conv": (64, 32, 3, 3), "sq": (512, 512)}
REFERENCE = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, coefficients=(3.4445, -4.7750, 2.0315),
                 steps=5, eps=1e-7, adjust_lr_fn=None)  # fmt: skip


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(layout: str, ns_dtype: torch.dtype, device: torch.device) -> float:
    gen = torch.Generator().manual_seed(0)
    module = torch.nn.ParameterDict(
        {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for n, s in SHAPES.items()}
    ).to(device)
    world = dist.get_world_size()
    if layout == "fsdp":
        fully_shard(module, mesh=init_device_mesh(device.type, (world,)))
    elif layout == "hsdp":
        fully_shard(module, mesh=init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("rep", "shard")))
    params = dict(module.items())
    ref = {n: _full(p).detach().double().clone() for n, p in params.items()}
    bufs = {n: torch.zeros_like(p) for n, p in ref.items()}
    opt = DMuonFSDP(list(params.items()), lr=0.02, weight_decay=0.1, ns_dtype=ns_dtype)
    for step in range(3):
        gen = torch.Generator().manual_seed(100 + step)
        grads = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
        for n, p in params.items():
            g = grads[n].to(device, torch.float32)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            reference_muon_step(ref[n], grads[n].to(device), bufs[n], **REFERENCE)
        opt.step()
    return max(relative_error(_full(p).detach(), ref[n]) for n, p in params.items())


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"

    layouts = ["fsdp", "plain"] + (["hsdp"] if world % 2 == 0 else [])
    failed = False
    for layout in layouts:
        fp32 = run(layout, torch.float32, device)
        bf16 = run(layout, torch.bfloat16, device)
        failed |= not fp32 <= 1e-5
        if rank == 0:
            print(f"{layout:6s} W={world} {name}: max rel err vs float64 "
                  f"reference: fp32 NS {fp32:.2e} (bound 1e-5), bf16 NS {bf16:.2e}")  # fmt: skip
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
