"""What a plan's exchanges move, rank by rank, over the network as deployed: GPUs in nodes of
``gpus_per_node`` (consecutive plan ranks, the shard dim innermost as HSDP meshes lay them out),
a link within a node and a slower one between nodes, and a latency per message. Used by the paper
model and the tests (not by the optimizer). Counts follow the planner's own (``Plan.returned``,
``Plan.relayed``, ``Plan.relays_to``), so they are exact for the wire the schedule lays out;
the owners and buckets of a package from before the relay are counted as its exchange ran
(``relaying=False``: each result from its owner to every holder)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.relay import twins

WAYS = ("to owners", "back", "relay")


@dataclass(frozen=True)
class Network:
    """Per GPU, each way: ``node_gbs`` to GPUs of its node, ``link_gbs`` to other nodes (GB/s);
    ``latency_s`` per message a rank sends or receives; ``element_bytes`` on the wire."""

    gpus_per_node: int = 8
    node_gbs: float = 450.0
    link_gbs: float = 50.0
    latency_s: float = 5e-6
    element_bytes: int = 2

    def nodes(self, world: int) -> np.ndarray:
        return np.arange(world) // self.gpus_per_node

    def element_s(self, near: bool) -> float:
        """Seconds per element on a GPU's link within its node (``near``) or to other nodes."""
        return self.element_bytes / ((self.node_gbs if near else self.link_gbs) * 1e9)


@dataclass
class Exchange:
    """One all-to-all: elements each rank sends to and receives from its own node and other
    nodes, and how many peers it sends to and receives from."""

    sent_near: np.ndarray
    sent_far: np.ndarray
    received_near: np.ndarray
    received_far: np.ndarray
    peers_out: np.ndarray
    peers_in: np.ndarray

    @classmethod
    def empty(cls, world: int) -> Exchange:
        return cls(*(np.zeros(world, dtype=np.int64) for _ in range(6)))

    def add(self, src: int, dst: int, elements: int, nodes: np.ndarray) -> None:
        if src == dst or not elements:
            return
        near = nodes[src] == nodes[dst]
        (self.sent_near if near else self.sent_far)[src] += elements
        (self.received_near if near else self.received_far)[dst] += elements

    def count(self, pairs: set[tuple[int, int]]) -> None:
        """The peers each rank sends to and receives from (``pairs``: source, destination)."""
        for src, dst in pairs:
            self.peers_out[src] += 1
            self.peers_in[dst] += 1

    def seconds(self, network: Network) -> float:
        """The busiest rank's time: each tier's larger of bytes sent and received over its rate,
        the slower tier's, and a latency per peer (messages to and from a peer overlap)."""
        if not (self.sent_near.any() or self.sent_far.any()):
            return 0.0
        size = network.element_bytes
        near = np.maximum(self.sent_near, self.received_near) * size / (network.node_gbs * 1e9)
        far = np.maximum(self.sent_far, self.received_far) * size / (network.link_gbs * 1e9)
        latency = np.maximum(self.peers_out, self.peers_in) * network.latency_s
        return float((np.maximum(near, far) + latency).max())

    @property
    def sent(self) -> np.ndarray:
        return self.sent_near + self.sent_far

    @property
    def received(self) -> np.ndarray:
        return self.received_near + self.received_far


def bucket_traffic(plan: Plan, k: int, nodes: np.ndarray, relaying: bool = True) -> dict[str, Exchange]:
    """Bucket ``k``'s exchanges to and from the owners, rank by rank; ``relaying`` False: each
    result goes from its owner to every holder (the way back before the relay)."""
    world = plan.world_size
    out = {way: Exchange.empty(world) for way in WAYS[:2]}
    pairs: dict[str, set[tuple[int, int]]] = {way: set() for way in WAYS[:2]}
    for j in plan.buckets[k].matrices:
        m, owner = plan.matrices[j], plan.owners[j]
        for r in plan.senders[j] - {owner}:
            out["to owners"].add(r, owner, m.pieces[r].numel, nodes)
            pairs["to owners"].add((r, owner))
        for r, piece in enumerate(m.pieces):
            if r == owner or not piece.numel:
                continue
            first, stop = plan.returned(j, r) if relaying else (0, piece.rows)
            if stop > first:
                out["back"].add(owner, r, (stop - first) * piece.cols, nodes)
                pairs["back"].add((owner, r))
    for way, exchange in out.items():
        exchange.count(pairs[way])
    return out


def relay_traffic(plan: Plan, g: int, nodes: np.ndarray) -> Exchange:
    """Relay ``g`` (``Plan.relays``), rank by rank."""
    out = Exchange.empty(plan.world_size)
    pairs: set[tuple[int, int]] = set()
    classes = {c for j in plan.relays[g].matrices if (t := twins(plan.matrices[j])) for c in t.classes}
    for ranks in sorted(classes):
        _relay(plan, g, ranks, nodes, out, pairs)
    out.count(pairs)
    return out


