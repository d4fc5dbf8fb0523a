"""``overlap_forward`` under the habits real training code has, each against the same loop with the
option off: HSDP (2, 2) on 4 ranks, 8 FSDP2 units of 32 x 32 and small buckets (several relays
in flight after each step). Every habit completes (a rank that waited alone for a relay would
hang the others), the forwards see what the plain step's see, bitwise, and so does everything
read after the last step."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from dmuon_fsdp import DMuonFSDP, param_groups
from tests.support.paired_runs import step_apart
from tests.support.spawn import run_ranks
from tests.support.training import full

WIDTH, DEPTH, STEPS = 32, 8, 3
BUCKET = 2**12  # bytes: several relays


class Unit(nn.Module):
    """A block (compiled and sharded as one), with a second entry point (``project``) for
    ``register_fsdp_forward_method``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


class Units(nn.Module):
    """``DEPTH`` blocks, a norm and an output layer; ``habit`` picks how the forward calls them."""

    def __init__(self, habit: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Unit() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.output = nn.Linear(WIDTH, WIDTH, bias=False)
        self.habit = habit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.habit == "checkpointed":
                x = checkpoint(layer, x, use_reentrant=False)
            elif self.habit == "forward_method":
                x = layer.project(x)
            else:
                x = layer(x)
        return self.output(self.norm(x))


def inputs(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def build(habit: str, later: bool, mesh):
    """The model with ``habit``'s set-up, sharded (HSDP on ``mesh``), and its optimizer."""
    model = Units(habit)
    compiled = {"compiled_fullgraph": True, "compiled": False}.get(habit)
    for layer in model.layers:
        if compiled is not None:  # torchtitan's way: each block compiled, then sharded
            layer.compile(backend="aot_eager", fullgraph=compiled)
        fully_shard(layer, mesh=mesh)
        if habit == "forward_method":
            register_fsdp_forward_method(layer, "project")
    if habit == "grouped":
        fully_shard([model.norm, model.output], mesh=mesh)
    if habit == "prefetch":  # each block's pre-forward all-gathers the next two too
        for i, layer in enumerate(model.layers):
            layer.set_modules_to_forward_prefetch(list(model.layers[i + 1 : i + 3]))
    options = {"lr": 0.02, "bucket_bytes": BUCKET, "overlap_forward": later}
    if habit == "built_before_sharding":  # the optimizer follows fully_shard's new parameters
        opt = DMuonFSDP(param_groups(model, head=model.output), **options)
        fully_shard(model, mesh=mesh)
        return model, opt
    fully_shard(model, mesh=mesh)
    opt = DMuonFSDP(model.parameters(), **options)
    if habit == "compiled_whole":
        model.compile(backend="aot_eager")
    if habit == "compiled_wrapper":
        return torch.compile(model, backend="aot_eager"), opt
    return model, opt  # (every matrix on Muon, the output's too)


def habits_pairs(rank, world_size, habits):
    """``habit_pairs`` for each of ``habits``, one after another (a habit per job would spend
    more time starting ranks than training)."""
    return {habit: habit_pairs(rank, habit) for habit in habits}


def habit_pairs(rank, habit):
    """Train the plain step and ``overlap_forward`` side by side under ``habit``; return each
    step's losses, whether reading the parameters right after a step saw rows in flight, what
    each run's step post-hook saw, and the tensors that differ at the end."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replica = mesh.get_coordinate()[0]
    runs = [build(habit, later, mesh) for later in (False, True)]
    seen_by_hooks: list[list[torch.Tensor]] = [[], []]
    if habit == "post_hook":  # torchtitan's float8 scales are computed so, from the new weights
        for (model, opt), seen in zip(runs, seen_by_hooks, strict=True):
            opt.register_step_post_hook(
                lambda *_, m=model, s=seen: s.extend(p.to_local().clone() for p in m.parameters())
            )
    losses, in_flight = [], []
    kept: list = [None, None]

    def before(i, model, opt):
        if habit == "rollback" and step == 1:  # what the step about to be discarded starts from
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            kept[i] = (weights, copy.deepcopy(opt.state_dict()))
        if habit == "unshard":  # FSDP2's own example; pipelining schedules unshard a stage so
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()

    for step in range(STEPS):
        values, rows_in_flight = step_apart(runs, step, inputs(step), before)
        losses.append(values)
        in_flight.append(rows_in_flight)
        for i, (model, opt) in enumerate(runs):
            if habit == "save_alone" and replica == 0:  # the other replica goes straight on
                model.state_dict()
            if habit == "finish_alone" and rank == 0:
                opt.finish_step()
            if habit in ("save_alone", "finish_alone"):
                dist.barrier()
            if habit == "rollback" and step == 1:
                model.load_state_dict(kept[i][0])
                opt.load_state_dict(kept[i][1])
            if habit == "written" and step == 1:  # written right after the step: the value stays
                with torch.no_grad():
                    for p in list(model.parameters())[::3]:
                        p.copy_(torch.full_like(p, 0.01))
            if habit == "eval":
                model.eval()
                with torch.no_grad():
                    model(inputs(step + 50))
                model.train()
            if habit == "dcp_save":
                with tempfile.TemporaryDirectory() as folder:
                    shared = [folder]
                    dist.broadcast_object_list(shared, src=0)
                    dcp.save(get_model_state_dict(model), checkpoint_id=shared[0] + f"/{i}")
                    dist.barrier()
    runs[1][1].finish_step()
    states = [{k: full(v).clone() for k, v in model.state_dict().items()} for model, _ in runs]
    differing = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
    hooks_agree = all(torch.equal(a, b) for a, b in zip(*seen_by_hooks, strict=True))
    return losses, in_flight, differing, hooks_agree


HABITS = {  # jobs of habits, each run in its own job of 4 ranks
    "alone": ("save_alone", "finish_alone", "unshard", "rollback", "written", "post_hook"),
    "models": (
        "checkpointed",
        "eval",
        "dcp_save",
        "grouped",
        "forward_method",
        "prefetch",
        "built_before_sharding",
    ),
    "compiled per block": ("compiled_fullgraph", "compiled"),
    "compiled whole": ("compiled_whole", "compiled_wrapper"),
}


@pytest.mark.parametrize("job", HABITS)
def test_a_habit_sees_the_plain_step(job):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_ranks(habits_pairs, 4, HABITS[job], timeout=300, pg_timeout=60)
    for by_habit in results:
        for habit, (losses, in_flight, differing, hooks_agree) in by_habit.items():
            assert all(torch.equal(a, b) for a, b in losses), (habit, losses)
            assert differing == [], (habit, differing)
            assert hooks_agree, habit
            if habit != "post_hook":  # (its step lands every relay before the hook runs)
                assert any(in_flight), f"{habit}: step() left nothing in flight"


class Block(nn.Module):
    """Attention whose ``out_proj`` never runs its own forward (``nn.MultiheadAttention`` reads
    its weight), and a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(16, 2, bias=False, batch_first=True)
        self.mlp = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x, x, x, need_weights=False)[0]
        return x + torch.tanh(self.mlp(x))


def ddp_pairs(rank, world_size, habit):
    """The plain step and ``overlap_forward`` side by side under DDP (every rank a replica: the
    relays carry (W - 1) / W of each result) with plain tensors, whose modules are found in the
    forwards: each step's losses, whether rows were in flight after each step, what differs
    at the end and the warnings the overlapping run gave."""
    runs = []
    for later in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*(Block() for _ in range(3)))
        if habit == "compiled_fullgraph":
            for block in model:
                block.compile(backend="aot_eager", fullgraph=True)
        wrapped = DistributedDataParallel(model)
        if habit == "compiled_whole":  # no module runs eagerly: nothing is found
            wrapped.compile(backend="aot_eager")
        opt = DMuonFSDP(model.parameters(), lr=0.02, bucket_bytes=BUCKET, overlap_forward=later)
        runs.append((wrapped, model, opt))
    losses, in_flight = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if habit == "compiled_later" and step == 1:  # after the modules were found
                for _, model, _ in runs:
                    for block in model:
                        block.compile(backend="aot_eager", fullgraph=True)
            x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            values, rows_in_flight = step_apart([(wrapped, opt) for wrapped, _, opt in runs], step, x)
            losses.append(values)
            in_flight.append(rows_in_flight)
        runs[1][2].finish_step()
    pairs = zip(runs[0][1].named_parameters(), runs[1][1].named_parameters(), strict=True)
    differing = [n for (n, p), (_, q) in pairs if not torch.equal(p, q)]
    said = [str(w.message) for w in caught if "overlap_forward" in str(w.message)]
    return losses, in_flight, differing, said


