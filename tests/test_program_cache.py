"""Step programs kept per gradient set: a model whose parameters with gradients alternate runs
each set's program again without building it (one small all_reduce per step agrees on the set,
no wasted exchange), stays exact, stops agreeing once the set holds still, and still raises the
same error on every rank when the ranks' sets differ."""

from __future__ import annotations

import copy
import gc
import itertools
import weakref

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from dmuon_fsdp import DMuonFSDP
from dmuon_fsdp._step.errors import GradientMismatchError
from dmuon_fsdp._step.runtime import AGREE_UNTIL_STEADY, PROGRAMS_KEPT
from instruments.counters import CollectiveCalls
from tests.support.layout_runs import against_reference, check
from tests.support.moe import given_loss
from tests.support.spawn import run_ranks

SHAPES = {"a": (7, 5), "b": (6, 4), "c": (6, 4), "d": (5, 9), "e": (3, 8), "f": (9, 3)}


class Branches(nn.Module):
    """A weight per shape; a step's loss uses the weights it names (the others get no gradient)."""

    def __init__(self, mesh=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            w = torch.randn(shape, generator=gen) * 0.1
            self.register_parameter(name, nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]) if mesh else w))

    def forward(self, step: int, used: str) -> torch.Tensor:
        return sum(given_loss(getattr(self, n), 100 * step + i) for i, n in enumerate(used))


def per_step(rank, world_size, schedule, overlap_backward=False):
    """Per step: the collectives launched (in backward and step), the program's own count, the
    plan used (the step it was made at) and the kept programs' buffer bytes."""
    model = Branches(init_device_mesh("cpu", (world_size,)) if world_size > 1 else None)
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32, overlap_backward=overlap_backward)
    out, plans = [], []
    for step, used in enumerate(schedule):
        with CollectiveCalls() as calls:
            model(step, used).backward()
            opt.step()
        opt.zero_grad()
        plans.append(opt.plan)
        first = next(i for i, plan in enumerate(plans) if plan is opt.plan)  # whose program ran
        out.append(
            (
                calls.calls["all_reduce"],
                calls.calls["all_to_all_single"],
                opt.last_step_stats.collectives,
                first,
                opt.last_step_stats.buffer_bytes,
            )
        )
    return out


@pytest.mark.parametrize("overlap_backward", [False, True])
def test_alternating_sets_run_their_kept_programs(overlap_backward):
    # With overlap_backward the hooks serve only a set that held for two steps: none here, so
    # no exchange is started in backward for a program the step does not run.
    schedule = ["ab", "ac"] * 4
    steps = run_ranks(per_step, 2, schedule, overlap_backward)[0]
    # Step 1: the set changed; the program in use told every rank (an exchange more) and one was
    # built (the plan agreement).
    assert steps[1][0] == 1 and steps[1][1] > steps[1][2]
    # Step 2 returns to a kept set: the program in use tells every rank, which then agree on
    # their sets before each step.
    for step, (reduces, exchanges, own, first, buffers) in enumerate(steps[3:], start=3):
        assert first == step % 2, "the set's program from its first step, not built again"
        assert reduces == 1 and exchanges == own, "one agreement, no wasted exchange"
        assert buffers == steps[0][4] > 0, "two programs kept, one pool of buffers"


def test_a_set_that_holds_still_stops_the_agreement():
    schedule = ["ab", "ac", "ab"] + ["ac"] * (AGREE_UNTIL_STEADY + 2)
    steps = run_ranks(per_step, 2, schedule)[0]
    # Agreed from step 2 (the return) to the step after which the set held for AGREE_UNTIL_STEADY.
    assert [s[0] for s in steps[3:]] == [1] * (AGREE_UNTIL_STEADY + 1) + [0]


def test_one_process_keeps_programs_too():
    steps = per_step(0, 1, ["ab", "ac"] * 2 + ["ad", "ae", "af", "ab"])
    assert [s[3] for s in steps] == [0, 1, 0, 1, 4, 5, 6, 7][: len(steps)]
    # ab, ac, ad, ae, af: five sets, PROGRAMS_KEPT of them kept: ab's program was dropped.
    assert PROGRAMS_KEPT < 5


