"""The bucket pipeline's cost model: how long a step of a cut into buckets takes, in flops.

Pure: no collectives and no tensors. The planner (``dmuon_fsdp._step.planner``) predicts with it
the step of each cut it considers and keeps the fastest. The model is the bucket loop's
([Note: the bucket loop] in ``dmuon_fsdp._step.run``), on devices that run the Newton-Schulz
(NS) of the matrices each rank owns, and one link that carries one all-to-all at a time, in the
order every rank launches them:

- an all-to-all starts once every rank's device is through the work before its launch (its
  buffer is ready) and the one launched before it has ended, and lasts the busiest rank's
  larger of elements sent and received, times ``flops_per_element``: the NS flops a device runs
  in the time the link moves one element (its NS rate over its link's, in elements);
- bucket k's NS starts on each of its owners once bucket k arrived, bucket k - 2's results were
  applied (its way back shares bucket k's slot), bucket k - 3's relay across replicas was
  applied (its relay buffers are bucket k - 1's) and the owner is through its earlier buckets;
- the exchanges to the owners of buckets 0 and 1 are launched first, then bucket k + 1's at the
  start of bucket k (after bucket k - 1's NS and return), each bucket's return after its NS,
  and bucket k's relay (``dmuon_fsdp._step.relay``) once its return arrived, before bucket
  k + 2's NS.

A bucket's host work (its few dozen launches) is counted as ``BUCKET_HOST_FLOPS`` per bucket
(``cut_flops``): a cut into more buckets must save more than that. What it leaves out:
element-wise work, exchanges of different ranks that could share the link, and a step begun in
backward. It ranks cuts; it does not time steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def step_flops(loads: Sequence[Load], flops_per_element: float) -> float:
    """The predicted step of buckets with these ``loads``, as flops of one device (the time the
    last return ends, from the first launch)."""
    n = len(loads)
    link = 0.0  # when the link is through every exchange launched so far
    waited = 0.0  # what every rank has waited for
    own: dict[int, float] = {}  # an owner's device: through its NS so far
    to_end, back_end, relay_end = [0.0] * n, [0.0] * n, [0.0] * n

    def ready() -> float:  # every rank's device through what it launched
        return max(waited, max(own.values(), default=0.0))

    def transfer(elements: int) -> float:
        nonlocal link
        link = max(link, ready()) + elements * flops_per_element
        return link

    def relay(k: int) -> None:  # bucket k's results arrived; its relay starts
        nonlocal waited
        waited = max(waited, back_end[k], relay_end[k - 2] if k >= 2 else 0.0)
        relay_end[k] = transfer(loads[k].relay) if loads[k].relay else back_end[k]

    launched = 0
    for k in range(n):
        while launched <= min(n - 1, k + 1):
            to_end[launched] = transfer(loads[launched].to_owners)
            launched += 1
        waited = max(waited, to_end[k], relay_end[k - 3] if k >= 3 else 0.0)
        if k >= 2:
            relay(k - 2)
        for owner, flops in loads[k].ns.items():
            own[owner] = max(own.get(owner, 0.0), waited) + flops
        back_end[k] = transfer(loads[k].back)
    for k in range(max(0, n - 2), n):
        relay(k)
    return max(ready(), link, max(relay_end, default=0.0))


def cut_flops(loads: Sequence[Load], flops_per_element: float) -> float:
    """A cut's predicted step (``step_flops``) and its buckets' host work."""
    return step_flops(loads, flops_per_element) + len(loads) * BUCKET_HOST_FLOPS