@pytest.mark.parametrize("habit", ["eager", "compiled_fullgraph", "compiled_whole"])
def test_modules_found_in_the_forward_see_the_plain_step(habit):
    """Each relay lands before the deepest module that holds its parameters and runs eagerly
    (``nn.MultiheadAttention`` for its ``out_proj``), or before a module compiled on its own
    (its inside traced); with nothing running eagerly, in ``step()``, said once."""
    for losses, in_flight, differing, said in run_ranks(ddp_pairs, 2, habit, timeout=300):
        assert all(torch.equal(a, b) for a, b in losses) and differing == [], (losses, differing)
        if habit == "compiled_whole":
            assert not any(in_flight)
            assert len(said) == 1 and "no module whose forward uses them was seen" in said[0], said
        else:
            assert all(in_flight) and said == [], said


def test_a_module_compiled_after_it_was_found_is_said_and_found_anew():
    """A block compiled (fullgraph) after the first step traces the hooks of the modules found in
    it: that forward reads rows still in flight, which the next step says (once), and the
    modules are found anew (each block's own hook, run eagerly), so later steps leave rows in
    flight again."""
    for losses, in_flight, _, said in run_ranks(ddp_pairs, 2, "compiled_later", timeout=300):
        assert torch.equal(*losses[0]) and not torch.equal(*losses[1])  # (step 1's forward read early)
        assert any("before their relays landed" in s for s in said), said
        assert in_flight[0] and in_flight[-1], in_flight