def exact(rank, world_size, schedule):
    model = Branches(init_device_mesh("cpu", (world_size,)))
    return against_reference(
        model, list(model.named_parameters()), lambda step: model(step, schedule[step]), steps=len(schedule)
    )


def test_kept_programs_are_exact_when_sets_cycle_past_the_bound():
    schedule = ["ab", "ac", "ab", "ad", "ae", "af", "ab", "ac", "ab"]
    check(run_ranks(exact, 3, schedule), min_owners=2, reuses_slots=False)  # two matrices a step


def diverging(rank, world_size, last):
    """Rank 1 steps with another set at step 3; the error is caught and training goes on alike
    through more sets than are kept (kept plans that differed between ranks would hang)."""
    model = Branches(init_device_mesh("cpu", (world_size,)))
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32)
    error = None
    # After step 3 the kept sets, least recent first, would be ab, ac on rank 0 and ac, ab on
    # rank 1: ad, ae and af then drop ab on one rank and ac on the other, and ab needs a plan.
    sets = ["ab", "ac", "ab", last if rank == 1 else "ac", "ad", "ae", "af", "ab", "ac"]
    for step, used in enumerate(sets):
        model(step, used).backward()
        try:
            opt.step()
        except GradientMismatchError as e:
            error = step, str(e)
        opt.zero_grad()
    return error, {n: p.full_tensor() for n, p in model.named_parameters()}


def test_ranks_on_different_sets_raise_alike_while_agreeing():
    for last in ("ab", "bc"):  # a kept program on rank 1, or one it would have to build
        (first, weights), (second, twin) = run_ranks(diverging, 2, last, timeout=60, pg_timeout=20)
        assert first == second and first[0] == 3, (first, second)
        assert "ranks disagree on which parameters have gradients" in first[1]
        assert all(torch.equal(weights[n], twin[n]) for n in weights)


def test_a_loaded_state_lets_go_of_the_programs_it_replaces():
    model = Branches()
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32)
    for step, used in enumerate(["ab", "ac", "ab"]):
        model(step, used).backward()
        opt.step()
        opt.zero_grad()
    pooled = opt.last_step_stats.buffer_bytes
    old = [weakref.ref(opt.state[p]["momentum_buffer"]) for p in model.parameters()]
    plan = opt.plan
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new state tensors: the programs held the old
    assert opt.plan is plan  # still the plan in use
    model(3, "ab").backward()
    opt.step()
    gc.collect()
    assert all(ref() is None for ref in old), "a kept program holds a replaced state tensor"
    assert opt.last_step_stats.buffer_bytes == pooled > 0  # bound anew into the same buffers


class Arenas(TorchDispatchMode):
    """The byte tensors made while active (the pool's arenas): at each one made, the bytes of
    the storages of those made before that are still alive, plus its own."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[int, int]] = []  # (storage weak reference, bytes)
        self.peaks: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.zeros.default and out.dtype == torch.uint8:
            gc.collect()
            alive = sum(n for ref, n in self.made if not torch.UntypedStorage._expired(ref))
            self.made.append((out.untyped_storage()._weak_ref(), out.numel()))
            self.peaks.append(alive + out.numel())
        return out


def test_a_growing_pool_frees_what_it_replaces_first_and_grows_with_headroom():
    # Steps whose gradient sets grow one matrix at a time: each needs more buffers than the one
    # before. The kept programs let go of an arena before its successor is made, so the buffers
    # never take more than the pool holds after growing; and growing with headroom makes fewer
    # arenas than there are sets.
    model = Branches()
    names = list(SHAPES)
    opt = DMuonFSDP(model.named_parameters(), ns_dtype=torch.float32)
    sizes = []
    with Arenas() as arenas:
        for step in range(len(names)):
            model(step, names[: step + 1]).backward()
            opt.step()
            opt.zero_grad()
            sizes.append(opt.last_step_stats.buffer_bytes)
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    assert max(arenas.peaks) <= sizes[-1]
    grown = sum(1 for a, b in itertools.pairwise(sizes) if b > a)
    assert grown < len(names) - 1, sizes
