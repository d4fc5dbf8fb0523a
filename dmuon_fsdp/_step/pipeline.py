"""The bucket pipeline's cost model: how long a step of a cut into buckets takes.

Pure: no collectives and no tensors. The planner (``dmuon_fsdp._step.planner``) predicts with it
the step of each cut it considers and keeps the fastest (``step_flops``: in flops, one link);
the paper model (``benchmarks.paper``) times steps with it in seconds, from the end of backward,
exchanges begun in backward included, with the critical path by kind (``timeline``). The loop
is written once (``_bucket_loop``), over either clock. The model is the bucket loop's
([Note: the bucket loop] in ``dmuon_fsdp._step.run``), on devices that run the Newton-Schulz
(NS) of the matrices each rank owns, and one link that carries one all-to-all at a time, in the
order every rank launches them:

- an all-to-all starts once every rank's device is through the work before its launch (its
  buffer is ready) and the one launched before it has ended, and lasts the busiest rank's
  larger of elements sent and received, times ``flops_per_element``: the NS flops a device runs
  in the time the link moves one element (its NS rate over its link's, in elements);
- bucket k's NS starts on each of its owners once bucket k arrived, bucket k - 2's results were
  applied (its way back shares bucket k's slot), bucket k - 3's relays across replicas were
  applied and the owner is through its earlier buckets;
- the exchanges to the owners of buckets 0 and 1 are launched first, then bucket k + 1's at the
  start of bucket k (after bucket k - 1's NS and return), each bucket's return after its NS,
  and bucket k's relays (``dmuon_fsdp._step.relay``; one transfer here, as long as they are one
  after another) once its return arrived, before bucket k + 2's NS.

A bucket's host work (its few dozen launches) is counted as ``BUCKET_HOST_FLOPS`` per bucket
(``cut_flops``): a cut into more buckets must save more than that. What it leaves out:
element-wise work and exchanges of different ranks that could share the link; the planner's
clock also leaves out links of two speeds (within and across nodes: the paper model's seconds
per exchange hold them) and a step begun in backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# About 0.25 ms of host work per bucket (its launches, and a wait at each exchange) as the NS
# flops a GPU runs meanwhile (400 TFLOP/s): next to nothing beside a large model's buckets, and
# more than a small model's exchanges could ever hide.
BUCKET_HOST_FLOPS = 1e11


@dataclass(frozen=True)
class Load:
    """One bucket as the model sees it: the busiest rank's elements in its exchange to the owners,
    in its way back and in its relay across replicas (0: none), and the NS flops of each owner
    in it."""

    to_owners: int
    back: int
    ns: dict[int, int]
    relay: int = 0


class _Clock(Protocol):
    """Time as the bucket loop (``_bucket_loop``) spends it: exchanges on the one link in the
    order they are launched, each owner's Newton-Schulz, and what every rank waited for."""

    def transfer(self, k: int, way: str) -> Any: ...  # launched now: its end
    def at(self, k: int) -> Any: ...  # bucket k's exchange to its owners, launched in backward
    def wait(self, *ends: Any) -> None: ...  # every rank waits for these ends
    def orthogonalize(self, k: int) -> None: ...  # bucket k's NS on each of its owners
    def none(self) -> Any: ...  # an end that is no later than anything


def _bucket_loop(n: int, clock: _Clock, started: int) -> list[Any]:
    """The order of the bucket loop ([Note: the bucket loop] in ``dmuon_fsdp._step.run``) on a
    ``clock``, its first ``started`` buckets' exchanges to the owners launched in backward;
    returns the ends of the relays, which end the step with the devices and the link."""
    to_end = [clock.at(k) for k in range(started)]
    back_end: list[Any] = []
    relay_end: list[Any] = []

    def relay(k: int) -> None:  # bucket k's results arrived; its relay starts
        clock.wait(back_end[k], relay_end[k - 2] if k >= 2 else clock.none())
        relay_end.append(clock.transfer(k, "relay"))

    for k in range(n):
        while len(to_end) <= min(n - 1, k + 1):
            to_end.append(clock.transfer(len(to_end), "to owners"))
        clock.wait(to_end[k], relay_end[k - 3] if k >= 3 else clock.none())
        if k >= 2:
            relay(k - 2)
        clock.orthogonalize(k)
        back_end.append(clock.transfer(k, "back"))
    for k in range(max(0, n - 2), n):
        relay(k)
    return relay_end