def _relay(plan: Plan, k: int, ranks: tuple[int, ...], nodes: np.ndarray, out: Exchange, pairs: set) -> None:
    """The relay among one class of twins in bucket ``k``: position c sends the part of each
    member's piece it relays to every position but its own and the owner's replica's."""
    cuts = plan.cuts(k, ranks)
    count = len(ranks)
    sizes = np.zeros((len(cuts.members), count), dtype=np.int64)  # [member, position]
    home = np.zeros(len(cuts.members), dtype=np.int64)  # the owner's replica's position
    for i, j in enumerate(cuts.members):
        cols = plan.matrices[j].pieces[ranks[0]].cols
        sizes[i] = [(b - a) * cols for a, b in (cuts.rows_of(j, c) for c in range(count))]
        copies = twins(plan.matrices[j])
        assert copies is not None  # (a member of a class of twins)
        home[i] = copies.position[plan.matrices[j].replica(plan.owners[j])]
    # moved[c, b]: what position c relays to position b
    moved = sizes.sum(0)[:, None] - _by_home(sizes, home, count)
    np.fill_diagonal(moved, 0)
    for c in range(count):
        for b in np.nonzero(moved[c])[0]:
            out.add(ranks[c], ranks[b], int(moved[c, b]), nodes)
            pairs.add((ranks[c], ranks[int(b)]))


def _by_home(sizes: np.ndarray, home: np.ndarray, count: int) -> np.ndarray:
    """[c, b]: the elements of part c of the members whose owner's replica is at position b."""
    out = np.zeros((count, count), dtype=np.int64)
    np.add.at(out.T, home, sizes)
    return out


@dataclass(frozen=True)
class Traffic:
    """A plan's exchanges on a ``Network``: per bucket (``exchanges[k][way]``, its relays' in
    "relay", which run one after another)."""

    exchanges: list[dict[str, list[Exchange]]]
    network: Network

    @classmethod
    def of(cls, plan: Plan, network: Network, relaying: bool = True) -> Traffic:
        nodes = network.nodes(plan.world_size)
        out: list[dict[str, list[Exchange]]] = []
        for k in range(len(plan.buckets)):
            ways = bucket_traffic(plan, k, nodes, relaying)
            relays = [relay_traffic(plan, g, nodes) for g, r in enumerate(plan.relays) if r.bucket == k]
            out.append({**{way: [e] for way, e in ways.items()}, "relay": relays if relaying else []})
        return cls(out, network)

    def seconds(self, way: str) -> list[float]:
        """Each bucket's exchanges ``way`` on the network, one after another."""
        return [sum(e.seconds(self.network) for e in bucket[way]) for bucket in self.exchanges]

    def relay_seconds(self) -> list[float]:
        """Each relay on the network, in order."""
        return [e.seconds(self.network) for bucket in self.exchanges for e in bucket["relay"]]

    def total(self, field: str, ways: Sequence[str] = WAYS) -> np.ndarray:
        """Every rank's elements of ``field`` (an ``Exchange`` attribute) over the step."""
        parts = [getattr(e, field) for b in self.exchanges for w in ways for e in b[w]]
        return sum(parts, np.zeros(1, np.int64))


def least_far(plan: Plan, nodes: np.ndarray) -> float:
    """Mean elements per rank that must cross between nodes in a step of any schedule that
    orthogonalizes each matrix once in the job (on its owner's node): the pieces of a matrix that
    its owner's node does not hold, once to that node; and its rows held on each other node,
    once into that node (each node's rows of a matrix counted once however many of its GPUs
    hold them)."""
    total = 0
    for m, owner in zip(plan.matrices, plan.owners, strict=True):
        by_node: dict[int, set[tuple[int, int, int, int]]] = {}
        for r, p in enumerate(m.pieces):
            if p.numel:
                by_node.setdefault(int(nodes[r]), set()).add((p.row, p.rows, p.col, p.cols))
        home = int(nodes[owner])
        for node, pieces in by_node.items():
            held = covered(pieces, m.rows, m.cols)
            total += m.numel - held if node == home else held
    return total / plan.world_size


def covered(pieces: set[tuple[int, int, int, int]], rows: int, cols: int) -> int:
    """Elements covered by rectangles (row, rows, col, cols) of a rows x cols matrix."""
    if all(col == 0 and c == cols for _, _, col, c in pieces):  # row blocks: their rows' union
        covered, reach = 0, 0
        for row, r, _, _ in sorted(pieces):
            covered += max(0, row + r - max(row, reach))
            reach = max(reach, row + r)
        return covered * cols
    grid = np.zeros((rows, cols), dtype=bool)
    for row, r, col, c in pieces:
        grid[row : row + r, col : col + c] = True
    return int(grid.sum())
