"""A row variant plugs into the step program through ``dmuon_fsdp.variants.RowVariant`` alone
([Note: row variants]): a toy one written here and added to ``VARIANTS`` in each process steps
exactly as its float64 reference on full matrices with uneven, empty and column-cut shards, its
option rebuilds the program when changed, and its state is placed like the rows and saved."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp.config import VARIANTS
from tests.support.layout_runs import (
    OPTIONS,
    SHAPES,
    TOLERANCE,
    Weights,
    against_reference,
    check,
    given_gradients,
)
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import Reference, train


@dataclass(frozen=True)
class EnergyStep:
    """Per owned matrix O: its rows' state grows by ``weight`` times the row's mean square, and
    the row's factor is 1 / sqrt(1 + state)."""

    matrices: list[torch.Tensor]
    state: list[torch.Tensor]
    factors: list[torch.Tensor]
    weights: list[float]

    def run(self) -> None:
        for o, s, f, w in zip(self.matrices, self.state, self.factors, self.weights, strict=True):
            s.add_(o.float().square().mean(dim=1), alpha=w)
            torch.rsqrt(1 + s, out=f)


@dataclass(frozen=True)
class RowEnergy:
    """A toy row variant, unlike NorMuon: one option, one op per matrix."""

    name: str = "row_energy"
    state_key: str = "row_energy"
    options: tuple[str, ...] = ("energy_weight",)

    def check(self, group):
        if group["energy_weight"] < 0:
            raise ValueError(f"energy_weight must be >= 0, got {group['energy_weight']}")

    def settings(self, group):
        return (float(group["energy_weight"]),)

    def bind(self, batches, ns_dtype, take):
        matrices = [(m, batch.settings[0]) for batch in batches for m in batch.matrices()]
        rows = sum(m.shape[0] for m, _ in matrices)
        if not rows:
            return None
        state, factors = take(rows, torch.float32), take(rows, torch.float32)
        step, offset = EnergyStep([], [], [], []), 0
        for m, weight in matrices:
            step.matrices.append(m)
            step.state.append(state[offset : offset + m.shape[0]])
            step.factors.append(factors[offset : offset + m.shape[0]])
            step.weights.append(weight)
            offset += m.shape[0]
        return step


TOY = RowEnergy()


def energy_reference(ortho, state, group):
    state.add_(ortho.square().mean(dim=1), alpha=group["energy_weight"])
    return (1 + state).rsqrt()


def toy_layouts(rank, world_size, layout):
    VARIANTS[TOY.name] = TOY  # added in this rank's process
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
    groups = [{"params": list(model.named_parameters()), "energy_weight": 0.5}]
    return against_reference(model, groups, loss, row_reference=energy_reference, variant=TOY.name)


def test_a_toy_row_variant_equals_its_reference_on_fsdp_and_fsdp_tp():
    for layout in ("fsdp", "fsdp_tp"):
        check(run_ranks(toy_layouts, 4, layout), min_owners=2, reuses_slots=layout == "fsdp")


def test_its_option_rebuilds_the_program_and_its_state_is_like_the_rows_and_saved(monkeypatch):
    monkeypatch.setitem(VARIANTS, TOY.name, TOY)
    model = Weights({"w": (6, 4), "tall": (8, 3), "stack": (2, 3, 5)})
    groups = [
        {"params": [("ws.w", model.ws["w"]), ("ws.tall", model.ws["tall"])], "energy_weight": 1.0},
        {"params": [("ws.stack", model.ws["stack"])], "flatten": False, "energy_weight": 1.0},
    ]
    opt = DMuonFSDP(groups, **{**OPTIONS, "variant": TOY.name})
    reference = Reference(model, opt, energy_reference)

    def heavier(step):
        for group in opt.param_groups:
            group["energy_weight"] = 4.0 * (step + 1)

    train([(model, opt)], 3, loss=model, reference=reference, after_step=heavier)
    assert max(reference.errors().values()) <= TOLERANCE, reference.errors()
    state = {n: opt.state[model.ws[n]][TOY.state_key] for n in ("w", "tall", "stack")}
    assert {n: tuple(s.shape) for n, s in state.items()} == {"w": (6,), "tall": (8,), "stack": (2, 3)}
    loaded = DMuonFSDP(groups, **{**OPTIONS, "variant": TOY.name})
    loaded.load_state_dict(opt.state_dict())
    assert all(torch.equal(loaded.state[model.ws[n]][TOY.state_key], s) for n, s in state.items())
