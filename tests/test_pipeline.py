"""Pipeline parallelism as torchtitan builds it: a (pp=2, dp=2) mesh, each stage's model sharded
by FSDP2 over the stage's ``dp`` sub-mesh with a ``DMuonFSDP`` of its own, driven by
``torch.distributed.pipelining``'s schedules on 4 CPU ranks (gloo): 1F1B (a stage per rank) and
interleaved 1F1B (two stages per rank, an optimizer each, as torchtitan's container builds one per
model part), each step checked against the float64 reference on the gradients the schedule left."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from dmuon_fsdp import DMuonFSDP
from instruments.counters import CollectiveCalls, GroupCalls
from tests.support.layout_runs import OPTIONS, check
from tests.support.paired_runs import Stack
from tests.support.spawn import run_ranks
from tests.support.training import Reference

STEPS = 3
MICROBATCHES = 4
WIDTH = 16  # what each stage takes and passes on
# Each stage's widths between: uneven shards over dp, a 5-row matrix split 3/2.
STAGES = [(WIDTH, 24, 5, WIDTH), (WIDTH, 13, 40, WIDTH), (WIDTH, 9, 24, WIDTH), (WIDTH, 37, WIDTH)]


def stages(rank, world_size, schedule_name, overlap_backward, scale_grads):
    """This rank's stages (1F1B: stages 0+1 or 2+3 of ``STAGES`` joined into one; interleaved:
    stages ``pp`` and ``pp + 2``), each with its ``DMuonFSDP`` and the float64 reference beside
    it, stepped by the schedule ``STEPS`` times. Returns each stage's relative errors and
    counts (by stage index), the groups made, per step and stage (buckets started in backward,
    redone), DMuonFSDP's warnings, and the last stage's losses."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    interleaved = schedule_name == "interleaved"
    if interleaved:
        dims = {pp: STAGES[pp], pp + 2: STAGES[pp + 2]}
    else:
        dims = {pp: STAGES[2 * pp] + STAGES[2 * pp + 1][1:]}
    count = 4 if interleaved else 2
    parts, built = [], []
    with GroupCalls() as made:
        for index, widths in dims.items():
            model = Stack(widths)
            for layer in model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            opt = DMuonFSDP(model.parameters(), **OPTIONS, overlap_backward=overlap_backward)
            parts.append((opt, Reference(model, opt)))
            built.append(
                PipelineStage(model, index, count, torch.device("cpu"), group=mesh["pp"].get_group())
            )

    def loss_fn(output, target):  # without scale_grads, the mean over microbatches (torchtitan's)
        return (output - target).pow(2).mean() / (1 if scale_grads else MICROBATCHES)

    if interleaved:
        schedule = ScheduleInterleaved1F1B(built, MICROBATCHES, loss_fn=loss_fn, scale_grads=scale_grads)
    else:
        schedule = Schedule1F1B(built[0], MICROBATCHES, loss_fn=loss_fn, scale_grads=scale_grads)
    first, last = 0 in dims, count - 1 in dims
    history, losses = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(100 * step + dp)  # each dp replica its own batch
            x, target = torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)
            mine: list[torch.Tensor] = []
            schedule.step(*([x] if first else []), **({"target": target, "losses": mine} if last else {}))
            losses.append(float(sum(mine)) if last else None)
            for opt, reference in parts:
                reference.read_gradients()
                with CollectiveCalls() as calls:
                    opt.step()
                opt.zero_grad()
                reference.step(calls)
            history.append(
                [(o.last_step_stats.started_in_backward, o.last_step_stats.redone) for o, _ in parts]
            )
    said = [str(w.message) for w in caught if "DMuonFSDP" in str(w.message)]
    checked = {
        index: (reference.errors(), reference.counts)
        for index, (_, reference) in zip(dims, parts, strict=True)
    }
    return checked, made.calls, history, said, losses


def by_stage(results):
    """Each stage's ``against_reference``-shaped results, from its two ranks."""
    out: dict[int, list] = {}
    for checked, *_ in results:
        for index, result in checked.items():
            out.setdefault(index, []).append(result)
    return out


@pytest.mark.parametrize(
    "schedule_name,overlap_backward",
    [("1f1b", False), ("1f1b", True), ("interleaved", False), ("interleaved", True)],
)
def test_stages_step_exactly_under_a_pipelining_schedule(schedule_name, overlap_backward):
    results = run_ranks(stages, 4, schedule_name, overlap_backward, False, timeout=120, pg_timeout=30)
    stage_results = by_stage(results)
    assert sorted(stage_results) == list(range(4 if schedule_name == "interleaved" else 2))
    for pair in stage_results.values():  # exact, each matrix orthogonalized once over the stage's ranks
        check(pair, min_owners=2, reuses_slots=False)
    for checked, made, history, said, _ in results:
        assert made == []  # each stage exchanges on its dp mesh's group: none is made
        buckets = [counts["buckets"] for _, counts in checked.values()]
        # a stage of one bucket has nothing to start in backward, and says so once
        idle = sum(n == 1 for n in buckets) if overlap_backward else 0
        assert len(said) == idle and all("nothing starts in backward" in m for m in said), said
        for step, stats in enumerate(history):
            for (started, redone), n in zip(stats, buckets, strict=True):
                assert not redone
                # from the step after the plan's, a stage with buckets before the one carrying
                # the check flags starts them in backward
                assert (started > 0) == (overlap_backward and step > 0 and n > 1), history
    losses = [r[4] for r in results if r[4][0] is not None]
    assert len(losses) == 2 and losses[0] != losses[1]  # the two dp replicas took their own batches


def test_scale_grads_after_backward_redoes_begun_steps_exactly_and_says_so():
    results = run_ranks(stages, 4, "1f1b", True, True, timeout=120, pg_timeout=30)
    for pair in by_stage(results).values():
        check(pair, min_owners=2, reuses_slots=False)
    for _, _, history, said, _ in results:
        assert all(redone for stats in history[1:] for _, redone in stats)
        assert len(said) == 1 and "scale_grads=False" in said[0]
