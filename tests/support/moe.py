"""A Mixture-of-Experts block laid out as torchtitan lays it out, on CPU meshes, for tests.

The world's ranks are viewed as a dense mesh and a sparse (expert) mesh: unflattened from a 1-D
world mesh (torchtitan now), or a root ``(efsdp, ep)`` mesh with the dense one flattened from it
(torchtitan before); ``hsdp`` adds a ``dp_replicate`` dim in front of both. Dense weights (q, o,
router: Muon; a norm: AdamW) are ``fully_shard``-ed over the dense mesh; expert stacks ``w1, w3
[E, F, D]`` and ``w2 [E, D, F]`` are distributed ``Shard(0)`` over ``ep`` and then
``fully_shard``-ed over ``efsdp`` with ``Shard(1)`` when efsdp * ep > E (torchtitan's choice),
else FSDP2's default ``Shard(0)``, which becomes ``_StridedShard`` (whole experts per rank). The
loss sum(w * g) gives each weight a gradient g chosen per step (``dead``: an expert whose g is
zero, as one that got no tokens; ``use_experts=False``: a step that skips the MoE block, so the
experts have no gradient at all).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

DIM, HIDDEN = 8, 12


def given_loss(weight: torch.Tensor, seed: int, dead: int | None = None) -> torch.Tensor:
    """sum(weight * g) for a g drawn over the weight's global shape; this rank multiplies its own
    block (a DTensor's local tensor) by g's matching block."""
    g = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed))
    if dead is not None:
        g[dead] = 0.0
    if isinstance(weight, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            weight.shape, weight.device_mesh, weight.placements
        )
        g = g[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        weight = weight.to_local()
    return (weight * g).sum()


class Params(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            init = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.1
            self.register_parameter(name, nn.Parameter(init))

    def forward(self, step: int, dead: int | None = None) -> torch.Tensor:
        return sum(given_loss(p, 1000 * step + i, dead) for i, p in enumerate(self.parameters()))


class MoEBlock(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.dense = Params({"wq": (DIM, DIM), "wo": (DIM, DIM), "router": (experts, DIM), "norm": (DIM,)}, 0)
        self.experts = Params(
            {"w1": (experts, HIDDEN, DIM), "w3": (experts, HIDDEN, DIM), "w2": (experts, DIM, HIDDEN)}, 1
        )

    def forward(self, step: int, use_experts: bool = True, dead: int | None = None) -> torch.Tensor:
        loss = self.dense(step)
        return loss + self.experts(step, dead) if use_experts else loss


def meshes(
    style: str, efsdp: int, ep: int
) -> tuple[DeviceMesh, DeviceMesh, tuple[str, ...], tuple[str, ...]]:
    """(dense mesh, sparse mesh, the dense mesh's FSDP dims, the sparse mesh's FSDP dims)."""
    if style == "flatten":
        root = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
        return root._flatten("fsdp"), root, ("fsdp",), ("efsdp",)
    replicate = 2 if style == "hsdp" else 1
    world = init_device_mesh("cpu", (replicate * efsdp * ep,), mesh_dim_names=("world",))
    if style == "hsdp":
        dense = world._unflatten(0, (replicate, efsdp * ep), ("dp_replicate", "fsdp"))
        sparse = world._unflatten(0, (replicate, efsdp, ep), ("dp_replicate", "efsdp", "ep"))
        return dense, sparse, ("dp_replicate", "fsdp"), ("dp_replicate", "efsdp")
    dense = world._unflatten(0, (efsdp * ep,), ("fsdp",))
    sparse = world._unflatten(0, (efsdp, ep), ("efsdp", "ep"))
    return dense, sparse, ("fsdp",), ("efsdp",)


def moe_block(style: str, experts: int, efsdp: int, ep: int) -> MoEBlock:
    """The block on ``style``'s meshes (see the module docstring), sharded as torchtitan does."""
    dense, sparse, dense_dims, sparse_dims = meshes(style, efsdp, ep)
    model = MoEBlock(experts)
    for name, p in list(model.experts.named_parameters()):
        model.experts.register_parameter(
            name, nn.Parameter(distribute_tensor(p.detach(), sparse["ep"], [Shard(0)]))
        )
    strided = efsdp * ep <= experts  # FSDP2's default Shard(0) then holds whole experts
    fully_shard(
        model.experts,
        mesh=sparse[sparse_dims],
        shard_placement_fn=None if strided else (lambda p: Shard(1)),
    )
    fully_shard(model.dense, mesh=dense[dense_dims])
    fully_shard(model, mesh=dense[dense_dims])
    return model
