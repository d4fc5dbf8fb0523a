"""A row variant plugs into the step program through ``dmuon_fsdp.variants.RowVariant`` alone
([Note: row variants]): a toy one written here, registered at run time, steps exactly as its
float64 reference on full matrices with uneven, empty and column-cut shards, and its state is
placed like the rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.variants import VARIANTS
from tests.support.layout_runs import SHAPES, Weights, against_reference, check, given_gradients
from tests.support.spawn import cpu_mesh, run_ranks


@dataclass(frozen=True)
class EnergyStep:
    """Per owned matrix O (a view in its parameter's orientation): its rows' state grows by the
    row's mean square, and the row's factor is 1 / sqrt(1 + state)."""

    matrices: list[torch.Tensor]
    state: list[torch.Tensor]
    factors: list[torch.Tensor]

    def run(self) -> None:
        for o, s, f in zip(self.matrices, self.state, self.factors, strict=True):
            s.add_(o.float().square().mean(dim=1))
            torch.rsqrt(1 + s, out=f)


@dataclass(frozen=True)
class RowEnergy:
    """A toy row variant, unlike NorMuon: no options, one op per matrix."""

    name: str = "row_energy"
    state_key: str = "row_energy"
    options: tuple[str, ...] = ()

    def check(self, group):
        pass

    def settings(self, group):
        return ()

    def bind(self, batches, ns_dtype, take):
        shapes = [
            (batch.stack[b], rows, cols)
            for batch in batches
            for b, (rows, cols) in enumerate(batch.shapes.values())
        ]
        if not shapes:
            return None
        state, factors = (take(sum(rows for _, rows, _ in shapes), torch.float32) for _ in range(2))
        matrices, states, row_factors, offset = [], [], [], 0
        for stacked, rows, cols in shapes:
            matrices.append(stacked.mT if rows > cols else stacked)  # tall matrices lie transposed
            states.append(state[offset : offset + rows])
            row_factors.append(factors[offset : offset + rows])
            offset += rows
        return EnergyStep(matrices, states, row_factors)


TOY = RowEnergy()


def energy_reference(ortho, state):
    state.add_(ortho.square().mean(dim=1))
    return (1 + state).rsqrt()


def toy_layouts(rank, world_size, layout):
    VARIANTS[TOY.name] = TOY  # registered in this rank's process
    if layout == "fsdp":
        model = Weights(SHAPES)
        fully_shard(model, mesh=cpu_mesh())
        loss = model
    else:  # FSDP + TP, uneven on both mesh dims: pieces cut by column carry each row's state once
        model = nn.Sequential(nn.Linear(9, 13, bias=False), nn.Linear(13, 9, bias=False))
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        loss = given_gradients(model)
    groups = list(model.named_parameters())
    return against_reference(model, groups, loss, row_reference=energy_reference, variant=TOY.name)


def test_a_toy_row_variant_equals_its_reference_on_fsdp_and_fsdp_tp():
    for layout, world_size in (("fsdp", 4), ("fsdp_tp", 4)):
        results = run_ranks(toy_layouts, world_size, layout)
        check(results, min_owners=2, reuses_slots=layout == "fsdp")


def test_a_toy_row_variant_keeps_its_state_like_the_rows(monkeypatch):
    monkeypatch.setitem(VARIANTS, TOY.name, TOY)
    model = Weights({"w": (6, 4), "stack": (2, 3, 5)})
    groups = [
        {"params": [("ws.w", model.ws["w"])]},
        {"params": [("ws.stack", model.ws["stack"])], "flatten": False},
    ]
    opt = DMuonFSDP(groups, variant=TOY.name, lr=0.05)
    model(0).backward()
    opt.step()
    assert opt.state[model.ws["w"]][TOY.state_key].shape == (6,)
    assert opt.state[model.ws["stack"]][TOY.state_key].shape == (2, 3)
    assert (opt.state[model.ws["w"]][TOY.state_key] > 0).all()  # the first step's row energies
    loaded = DMuonFSDP(groups, variant=TOY.name, lr=0.05)
    loaded.load_state_dict(opt.state_dict())
    assert torch.equal(loaded.state[model.ws["w"]][TOY.state_key], opt.state[model.ws["w"]][TOY.state_key])
