"""DMuonFSDP at scale, on paper: ``python -m benchmarks.simulate_scale --report e2e``.

``--report e2e``: a whole training step, forward + backward + optimizer, for AdamW, DMuonFSDP and
DMuonFSDP(overlap_backward=True), per model and world size (default 8 64 256 1024). Per rank:
- Backward = 4 x (matrix parameters) x --tokens-per-rank flops / (peak x --mfu), per layer in
  proportion to its parameters, last layer first; forward = half of that. Embeddings, head and
  attention-score flops are ignored (a shorter step: the optimizer's share is overstated, and
  there is less backward to hide it behind); every parameter counts as active (MoE: overstated).
- AdamW = forward + backward + element-wise (as in ``step``, after backward).
- DMuonFSDP, no overlap credit = AdamW + NS + exchange, as in ``step`` (exchange = the busiest
  sender's bytes of the whole step, as if every rank's link were busy the whole time).
- Bucket pipeline (``step_timeline``): one link, one all-to-all at a time in launch order (one
  process group), each as long as the busiest rank's larger of sent and received bytes in that
  bucket (an owner receives its matrices whole and sends them back whole, so a bucket of few
  matrices is paced by their owners' links: far longer in sum than the bytes-only exchange
  above); every rank runs its owned NS of each bucket in bucket order once the bucket arrived,
  and a bucket's return is ready when every rank is through it. "DMuonFSDP, bucket pipeline" is
  the plain step (plan in NS order; to owners 0 and 1, then each next bucket one ahead of NS).
- Overlap (shipped), the primary model of overlap_backward=True: the plan cut in backward order
  (``build_plan(..., backward_order=True)``). In backward only each bucket's NS inputs (taken as
  free) and its to-owners all-to-all run: launched once backward is done with every layer holding
  its matrices and every earlier bucket was launched, on the link, not delaying backward. At
  ``step`` (end of backward) the last bucket's to-owners exchange (it carries the check flags) is
  launched, then every bucket is finished in order: the owners' NS, then its return, the returns
  queued behind the last to-owners exchange and each other. Element-wise work (momentum commit,
  AdamW, apply) all comes after the last return, as in the other models. Exposed = end minus the
  end of backward; its critical path is printed by kind: NS, to-owners at step (the last
  bucket's), returns, and spill (to-owners exchanges from backward still on the link after it).
  The busiest rank's total NS is printed beside it (the path holds only the NS the link waits
  on).
- NS in backward, modeled only (not shipped; ``overlap_timeline``): each bucket's NS and return
  also run during backward, as soon as its to-owners exchange arrived. "Shares GPU": an owner
  runs its arrived NS at the next layer boundary and every rank then waits for the slowest, so
  each layer is delayed by the largest NS any rank runs before it; "spare compute": NS never
  delays backward (the most overlapping can buy). All element-wise work after the last return.
- Not modelled: FSDP's own all-gathers and reduce-scatters, neither on compute (folded into
  --mfu) nor on the link, nor the delay of a gradient's landing behind its reduce-scatter; the
  "FSDP link load" column is their bf16 bytes over the link time of backward: near 100% at the
  defaults, leaving little room for DMuonFSDP's exchanges in backward beside them (the shipped
  model's backward exchanges, and more so the NS-in-backward models, are optimistic there).
  Intra-node links (NVLink) are not faster than --link-gbs here.
- ``--bucket-cut per-owner`` (simulation only, not what the planner ships): both plans re-cut in
  the same matrix order so that --bucket-mib bounds the bytes any one owner receives (its owned
  matrices, whole) in a bucket instead of the bucket's total bytes (``cut_per_owner``); more
  owners share each bucket's exchange, fewer and larger buckets. Default ``total``: the planner's.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
from collections import defaultdict

from benchmarks.scale_model import (
    LLAMA_CONFIGS,
    MODELS,
    WIRE_BYTES,
    elementwise_seconds,
    ns_costs,
    plan_for,
    print_header,
    resolve_gpu,
    row_sharded,
)
from dmuon_fsdp.planner import Bucket, Plan, build_plan


def cut_per_owner(plan: Plan, bucket_bytes: int) -> Plan:
    """``plan`` with its buckets re-cut, in the same matrix order (its buckets' concatenation), so
    that no owner's matrices in a bucket (bf16 bytes, whole) exceed ``bucket_bytes``: a matrix
    joins the current bucket unless its owner already has something there and the two together
    would exceed ``bucket_bytes``; then the bucket is closed and the matrix starts the next one (a
    matrix larger than ``bucket_bytes`` joins where its owner has nothing yet)."""
    buckets: list[Bucket] = []
    current: list[int] = []
    owned: dict[int, int] = defaultdict(int)  # owner: bytes of its matrices in ``current``
    for j in (j for bucket in plan.buckets for j in bucket.matrices):
        owner, size = plan.owners[j], plan.matrices[j].numel * WIRE_BYTES
        if owned[owner] and owned[owner] + size > bucket_bytes:
            buckets.append(Bucket(tuple(current)))
            current, owned = [], defaultdict(int)
        current.append(j)
        owned[owner] += size
    if current:
        buckets.append(Bucket(tuple(current)))
    return dataclasses.replace(plan, buckets=tuple(buckets))


def cut(plan: Plan, args: argparse.Namespace) -> Plan:
    """``plan`` as --bucket-cut has it: the planner's buckets (total) or ``cut_per_owner``'s."""
    return cut_per_owner(plan, args.bucket_mib * 2**20) if args.bucket_cut == "per-owner" else plan


def bucket_costs(plan: Plan, args: argparse.Namespace) -> tuple[list[float], list[dict[int, float]]]:
    """Per bucket of ``plan``: the seconds of one of its all-to-alls (the busiest rank's larger of
    sent and received bytes; the return exchange mirrors the forward one, so both take as long)
    and {owner: seconds of its NS of the bucket's matrices}."""
    rate = args.tflops * 1e12 * args.ns_efficiency
    exchange, ns = [], []
    for bucket in plan.buckets:
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        owned: dict[int, float] = defaultdict(float)
        for j in bucket.matrices:
            owner, pieces = plan.owners[j], plan.matrices[j].pieces
            owned[owner] += plan.costs[j] / rate
            for rank in plan.senders[j] - {owner}:
                sent[rank] += pieces[rank].numel
                received[owner] += pieces[rank].numel
        busiest = max([*sent.values(), *received.values(), 0])
        exchange.append(busiest * WIRE_BYTES / (args.link_gbs * 1e9))
        ns.append(dict(owned))
    return exchange, ns


def overlap_timeline(
    layer_seconds: list[float],
    land_layer: list[int],
    exchange: list[float],
    ns: list[dict[int, float]],
    ns_shares_gpu: bool,
) -> tuple[float, float]:
    """(end of backward, end of the last return exchange) of the NS-in-backward variant of
    overlap_backward (modeled only, not shipped: see ``step_timeline``), seconds from the start
    of backward.

    Backward runs ``layer_seconds`` from the last layer to the first, in step on every rank (FSDP's
    per-layer collectives). Bucket k (``exchange[k]``, ``ns[k]`` from ``bucket_costs``) is ready
    when layer ``land_layer[k]`` is done, the last bucket only at the end of backward. One link,
    first come first served, carries the to-owners and return all-to-alls; an owner runs its NS
    of a bucket once the bucket's to-owners exchange has arrived, in arrival order, and the
    bucket's return starts when its last owner is done. ``ns_shares_gpu``: during backward an
    owner runs its arrived NS at the next layer boundary and the next layer starts on all ranks
    once the slowest is done (NS delays backward); otherwise NS runs on spare compute at once.
    """
    link: list[tuple[float, int, bool]] = []  # heap: (ready, bucket, is_return)
    link_free = last_return = floor = 0.0
    ns_free: dict[int, float] = defaultdict(float)
    waiting: dict[int, list[tuple[float, int]]] = defaultdict(list)  # owner: (arrived, bucket)
    owners_left = [len(owned) for owned in ns]
    return_ready = [0.0] * len(ns)
    immediate = not ns_shares_gpu

    def run_ns(k: int, owner: int, arrived: float) -> None:
        ns_free[owner] = max(ns_free[owner], arrived, floor) + ns[k][owner]
        return_ready[k] = max(return_ready[k], ns_free[owner])
        owners_left[k] -= 1
        if not owners_left[k]:
            heapq.heappush(link, (return_ready[k], k, True))

    def advance(until: float) -> None:
        """Run every link transfer that starts by ``until`` (none ready later is known yet)."""
        nonlocal link_free, last_return
        while link and max(link_free, link[0][0]) <= until:
            ready, k, is_return = heapq.heappop(link)
            link_free = max(link_free, ready) + exchange[k]
            if is_return:
                last_return = max(last_return, link_free)
                continue
            for owner in ns[k]:
                if immediate:
                    run_ns(k, owner, link_free)
                else:
                    waiting[owner].append((link_free, k))

    landing: dict[int, list[int]] = defaultdict(list)
    for k, layer in enumerate(land_layer[:-1]):
        landing[layer].append(k)
    clock = 0.0
    for layer in reversed(range(len(layer_seconds))):
        advance(clock)
        delay = 0.0
        for owner, queue in waiting.items():
            arrived = [k for t, k in queue if t <= clock]
            if arrived:
                queue[:] = [(t, k) for t, k in queue if t > clock]
                for k in arrived:
                    run_ns(k, owner, clock)
                delay = max(delay, ns_free[owner] - clock)
        clock += delay + layer_seconds[layer]
        for k in landing[layer]:
            heapq.heappush(link, (clock, k, False))
    heapq.heappush(link, (clock, len(ns) - 1, False))
    immediate, floor = True, clock if ns_shares_gpu else 0.0
    for owner, queue in waiting.items():
        for t, k in sorted(queue):
            run_ns(k, owner, t)
    advance(float("inf"))
    return clock, last_return


def step_timeline(
    backward_end: float,
    exchange: list[float],
    ns: list[dict[int, float]],
    started: list[float] | None = None,
) -> tuple[float, dict[str, float]]:
    """(end of the last return exchange, its critical path after backward by kind) of a step's
    bucket pipeline, seconds from the start of backward; ``exchange[k]``, ``ns[k]`` from
    ``bucket_costs``.

    One link carries each all-to-all for ``exchange[k]`` seconds, one at a time in launch order
    (one process group), none before it is ready. At ``step`` (from ``backward_end``) every rank
    runs, bucket by bucket, the NS of the matrices it owns in it once the bucket has arrived;
    bucket k's return is ready once every rank is through bucket k. ``started`` None: a plain step
    (``overlap=True``): buckets 0 and 1 go to their owners at ``step``, then each next one just
    before a rank finishes the one before it (to 0, to 1, back 0, to 2, back 1, ...). ``started``:
    overlap_backward as shipped: the to-owners exchange of every bucket but the last is launched
    in backward at ``started[k]``, the last bucket's at ``step``, then every return. The path's
    kinds: "NS", "to-owners at step", "returns" and "spill" (to-owners exchanges launched in
    backward still on the link after it); they sum to the end minus ``backward_end``.
    """
    starts, ends, preds, kinds = [backward_end], [backward_end], [-1], [""]  # event 0: end of backward

    def event(start: float, pred: int, seconds: float, kind: str) -> int:
        starts.append(start)
        ends.append(start + seconds)
        preds.append(pred)
        kinds.append(kind)
        return len(ends) - 1

    link = -1  # event: the link's latest transfer

    def transfer(at: float, pred: int, k: int, kind: str) -> int:
        nonlocal link
        if link >= 0 and ends[link] > at:
            at, pred = ends[link], link
        link = event(at, pred, exchange[k], kind)
        return link

    buckets = len(ns)
    arrived: dict[int, int] = {}  # bucket: event of its arrival at the owners
    if started is not None:
        arrived.update((k, transfer(t, -1, k, "spill")) for k, t in enumerate(started))
    for k in range(len(arrived), min(len(arrived) + 1 if started is not None else 2, buckets)):
        arrived[k] = transfer(backward_end, 0, k, "to-owners at step")
    done: dict[int, int] = {}  # rank: event of its latest NS (0: none yet)
    latest = 0  # the latest of those over every rank
    for k, owned in enumerate(ns):
        if k + 1 < buckets and k + 1 not in arrived:
            arrived[k + 1] = transfer(backward_end, 0, k + 1, "to-owners at step")
        for owner, seconds in owned.items():
            pred = max(done.get(owner, 0), arrived[k], key=ends.__getitem__)
            done[owner] = event(ends[pred], pred, seconds, "NS")
            latest = max(latest, done[owner], key=ends.__getitem__)
        pred = max(latest, arrived[k], key=ends.__getitem__)
        transfer(ends[pred], pred, k, "returns")
    path = dict.fromkeys(("NS", "to-owners at step", "returns", "spill"), 0.0)
    e = link
    while e >= 0 and ends[e] > backward_end:
        path[kinds[e]] += ends[e] - max(starts[e], backward_end)
        e = preds[e]
    return ends[link], path


def end_to_end(model: str, world: int, args: argparse.Namespace) -> dict:
    """Predicted forward + backward + optimizer step (ms) of AdamW, DMuonFSDP, DMuonFSDP with
    overlap_backward as shipped, and the two NS-in-backward variants (modeled only), for ``model``."""
    shapes, layers = MODELS[model], LLAMA_CONFIGS[model][0]
    per_layer = len(shapes) // layers
    layer_params = [sum(r * c for r, c in shapes[i * per_layer : (i + 1) * per_layer]) for i in range(layers)]
    params = sum(layer_params)
    layer_seconds = [4 * n * args.tokens_per_rank / (args.tflops * 1e12 * args.mfu) for n in layer_params]
    backward, forward = sum(layer_seconds), sum(layer_seconds) / 2
    elementwise = elementwise_seconds(params, world, args)
    algorithm = args.ns_algorithms[0]
    plan = cut(
        build_plan(
            row_sharded(shapes, world),
            ns_costs(shapes, algorithm, args.ns_steps),
            world,
            args.bucket_mib * 2**20,
            WIRE_BYTES,
            backward_order=True,
        ),
        args,
    )
    sent = max(plan.elements_moved(r) for r in range(world)) * WIRE_BYTES
    busiest_ns = max(plan.loads()) / (args.tflops * 1e12 * args.ns_efficiency)
    optimizer = elementwise + busiest_ns + sent / (args.link_gbs * 1e9)
    exchange, ns = bucket_costs(plan, args)
    land_layer = [min(j // per_layer for j in b.matrices) for b in plan.buckets]
    adamw = forward + backward + elementwise
    last_bucket = sum(plan.matrices[j].numel for j in plan.buckets[-1].matrices)
    row = {
        "world": world,
        "params": params,
        "algorithm": algorithm,
        "buckets": len(plan.buckets),
        "last_bucket_mib": last_bucket * WIRE_BYTES / 2**20,
        "last_bucket_exchange_ms": exchange[-1] * 1e3,
        "busiest_ns_ms": busiest_ns * 1e3,
        "elementwise_ms": elementwise * 1e3,
        "forward_ms": forward * 1e3,
        "backward_ms": backward * 1e3,
        "fsdp_link_load": (world - 1) / world * params * 2 * WIRE_BYTES / (args.link_gbs * 1e9) / backward,
        "adamw_ms": adamw * 1e3,
        "dmuon_ms": (forward + backward + optimizer) * 1e3,
        "dmuon_over_adamw": (optimizer - elementwise) / adamw,
    }
    layer_done = [sum(layer_seconds[layer:]) for layer in range(layers)]  # backward: last layer first
    ready = [0.0]
    for layer in land_layer[:-1]:  # a bucket starts once its gradients landed and the one before started
        ready.append(max(ready[-1], layer_done[layer]))
    plain = cut(plan_for(shapes, world, args.bucket_mib * 2**20, algorithm, args.ns_steps), args)
    for name, timeline in (
        ("plain_pipelined", step_timeline(backward, *bucket_costs(plain, args))),
        ("overlap_shipped", step_timeline(backward, exchange, ns, ready[1:])),
    ):
        last_return, path = timeline
        step_end = last_return + elementwise
        row[name] = {
            "exposed_ms": (step_end - backward) * 1e3,
            "path_ms": {kind: seconds * 1e3 for kind, seconds in path.items()},
            "step_ms": (forward + step_end) * 1e3,
            "over_adamw": (forward + step_end) / adamw - 1,
        }
    for name, shares in (("ns_shares_gpu", True), ("ns_free", False)):
        backward_end, last_return = overlap_timeline(layer_seconds, land_layer, exchange, ns, shares)
        step_end = max(backward_end, last_return) + elementwise
        row[f"ns_in_backward_{name}"] = {
            "backward_delay_ms": (backward_end - backward) * 1e3,
            "exposed_ms": (step_end - backward_end) * 1e3,
            "step_ms": (forward + step_end) * 1e3,
            "over_adamw": (forward + step_end) / adamw - 1,
        }
    return row


def e2e_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama-1b", "llama3-8b", "llama3-70b"]
    results = {m: [end_to_end(m, w, args) for w in args.world_sizes] for m in models}
    print(
        f"## Predicted training step (forward + backward + optimizer), {args.gpu}: {args.tflops:g} TFLOP/s, "
        f"MFU {args.mfu:g}, NS at {args.ns_efficiency:g} of peak ({args.ns_algorithms[0]}), "
        f"{args.tokens_per_rank} tokens per rank, {args.link_gbs:g} GB/s link, {args.hbm_gbs:g} GB/s HBM, "
        f"{args.bucket_mib} MiB buckets"
        + (" per owner (--bucket-cut per-owner)" if args.bucket_cut == "per-owner" else "")
        + "\n"
    )
    header = [
        "model",
        "W",
        "fwd + bwd ms",
        "FSDP link load in bwd",
        "AdamW ms",
        "DMuonFSDP, no overlap credit: ms",
        "vs AdamW",
        "DMuonFSDP, bucket pipeline: ms",
        "vs AdamW",
        "overlap (shipped): ms",
        "vs AdamW",
        "exposed ms",
        "element-wise ms",
        "path: NS ms",
        "path: to-owners at step ms",
        "path: returns ms",
        "path: bwd to-owners spill ms",
        "busiest rank NS ms",
        "last bucket MiB",
        "NS in bwd (modeled only), shares GPU: vs AdamW",
        "NS in bwd (modeled only), spare compute: vs AdamW",
    ]
    print_header(header)
    for model, rows in results.items():
        for r in rows:
            shipped, path = r["overlap_shipped"], r["overlap_shipped"]["path_ms"]
            cells = [
                model,
                r["world"],
                f"{r['forward_ms'] + r['backward_ms']:.0f}",
                f"{r['fsdp_link_load']:.0%}",
                f"{r['adamw_ms']:.1f}",
                f"{r['dmuon_ms']:.1f}",
                f"{r['dmuon_over_adamw']:+.2%}",
                f"{r['plain_pipelined']['step_ms']:.1f}",
                f"{r['plain_pipelined']['over_adamw']:+.2%}",
                f"{shipped['step_ms']:.1f}",
                f"{shipped['over_adamw']:+.2%}",
                f"{shipped['exposed_ms']:.1f}",
                f"{r['elementwise_ms']:.1f}",
                *(f"{path[kind]:.1f}" for kind in ("NS", "to-owners at step", "returns", "spill")),
                f"{r['busiest_ns_ms']:.1f}",
                f"{r['last_bucket_mib']:.0f}",
                f"{r['ns_in_backward_ns_shares_gpu']['over_adamw']:+.2%}",
                f"{r['ns_in_backward_ns_free']['over_adamw']:+.2%}",
            ]
            print("| " + " | ".join(map(str, cells)) + " |")
    return results
