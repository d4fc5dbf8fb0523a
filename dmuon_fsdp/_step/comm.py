"""The only module calling torch.distributed: a passive transport and the groups it uses.

``launch`` starts one ``all_to_all_single`` of an ``Exchange`` (buffers and split sizes in
process-group rank order, as ``dmuon_fsdp._step.schedule`` lays them out) and returns a handle to
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

from dmuon_fsdp._step import layouts


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
    their own schedule (waiting would stall the host): they get the buffers themselves."""
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
    """``collective(*views of buffers, *args, async_op=True, **kwargs)`` as a Handle; on an
    accelerator, of the buffers themselves (``settle`` waits for CPU views alone: a view is an op)."""
    cpu = buffers[0].device.type == "cpu"
    views = tuple(b.view(b.shape) for b in buffers) if cpu else buffers
    references = _references(views) if cpu else ()
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


def wait(handle: Handle | None) -> Tensor | None:
    """Wait for an exchange launched (None: none was)."""
    return handle.wait() if handle is not None else None


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


_GROUPS: dict[tuple[Any, ...], dist.ProcessGroup] = {}


def exchange_group(ranks: Sequence[int], meshes: Sequence[DeviceMesh] = ()) -> ExchangeGroup:
    """The group over ``ranks`` (global ranks in plan order), made by no one when it can be
    found (see [Note: groups]): the default group when they are the whole job (or no group in
    a single process), else the group of a dim of one of ``meshes``, or of a mesh flattened
    from their root, over exactly them; else one made by those ranks alone, which only a job
    whose communicators are made lazily allows (an error names the way out otherwise)."""
    ranks = list(ranks)
    if ranks == list(range(default_world_size())):
        if len(ranks) == 1:
            return ExchangeGroup(None, 0, (0,))
        group = dist.group.WORLD
        assert group is not None  # a job of more than one rank has initialized torch.distributed
        return _numbered(group, ranks)
    found = _mesh_group(ranks, meshes)
    if found is None:
        if _splits_the_default_group():
            raise ValueError(
                f"the Muon parameters' matrices move between global ranks {sorted(ranks)}, part of the "
                f"job's {default_world_size()}, and no dim of their meshes spans exactly those ranks; with a "
                "device bound to the default process group (init_process_group(device_id=...)) a group over "
                "part of the job must be made by every rank of the job, which the optimizer cannot ask of "
                "the others: flatten the dims that span them on every rank before building the optimizer "
                "(e.g. world_mesh['dp_replicate', 'dp_shard', 'tp']._flatten('dmuon'), as torchtitan "
                "flattens its 'dp' mesh), or initialize the process group without device_id"
            )
        found = _made_group(ranks, "subset", members_only=True)
    return _numbered(found, ranks)


def _mesh_group(ranks: list[int], meshes: Sequence[DeviceMesh]) -> dist.ProcessGroup | None:
    """The group of a dim of one of ``meshes`` (or of a mesh flattened from their root mesh)
    whose ranks are exactly ``ranks``, if any."""
    candidates = list(meshes)
    for mesh in meshes:
        root = mesh._get_root_mesh()
        candidates += [root, *getattr(root, "_flatten_mapping", {}).values()]
    for mesh in candidates:
        if mesh.get_coordinate() is None:  # this rank is in none of its groups
            continue
        for dim in range(mesh.ndim):
            group = mesh.get_group(dim)
            if sorted(dist.get_process_group_ranks(group)) == sorted(ranks):
                return group
    return None


def _splits_the_default_group() -> bool:
    """Whether torch makes a new group by splitting the default group's communicator, a
    collective of every rank of the job: when a device is bound to it (eager initialization,
    ``init_process_group(device_id=...)``) and its backend there can split (NCCL)."""
    world = dist.group.WORLD
    device = world.bound_device_id if world is not None else None
    if world is None or device is None:
        return False
    try:
        return bool(world._get_backend(device).supports_splitting)
    except RuntimeError:  # no backend for the bound device
        return False


