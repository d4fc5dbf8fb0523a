"""The only module calling torch.distributed: a passive transport and the groups it uses.

``launch`` starts one ``all_to_all_single`` of an ``Exchange`` (buffers and split sizes in
process-group rank order, as ``dmuon_fsdp.schedule`` lays them out) and returns a handle to
wait on. ``ExchangeSite`` is where a step's exchanges and checks run: a mesh and the process
group over its ranks. The small collectives here serve agreeing on a plan when it is built,
sharing per-parameter findings for an error message, and QK-clip's per-step MAX of attention
logits. Every collective runs on views of its buffers, and on CPU returns only once gloo's
worker thread has let go of them (``settle``), so that no release is left for interpreter exit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh


@dataclass
class Handle:
    """A collective in flight on ``buffers`` (held here, so they outlive it; the collective
    itself got fresh views of them, see ``settle``). ``references``: their storages' reference
    counts without those views."""

    buffers: tuple[Tensor, ...]
    work: dist.Work | None
    references: tuple[int, ...]

    def wait(self) -> Tensor:
        """The last buffer (an all-to-all's receive), once the collective completed (again: at once)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            settle(self.buffers, self.references)
        return self.buffers[-1]


_RELEASE_TIMEOUT_S = 10.0  # a worker that keeps the views longer is left to release them later


def _references(buffers: tuple[Tensor, ...]) -> tuple[int, ...]:
    return tuple(torch._C._storage_Use_Count(b.untyped_storage()._cdata) for b in buffers)


def settle(buffers: tuple[Tensor, ...], references: tuple[int, ...]) -> None:
    """After a completed collective on CPU (gloo), wait until its worker thread has dropped its
    views of ``buffers``. It drops them whenever it next runs; if that is after the interpreter
    began finalizing (a job whose last collective was this one), the release needs the GIL,
    CPython ends the thread instead, the unwind meets a noexcept destructor and the process
    aborts ("terminate called without an active exception"). Accelerator backends release work
    on their own schedule (waiting would stall the host); their views are left to them."""
    if not buffers or buffers[0].device.type != "cpu":
        return
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while _references(buffers) > references and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker thread take the GIL it needs for the release


def _start(collective, buffers: tuple[Tensor, ...], *args: Any, **kwargs: Any) -> Handle:
    """``collective(*views of buffers, *args, async_op=True, **kwargs)`` as a Handle."""
    references = _references(buffers)
    work = collective(*(b.view(b.shape) for b in buffers), *args, async_op=True, **kwargs)
    return Handle(buffers, work, references)


@dataclass(frozen=True)
class Exchange:
    """One ``all_to_all_single`` over ``group``: ``send_counts[g]`` elements of ``send`` go to
    group rank g and ``receive_counts[g]`` arrive from it into ``receive``."""

    send: Tensor
    receive: Tensor
    send_counts: list[int]
    receive_counts: list[int]
    group: dist.ProcessGroup


def launch(exchange: Exchange) -> Handle:
    """Start ``exchange``; ``wait`` on the handle returns its receive buffer."""

    def all_to_all(send_view, receive_view, **kwargs):
        return dist.all_to_all_single(
            receive_view, send_view, exchange.receive_counts, exchange.send_counts, **kwargs
        )

    return _start(all_to_all, (exchange.send, exchange.receive), group=exchange.group)


@dataclass(frozen=True)
class ExchangeGroup:
    """The process group matrices move over. Plans number ranks by mesh index (row-major mesh
    coordinate); ``peers[g]`` is the mesh index of group rank g, ``rank`` this rank's mesh index."""

    group: dist.ProcessGroup | None
    rank: int
    peers: tuple[int, ...]


_SUBSET_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def exchange_group(mesh: DeviceMesh | None) -> ExchangeGroup:
    """The group over all ranks of ``mesh`` (for plain tensors, None: the default group, or no
    group in a single process). A mesh covering part of the job gets a group created by its
    ranks alone (hashed name, no job-wide counter), so ranks on other meshes need not join."""
    if mesh is None:
        if default_world_size() > 1:
            return ExchangeGroup(dist.group.WORLD, dist.get_rank(), tuple(range(dist.get_world_size())))
        return ExchangeGroup(None, 0, (0,))
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1:
        group = mesh.get_group(0)
    elif sorted(ranks) == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    else:
        group = _new_group(ranks, "subset")
    return _numbered(group, ranks)


def _new_group(ranks: list[int], purpose: str) -> dist.ProcessGroup:
    """A group over ``ranks`` made by those ranks alone, once per job and ``purpose``."""
    key = (id(dist.group.WORLD), purpose, *sorted(ranks))  # a re-initialized job gets new groups
    if key not in _SUBSET_GROUPS:
        _SUBSET_GROUPS[key] = dist.new_group(sorted(ranks), use_local_synchronization=True)
    return _SUBSET_GROUPS[key]


def _numbered(group: dist.ProcessGroup, ranks: list[int]) -> ExchangeGroup:
    """``group`` with its ranks numbered by their index in ``ranks`` (mesh order)."""
    index = {r: i for i, r in enumerate(ranks)}
    peers = tuple(index[r] for r in dist.get_process_group_ranks(group))
    return ExchangeGroup(group, index[dist.get_rank()], peers)


def backward_group(mesh: DeviceMesh | None) -> ExchangeGroup:
    """A group of its own over the ranks of ``mesh`` (None: the default group's), for steps begun
    in backward: its exchanges, launched from gradient hooks, are then never ordered among the
    model's own collectives (FSDP2's reduce-scatters), and each rank sees them in plan order."""
    if default_world_size() == 1 and mesh is None:
        return ExchangeGroup(None, 0, (0,))
    ranks = mesh.mesh.flatten().tolist() if mesh is not None else list(range(dist.get_world_size()))
    return _numbered(_new_group(ranks, "backward"), ranks)


class ExchangeSite:
    """Where a step's exchanges and checks run: ``mesh`` (None: plain tensors, over the default
    group) and its ``ExchangeGroup``, made on first use (a subset mesh's group is a collective of
    its ranks). ``rank`` is this rank's mesh index, known without communication."""

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self.mesh = mesh
        self._group: ExchangeGroup | None = None
        self._backward: ExchangeGroup | None = None

    @property
    def group(self) -> ExchangeGroup:
        if self._group is None:
            self._group = exchange_group(self.mesh)
        return self._group

    @property
    def backward(self) -> ExchangeGroup:
        """The group of steps begun in backward (``backward_group``), made on first use."""
        if self._backward is None:
            self._backward = backward_group(self.mesh)
        return self._backward

    @property
    def rank(self) -> int:
        if self.mesh is None:
            return default_rank()
        return self.mesh.mesh.flatten().tolist().index(dist.get_rank())


def default_world_size() -> int:
    """World size of the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_rank() -> int:
    """This process's rank in the default process group, 0 when there is none."""
    return dist.get_rank() if default_world_size() > 1 else 0


def all_max(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Element-wise maximum of ``values`` over the group (None: the default group), in place and returned."""
    return _start(dist.all_reduce, (values,), op=dist.ReduceOp.MAX, group=group).wait()


def all_sum(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Element-wise sum of ``values`` over the group (None: the default group), in place and
    returned, settled like every collective here (for callers such as the recipe, whose last
    collective before exit must not leave a release to interpreter finalization)."""
    return _start(dist.all_reduce, (values,), op=dist.ReduceOp.SUM, group=group).wait()


def all_rows(row: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``row`` (1-D), stacked in group rank order: one ``all_reduce`` of a table that
    each rank fills in its own row. For rare paths such as error messages."""
    table = torch.zeros(dist.get_world_size(group), row.numel(), dtype=row.dtype, device=row.device)
    table[dist.get_rank(group)] = row
    return _start(dist.all_reduce, (table,), group=group).wait()
