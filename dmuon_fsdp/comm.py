"""The only module calling torch.distributed: a passive transport and the groups it uses.

``launch`` starts one ``all_to_all_single`` of an ``Exchange`` (buffers and split sizes in
process-group rank order, as ``dmuon_fsdp.exchange`` lays them out) and returns a handle to
wait on. ``ExchangeSite`` is where a step's exchanges and checks run: the ranks matrices move
between and the process group over them. The small collectives here serve agreeing on a plan when it is built,
sharing per-parameter findings for an error message, and QK-clip's per-step MAX of attention
logits. Every collective runs on views of its buffers, and on CPU returns only once gloo's
worker thread has let go of them (``settle``), so that no release is left for interpreter exit.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from dmuon_fsdp import layouts


@dataclass
class Handle:
    """A collective in flight on ``buffers`` (held here, so they outlive it). The collective got
    ``views`` of them made for it alone; ``references`` are their Python reference counts
    before it took them (see ``settle``)."""

    buffers: tuple[Tensor, ...]
    work: dist.Work | None
    views: tuple[Tensor, ...]
    references: tuple[int, ...]

    def wait(self) -> Tensor:
        """The last buffer (an all-to-all's receive), once the collective completed (again: at once)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
            settle(self.views, self.references)
            self.views = ()
        return self.buffers[-1]


_RELEASE_TIMEOUT_S = 10.0  # a worker that keeps the views longer is left to release them later


def settle(views: tuple[Tensor, ...], references: tuple[int, ...]) -> None:
    """After a completed collective on CPU (gloo), wait until its worker thread has dropped the
    ``views`` it was given. It drops them whenever it next runs; if that is after the interpreter
    began finalizing (a job whose last collective was this one), the release needs the GIL,
    CPython ends the thread instead, the unwind meets a noexcept destructor and the process
    aborts ("terminate called without an active exception"). While C++ holds a tensor that has
    a Python object, that object counts one reference more, which the release takes back: so
    the views' own reference counts tell when the worker is done with them, whatever other views
    of the same memory come and go meanwhile (buffers of a pool shared by several programs).
    The views themselves are dropped afterwards, here. Accelerator backends release work on
    their own schedule (waiting would stall the host); their views are left to them."""
    if not views or views[0].device.type != "cpu":
        return
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while _references(views) != references and time.monotonic() < deadline:
        time.sleep(0)  # lets the worker thread take the GIL it needs for the release


def _references(views: tuple[Tensor, ...]) -> tuple[int, ...]:
    return tuple(sys.getrefcount(v) for v in views)


def _start(
    collective: Callable[..., dist.Work | None], buffers: tuple[Tensor, ...], *args: Any, **kwargs: Any
) -> Handle:
    """``collective(*views of buffers, *args, async_op=True, **kwargs)`` as a Handle."""
    views = tuple(b.view(b.shape) for b in buffers)
    references = _references(views)
    work = collective(*views, *args, async_op=True, **kwargs)
    return Handle(buffers, work, views, references)


@dataclass(frozen=True)
class Exchange:
    """One ``all_to_all_single`` over ``process_group``: ``send_counts[g]`` elements of ``send`` go to
    group rank g and ``receive_counts[g]`` arrive from it into ``receive``."""

    send: Tensor
    receive: Tensor
    send_counts: list[int]
    receive_counts: list[int]
    process_group: dist.ProcessGroup | None  # None: the default group


def launch(exchange: Exchange) -> Handle:
    """Start ``exchange``; ``wait`` on the handle returns its receive buffer."""

    def all_to_all(send_view: Tensor, receive_view: Tensor, **kwargs: Any) -> dist.Work | None:
        return dist.all_to_all_single(
            receive_view, send_view, exchange.receive_counts, exchange.send_counts, **kwargs
        )

    return _start(all_to_all, (exchange.send, exchange.receive), group=exchange.process_group)


@dataclass(frozen=True)
class ExchangeGroup:
    """The process group matrices move over. Plans number ranks by their order among the
    exchange's global ranks; ``peers[g]`` is the plan index of group rank g, ``rank`` this
    rank's."""

    process_group: dist.ProcessGroup | None
    rank: int
    peers: tuple[int, ...]


_SUBSET_GROUPS: dict[tuple[Any, ...], dist.ProcessGroup] = {}


def exchange_group(ranks: Sequence[int], meshes: Sequence[DeviceMesh] = ()) -> ExchangeGroup:
    """The group over ``ranks`` (global ranks in plan order): the default group when they are
    the whole job (or no group in a single process), the group of a 1-D mesh among ``meshes``
    over exactly them, else one created by those ranks alone (hashed name, no job-wide
    counter), so that ranks exchanging elsewhere need not join."""
    ranks = list(ranks)
    if ranks == list(range(default_world_size())):
        if len(ranks) == 1:
            return ExchangeGroup(None, 0, (0,))
        group = dist.group.WORLD
        assert group is not None  # a job of more than one rank has initialized torch.distributed
    else:
        groups = [m.get_group(0) for m in meshes if m.ndim == 1 and sorted(m.mesh.tolist()) == ranks]
        group = groups[0] if groups else _new_group(ranks, "subset")
    return _numbered(group, ranks)


def _new_group(ranks: list[int], purpose: str) -> dist.ProcessGroup:
    """A group over ``ranks`` made by those ranks alone, once per job and ``purpose``."""
    key = (id(dist.group.WORLD), purpose, *sorted(ranks))  # a re-initialized job gets new groups
    if key not in _SUBSET_GROUPS:
        _SUBSET_GROUPS[key] = dist.new_group(sorted(ranks), use_local_synchronization=True)
    return _SUBSET_GROUPS[key]


def _numbered(group: dist.ProcessGroup, ranks: list[int]) -> ExchangeGroup:
    """``group`` with its ranks numbered by their index in ``ranks`` (plan order)."""
    index = {r: i for i, r in enumerate(ranks)}
    peers = tuple(index[r] for r in dist.get_process_group_ranks(group))
    return ExchangeGroup(group, index[dist.get_rank()], peers)


def backward_group(ranks: Sequence[int]) -> ExchangeGroup:
    """A group of its own over ``ranks``, for steps begun in backward: its exchanges, launched
    from gradient hooks, are then never ordered among the model's own collectives (FSDP2's
    reduce-scatters), and each rank sees them in plan order."""
    if default_world_size() == 1:
        return ExchangeGroup(None, 0, (0,))
    return _numbered(_new_group(list(ranks), "backward"), list(ranks))


class ExchangeSite:
    """Where a step's exchanges and checks run: the global ``ranks`` the matrices move between,
    in plan order (``layouts.exchange_ranks``), and their ``ExchangeGroup``, made on first use
    (a group over part of the job is a collective of its ranks); ``meshes``: the Muon
    parameters' meshes, whose own group may serve. ``rank`` is this rank's plan index, known
    without communication."""

    def __init__(self, ranks: Sequence[int], meshes: Sequence[DeviceMesh] = ()) -> None:
        self.ranks = tuple(ranks)
        self.meshes = tuple(meshes)
        self._group: ExchangeGroup | None = None
        self._backward: ExchangeGroup | None = None

    @property
    def group(self) -> ExchangeGroup:
        if self._group is None:
            self._group = exchange_group(self.ranks, self.meshes)
        return self._group

    @property
    def backward(self) -> ExchangeGroup:
        """The group of steps begun in backward (``backward_group``), made on first use."""
        if self._backward is None:
            self._backward = backward_group(self.ranks)
        return self._backward

    @property
    def rank(self) -> int:
        return self.ranks.index(default_rank())


def default_world_size() -> int:
    """World size of the default process group, 1 when there is none."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def default_rank() -> int:
    """This process's rank in the default process group, 0 when there is none."""
    return dist.get_rank() if default_world_size() > 1 else 0


def start_max(values: Tensor, group: dist.ProcessGroup | None) -> Handle:
    """Start the element-wise maximum of ``values`` over the group (None: the default group), in
    place; ``wait`` on the handle returns ``values``."""
    return _start(dist.all_reduce, (values,), op=dist.ReduceOp.MAX, group=group)


def all_max(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Element-wise maximum of ``values`` over the group (None: the default group), in place and returned."""
    return start_max(values, group).wait()


def all_rows(row: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``row`` (1-D), stacked in group rank order: one ``all_reduce`` of a table that
    each rank fills in its own row. For rare paths such as error messages."""
    table = torch.zeros(dist.get_world_size(group), row.numel(), dtype=row.dtype, device=row.device)
    table[dist.get_rank(group)] = row
    return _start(dist.all_reduce, (table,), group=group).wait()


def exchange_ranks(meshes: dict[Any, str]) -> tuple[int, ...]:
    """The global ranks Muon matrices move between, in plan order, for the meshes ``meshes`` (mesh
    -> a parameter's name on it) that Muon parameters live on: the ranks linked by copies of
    them (``layouts.exchange_ranks``), each mesh's copies holding every one of them once.
    Plain tensors (None) move between every rank of the job, and cannot mix with DTensors."""
    if None in meshes and len(meshes) > 1:
        mesh, name = next((m, n) for m, n in meshes.items() if m is not None)
        raise ValueError(
            f"{meshes[None]} is a plain tensor but {name} is a DTensor on {mesh}: all Muon parameters "
            "must be DTensors, or all plain tensors"
        )
    if not meshes or None in meshes:
        return tuple(range(default_world_size()))
    ranks = layouts.exchange_ranks(meshes, default_rank())
    for mesh, name in meshes.items():
        layouts.copies_over(mesh, ranks, name)  # every mesh holds each of the ranks once
    return ranks


def exchange_site(meshes: dict[Any, str], params: list[Tensor]) -> ExchangeSite:
    """Where a step's exchanges and checks run: between the Muon parameters' ranks, or without
    Muon parameters those of the first DTensor's mesh (plain tensors: every rank)."""
    if not meshes:
        first = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        meshes = {first: ""}
    return ExchangeSite(exchange_ranks(meshes), [m for m in meshes if m is not None])