def _made_group(ranks: list[int], purpose: str, members_only: bool) -> dist.ProcessGroup:
    """A group over ``ranks``, once per job and ``purpose``: made by those ranks alone
    (``members_only``) or by every rank of the job in the same order."""
    key = (id(dist.group.WORLD), purpose, *sorted(ranks))  # a re-initialized job gets new groups
    if key not in _GROUPS:
        group = dist.new_group(sorted(ranks), use_local_synchronization=members_only)
        if not isinstance(group, dist.ProcessGroup):  # a non-member's marker; only members ask
            raise RuntimeError(
                f"rank {dist.get_rank()} is not among the ranks {sorted(ranks)} of the {purpose} group"
            )
        _GROUPS[key] = group
    return _GROUPS[key]


def _numbered(group: dist.ProcessGroup, ranks: list[int]) -> ExchangeGroup:
    """``group`` with its ranks numbered by their index in ``ranks`` (plan order)."""
    index = {r: i for i, r in enumerate(ranks)}
    peers = tuple(index[r] for r in dist.get_process_group_ranks(group))
    return ExchangeGroup(group, index[dist.get_rank()], peers)


def side_group(ranks: Sequence[int], exchange: ExchangeGroup) -> ExchangeGroup:
    """The group of the exchanges that run beside the model's own collectives (see [Note:
    groups]): those of steps begun in backward, which gradient hooks launch, and the relays a
    step leaves to the next forward, which each rank waits for where it first needs them. Over
    the whole job a group of its own, made by every rank, so that none is queued among FSDP2's
    or DDP's collectives nor behind them; over part of the job, ``exchange`` itself (the group
    of the ranks' mesh, as a rule). Every rank must ask for it at the same point: after the
    ranks agreed on the plan that needs it."""
    if exchange.process_group is None or list(ranks) != list(range(default_world_size())):
        return exchange
    return _numbered(_made_group(list(ranks), "side", members_only=False), list(ranks))


class ExchangeSite:
    """Where a step's exchanges and checks run: the global ``ranks`` the matrices move between,
    in plan order (``layouts.exchange_ranks``), and their ``ExchangeGroup`` (``group``), found
    or made when the site is (at construction); ``side``, the group of steps begun in backward
    and of relays left to the next forward (``side_group``), made at the first plan that needs
    it, once every rank agreed on it (a group every rank of the job makes). ``meshes``: the Muon parameters'
    meshes, whose own groups may serve. ``rank`` is this rank's plan index.

    [Note: groups] Under eager initialization (a device bound to the default group) torch makes
    every new group by splitting the default communicator, a collective of every rank of the
    job in the same order, members or not. So the optimizer makes a group only where every rank
    of the job makes the same one at the same point (a group over the whole job, when every
    rank agreed on the first plan that needs it), and otherwise takes a group the parameters'
    meshes already have: DeviceMesh made those collectively when it was built. A group over
    part of the job found on no mesh (HSDP or FSDP + TP inside a pipeline stage, unflattened)
    is made by its members where communicators are made lazily, and is an error at
    construction where they are not.
    """

    def __init__(self, ranks: Sequence[int], meshes: Sequence[DeviceMesh] = ()) -> None:
        self.ranks = tuple(ranks)
        self.meshes = tuple(meshes)
        self.group = exchange_group(self.ranks, self.meshes)
        self._side: ExchangeGroup | None = None

    @property
    def side(self) -> ExchangeGroup:
        if self._side is None:
            self._side = side_group(self.ranks, self.group)
        return self._side

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


def check_backend(param: Tensor, name: str) -> None:
    """Refuse a Muon parameter on a device its process groups have no backend for (CPU tensors
    in a job of NCCL alone), when it is added: its exchanges would fail on every rank."""
    if default_world_size() == 1:
        return
    group = param.device_mesh.get_group(0) if isinstance(param, DTensor) else dist.group.WORLD
    config = str(dist.get_backend_config(group))
    backends = {part.split(":")[0] for part in config.split(",") if ":" in part}
    if backends and param.device.type not in backends:
        kind = param.device.type
        raise ValueError(
            f"{name} is on {kind}, but the process group its Muon matrices move over has no backend for "
            f"{kind} ({config}): keep the parameters on {' or '.join(sorted(backends))}, or initialize the "
            "process group with a backend for each device (e.g. 'cpu:gloo,cuda:nccl')"
        )


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