class _Floats:
    """A clock of floats (the planner's, fast): loads in elements and flops."""

    def __init__(self, loads: Sequence[Load], flops_per_element: float) -> None:
        self.loads, self.per_element = loads, flops_per_element
        self.link = 0.0  # when the link is through every exchange launched so far
        self.waited = 0.0  # what every rank has waited for
        self.own: dict[int, float] = {}  # an owner's device: through its NS so far
        self.busiest = 0.0  # the latest of those

    def transfer(self, k: int, way: str) -> float:
        load = self.loads[k]
        elements = load.to_owners if way == "to owners" else load.back if way == "back" else load.relay
        if not elements and way == "relay":
            return self.waited
        self.link = max(self.link, self.waited, self.busiest) + elements * self.per_element
        return self.link

    def at(self, k: int) -> float:
        raise NotImplementedError("the planner's clock starts at step")

    def wait(self, *ends: float) -> None:
        self.waited = max(self.waited, *ends)

    def orthogonalize(self, k: int) -> None:
        own, waited = self.own, self.waited
        for owner, flops in self.loads[k].ns.items():
            own[owner] = end = max(own.get(owner, 0.0), waited) + flops
            if end > self.busiest:
                self.busiest = end

    def none(self) -> float:
        return 0.0


def step_flops(loads: Sequence[Load], flops_per_element: float) -> float:
    """The predicted step of buckets with these ``loads``, as flops of one device (the time the
    last exchange ends, from the first launch)."""
    clock = _Floats(loads, flops_per_element)
    relays = _bucket_loop(len(loads), clock, 0)
    return max(clock.waited, clock.busiest, clock.link, *relays)


KINDS = ("NS", "to owners", "back", "relay", "spill")  # of a ``Timeline``'s critical path


@dataclass(frozen=True)
class Timeline:
    """A step of the bucket loop in seconds: when its last exchange or Newton-Schulz ends
    (``end``), and what the critical path after ``start`` spent by kind (``KINDS``; "spill": the
    exchanges to the owners launched in backward that were still on the link)."""

    end: float
    path: dict[str, float]


class _Events:
    """A clock of events in seconds, each with the event it waited for (the critical path)."""

    def __init__(
        self,
        seconds: Mapping[str, Sequence[float]],
        ns: Sequence[dict[int, float]],
        start: float,
        started: Sequence[float],
    ) -> None:
        self.seconds, self.ns, self.started = seconds, ns, started
        self.starts, self.ends, self.preds, self.kinds = [start], [start], [-1], [""]  # event 0: start
        self.link = self.waited = self.busiest = 0
        self.own: dict[int, int] = {}

    def event(self, begin: int, seconds: float, kind: str) -> int:
        self.starts.append(self.ends[begin])
        self.ends.append(self.ends[begin] + seconds)
        self.preds.append(begin)
        self.kinds.append(kind)
        return len(self.ends) - 1

    def later(self, *events: int) -> int:
        return max(events, key=self.ends.__getitem__)

    def transfer(self, k: int, way: str) -> int:
        self.link = self.event(self.later(self.link, self.waited, self.busiest), self.seconds[way][k], way)
        return self.link

    def at(self, k: int) -> int:
        self.starts.append(self.started[k])
        self.ends.append(self.started[k])
        self.preds.append(-1)
        self.kinds.append("")
        self.link = self.event(
            self.later(len(self.ends) - 1, self.link), self.seconds["to owners"][k], "spill"
        )
        return self.link

    def wait(self, *ends: int) -> None:
        self.waited = self.later(self.waited, *ends)

    def orthogonalize(self, k: int) -> None:
        for owner, seconds in self.ns[k].items():
            self.own[owner] = self.event(self.later(self.own.get(owner, 0), self.waited), seconds, "NS")
            self.busiest = self.later(self.busiest, self.own[owner])

    def none(self) -> int:
        return 0


def timeline(
    seconds: Mapping[str, Sequence[float]],
    ns: Sequence[dict[int, float]],
    start: float = 0.0,
    started: Sequence[float] = (),
) -> Timeline:
    """The bucket loop from ``start`` (the end of backward): ``seconds[way][k]`` each exchange's
    time on the link (ways "to owners", "back", "relay"), ``ns[k]`` each owner's NS seconds in
    bucket k, ``started[k]`` when the buckets begun in backward launched their exchange to the
    owners."""
    clock = _Events(seconds, ns, start, started)
    relays = _bucket_loop(len(ns), clock, len(started))
    final = clock.later(clock.waited, clock.busiest, clock.link, *relays)
    path = dict.fromkeys(KINDS, 0.0)
    e = final
    while e >= 0 and clock.ends[e] > start:
        if clock.kinds[e]:
            path[clock.kinds[e]] += clock.ends[e] - max(clock.starts[e], start)
        e = clock.preds[e]
    return Timeline(clock.ends[final], path)


def cut_flops(loads: Sequence[Load], flops_per_element: float) -> float:
    """A cut's predicted step (``step_flops``) and its buckets' host work."""
    return step_flops(loads, flops_per_element) + len(loads) * BUCKET_HOST_FLOPS
