"""DMuonFSDP at scale, on paper: the planner alone, no processes. Four reports:

``--report step`` (default): for real model shape tables and world sizes up to 1024, the NS load
balance, the bytes each rank sends per step and a predicted optimizer-step time for DMuonFSDP,
gather-all ("vanilla") Muon and AdamW; plots step time against W. The model (per rank, per
optimizer step; matrices only: embeddings, head and vectors cost the same under every optimizer):
- Newton-Schulz time = NS flops on the rank / (peak bf16 TFLOP/s x --ns-efficiency).
  DMuonFSDP: the busiest rank's owned matrices, each in the form ``ns_algorithm`` picks for it in
  bf16 (one plan per --ns-algorithms entry: "auto" runs Gram Newton-Schulz where it needs fewer
  flops, with its restarts; the same efficiency is assumed for both forms); gather-all: every
  matrix on every rank, standard form.
- Exchange time = bytes sent / --link-gbs (links are full duplex; sent = received here).
  DMuonFSDP: the plan's bytes for the busiest sender (bf16 shards to owners and rows back);
  gather-all: an all-gather of every matrix, (W-1)/W of all matrix bytes.
- Element-wise time = 28 bytes of optimizer-state traffic per local parameter / --hbm-gbs
  (AdamW: read p, g, m, v, write p, m, v in fp32; Muon momentum + update moves about as much).
- Step = element-wise + NS + exchange, with no credit for overlapping exchange and NS
  (DMuonFSDP overlaps them, so its real time is lower, down to element-wise + max of the two).
GPU defaults: H100 (989 bf16 TFLOP/s dense, 3350 GB/s HBM) and H200 (989, 4800), 50 GB/s of
network per GPU (400 Gb/s), NS at 50% of peak.

``--report balance``: per model and world size, the busiest rank's NS flops over the assignment
lower bound max(total / W, largest matrix, W-th + (W+1)-th largest), and over the mean load.

``--report hsdp``: HSDP (replicas R x shards S, ``--meshes RxS``), bf16 on the wire, bytes sent
per rank per step (max and mean, MiB) and the busiest rank's NS GFLOP of four ways to run Muon:
per-replica (DMuonFSDP inside each replica group, NS repeated R times in the job); DMuonFSDP
(owners over all R*S ranks, one all-to-all over the job each way); a2a + all-gather (the same
owners, results returned inside the owner's shard group and then all-gathered across replicas);
gather-all (every rank gathers every matrix in its shard group and runs all NS).

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

    python -m benchmarks.simulate_scale --gpu h200
    python -m benchmarks.simulate_scale --report balance --world-sizes 8 16 64
    python -m benchmarks.simulate_scale --report hsdp --meshes 2x4 4x8 8x8 --models gpt2-124m llama3-8b
    python -m benchmarks.simulate_scale --report e2e --tokens-per-rank 8192 --mfu 0.4 --models llama3-70b
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
from collections import defaultdict
from pathlib import Path

import torch

from dmuon_fsdp.layouts import MatrixLayout, chunk_row_counts, replicated
from dmuon_fsdp.newton_schulz import (
    MUON_COEFFICIENTS,
    NS_ALGORITHMS,
    ns_segments,
    resolve_coefficients,
    segments_flops,
)
from dmuon_fsdp.planner import Bucket, Plan, assignment_lower_bound, build_plan, makespan_lower_bound


def llama_matrices(layers: int, dim: int, kv_dim: int, ffn: int, experts: int = 0) -> list[tuple[int, int]]:
    """Hidden matrices of a Llama decoder (q, k, v, o, gate, up, down per layer) as (out, in); with
    ``experts``, that many SwiGLU experts per layer instead of one MLP, each expert's three
    matrices orthogonalized on their own (an expert stack [E, m, n] is E matrices)."""
    attention = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim)]
    return (attention + [(ffn, dim), (ffn, dim), (dim, ffn)] * max(experts, 1)) * layers


LLAMA_CONFIGS = {  # layers, dim, kv_dim, ffn, experts
    "gpt2-124m": (12, 768, 768, 3072, 0),
    "llama-1b": (16, 2048, 512, 8192, 0),
    "llama3-8b": (32, 4096, 1024, 14336, 0),
    "llama3-70b": (80, 8192, 1024, 28672, 0),
    "mixtral-8x7b": (32, 4096, 1024, 14336, 8),
}
MODELS = {name: llama_matrices(*config) for name, config in LLAMA_CONFIGS.items()}
GPUS = {"h100": {"tflops": 989.0, "hbm_gbs": 3350.0}, "h200": {"tflops": 989.0, "hbm_gbs": 4800.0}}
STATE_BYTES_PER_PARAM = 28
WIRE_BYTES = 2  # bf16


def row_sharded(shapes: list[tuple[int, int]], world: int) -> list[MatrixLayout]:
    return [
        MatrixLayout.row_sharded(str(i), r, c, chunk_row_counts(r, world)) for i, (r, c) in enumerate(shapes)
    ]


def ns_costs(shapes: list[tuple[int, int]], algorithm: str = "standard", ns_steps: int = 5) -> list[int]:
    """NS flops of each matrix in the form ``algorithm`` picks for it in bf16."""
    coefficients = resolve_coefficients(MUON_COEFFICIENTS, ns_steps)
    return [
        segments_flops(r, c, ns_segments(algorithm, coefficients, torch.bfloat16, r, c)) for r, c in shapes
    ]


def plan_for(
    shapes: list[tuple[int, int]],
    world: int,
    bucket_bytes: int,
    algorithm: str = "standard",
    ns_steps: int = 5,
) -> Plan:
    return build_plan(
        row_sharded(shapes, world), ns_costs(shapes, algorithm, ns_steps), world, bucket_bytes, WIRE_BYTES
    )


def elementwise_seconds(params: int, world: int, args: argparse.Namespace) -> float:
    """Optimizer-state traffic of a rank's 1/W share of ``params`` through HBM."""
    return params / world * STATE_BYTES_PER_PARAM / (args.hbm_gbs * 1e9)


def simulate(shapes: list[tuple[int, int]], world: int, args: argparse.Namespace) -> dict:
    """A DMuonFSDP step time per --ns-algorithms entry; balance and bytes of the first one's plan."""
    rate = args.tflops * 1e12 * args.ns_efficiency
    link = args.link_gbs * 1e9
    params = sum(r * c for r, c in shapes)
    elementwise = elementwise_seconds(params, world, args)
    standard = ns_costs(shapes, "standard", args.ns_steps)
    gather = elementwise + sum(standard) / rate + params * WIRE_BYTES * (world - 1) / world / link
    row: dict = {
        "world": world,
        "matrices": len(shapes),
        "params": params,
        "gather_ms": gather * 1e3,
        "adamw_ms": elementwise * 1e3,
        "dmuon_ms": {},
    }
    for algorithm in args.ns_algorithms:
        plan = plan_for(shapes, world, args.bucket_mib * 2**20, algorithm, args.ns_steps)
        loads, costs = plan.loads(), list(plan.costs)
        sent = max(plan.elements_moved(r) for r in range(world)) * WIRE_BYTES
        row["dmuon_ms"][algorithm] = (elementwise + max(loads) / rate + sent / link) * 1e3
        if algorithm == args.ns_algorithms[0]:
            row.update(
                busiest_over_bound=max(loads) / assignment_lower_bound(costs, world),
                busiest_over_l2_bound=max(loads) / makespan_lower_bound(costs, world),
                max_over_mean=max(loads) * world / sum(loads),
                sent_mib=sent / 2**20,
            )
    return row


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (model, rows) in enumerate(results.items()):
        color = f"C{i}"
        ws = [r["world"] for r in rows]
        for algorithm, marker in zip(rows[0]["dmuon_ms"], "os^"):
            ax.plot(
                ws,
                [r["dmuon_ms"][algorithm] for r in rows],
                f"-{marker}",
                color=color,
                label=f"{model} DMuonFSDP {algorithm}",
            )
        ax.plot(ws, [r["gather_ms"] for r in rows], "--", color=color, label=f"{model} gather-all Muon")
        ax.plot(ws, [r["adamw_ms"] for r in rows], ":", color=color, label=f"{model} AdamW")
    ax.set(
        xscale="log", yscale="log", xlabel="world size W", ylabel="predicted optimizer step (ms)", title=title
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def balance(shapes: list[tuple[int, int]], world: int) -> dict:
    """The busiest rank's NS load over the assignment lower bound and over the mean."""
    loads = plan_for(shapes, world, 2**62).loads()
    bound = assignment_lower_bound(ns_costs(shapes), world)
    return {
        "world": world,
        "matrices": len(shapes),
        "over_bound": max(loads) / bound,
        "over_mean": max(loads) * world / sum(loads),
    }


def _spread(sent: list[int]) -> dict:
    return {"max_mib": max(sent) * WIRE_BYTES / 2**20, "mean_mib": sum(sent) / len(sent) * WIRE_BYTES / 2**20}


def hsdp(shapes: list[tuple[int, int]], replicas: int, shards: int) -> dict:
    """{scheme: MiB sent per rank (max, mean) and the busiest rank's NS GFLOP} on R x S HSDP."""
    world, costs = replicas * shards, ns_costs(shapes)
    rows_only = row_sharded(shapes, shards)
    per_replica = build_plan(rows_only, costs, shards, 2**40, WIRE_BYTES)
    ours = build_plan([replicated(m, replicas) for m in rows_only], costs, world, 2**40, WIRE_BYTES)
    two_step = []
    for rank in range(world):
        replica = rank // shards
        sent = 0
        for j, m in enumerate(ours.matrices):
            owner = ours.owners[j]
            if owner != rank and rank in ours.senders[j]:  # forward: one copy to the owner
                sent += m.pieces[rank].numel
            if owner == rank:  # return inside the owner's shard group
                sent += sum(
                    m.pieces[r].numel for r in range(replica * shards, (replica + 1) * shards) if r != rank
                )
            if owner // shards == replica:  # all-gather across replicas: my rows to R-1 others
                sent += (replicas - 1) * m.pieces[rank].numel
        two_step.append(sent)
    gather_all = [sum(m.pieces[s].numel for m in rows_only) * (shards - 1) for s in range(shards)]
    busiest = max(ours.loads()) / 1e9
    return {
        "per-replica": {
            **_spread([per_replica.elements_moved(r) for r in range(shards)]),
            "ns_gflop": max(per_replica.loads()) / 1e9,
        },
        "DMuonFSDP": {**_spread([ours.elements_moved(r) for r in range(world)]), "ns_gflop": busiest},
        "a2a + all-gather": {**_spread(two_step), "ns_gflop": busiest},
        "gather-all": {**_spread(gather_all), "ns_gflop": sum(costs) / 1e9},
    }


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


def resolve_gpu(args: argparse.Namespace) -> None:
    """Fill --tflops and --hbm-gbs from --gpu where not given."""
    args.tflops = args.tflops or GPUS[args.gpu]["tflops"]
    args.hbm_gbs = args.hbm_gbs or GPUS[args.gpu]["hbm_gbs"]


def step_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama-1b", "llama3-8b", "llama3-70b", "mixtral-8x7b"]
    results = {m: [simulate(MODELS[m], w, args) for w in args.world_sizes] for m in models}
    title = (
        f"{args.gpu}: {args.tflops:g} TFLOP/s x {args.ns_efficiency:g}, {args.link_gbs:g} GB/s link, "
        f"{args.hbm_gbs:g} GB/s HBM"
    )
    print(f"## Predicted optimizer step, {title}\n")
    algorithms, first = args.ns_algorithms, args.ns_algorithms[0]
    header = [
        "model",
        "W",
        "matrices",
        "busiest / bound",
        "busiest / L2 bound",
        "max / mean",
        "MiB sent per rank",
        *(f"DMuonFSDP {a} ms" for a in algorithms),
        "gather-all Muon ms",
        "AdamW ms",
        f"gather-all / DMuonFSDP {first}",
        *(f"{first} / {a}" for a in algorithms[1:]),
    ]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for model, rows in results.items():
        for r in rows:
            ms = r["dmuon_ms"]
            cells = [
                model,
                r["world"],
                r["matrices"],
                f"{r['busiest_over_bound']:.3f}",
                f"{r['busiest_over_l2_bound']:.3f}",
                f"{r['max_over_mean']:.2f}",
                f"{r['sent_mib']:.0f}",
                *(f"{ms[a]:.1f}" for a in algorithms),
                f"{r['gather_ms']:.1f}",
                f"{r['adamw_ms']:.2f}",
                f"{r['gather_ms'] / ms[first]:.1f}x",
                *(f"{ms[first] / ms[a]:.2f}x" for a in algorithms[1:]),
            ]
            print("| " + " | ".join(map(str, cells)) + " |")
    plot(results, Path(args.out).with_suffix(".png"), title)
    return results


def balance_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama-1b", "llama3-8b", "llama3-70b"]
    results = {m: [balance(MODELS[m], w) for w in args.world_sizes] for m in models}
    print("| model | matrices | W | busiest / lower bound | busiest / mean |")
    print("|---|---:|---:|---:|---:|")
    for model, rows in results.items():
        for r in rows:
            print(
                f"| {model} | {r['matrices']} | {r['world']} | {r['over_bound']:.4f} | {r['over_mean']:.4f} |"
            )
    return results


def hsdp_report(args: argparse.Namespace) -> dict:
    models = args.models or ["gpt2-124m", "llama3-8b"]
    results = {}
    print("| model | R x S | scheme | MiB sent / rank / step: max | mean | busiest rank NS GFLOP |")
    print("|---|---|---|---:|---:|---:|")
    for model in models:
        results[model] = {"elements": sum(r * c for r, c in MODELS[model]), "meshes": {}}
        for mesh in args.meshes:
            replicas, shards = (int(n) for n in mesh.split("x"))
            schemes = results[model]["meshes"][mesh] = hsdp(MODELS[model], replicas, shards)
            for scheme, r in schemes.items():
                print(
                    f"| {model} | {mesh} | {scheme} | {r['max_mib']:.1f} | {r['mean_mib']:.1f} | "
                    f"{r['ns_gflop']:.1f} |"
                )
    return results


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
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
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


REPORTS = {"step": step_report, "balance": balance_report, "hsdp": hsdp_report, "e2e": e2e_report}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--report", default="step", choices=list(REPORTS))
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument(
        "--tflops", type=float, default=None, help="peak dense bf16 TFLOP/s (default: the GPU's)"
    )
    parser.add_argument(
        "--hbm-gbs", type=float, default=None, help="memory bandwidth GB/s (default: the GPU's)"
    )
    parser.add_argument("--link-gbs", type=float, default=50.0, help="network GB/s per GPU, each direction")
    parser.add_argument("--ns-efficiency", type=float, default=0.5, help="achieved fraction of peak in NS")
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument(
        "--ns-algorithms",
        nargs="+",
        default=["standard", "auto"],
        choices=NS_ALGORITHMS,
        help="DMuonFSDP's ns_algorithm, one predicted step per entry",
    )
    parser.add_argument("--bucket-mib", type=int, default=128)
    parser.add_argument(
        "--bucket-cut",
        default="total",
        choices=["total", "per-owner"],
        help="e2e: --bucket-mib bounds a bucket's total bytes (the planner's) or each owner's in it",
    )
    parser.add_argument(
        "--world-sizes", type=int, nargs="+", default=None, help="default: 8 16 ... 1024 (e2e: 8 64 256 1024)"
    )
    parser.add_argument(
        "--tokens-per-rank", type=int, default=8192, help="e2e: tokens per rank per step (one backward)"
    )
    parser.add_argument(
        "--mfu", type=float, default=0.4, help="e2e: achieved fraction of peak in forward and backward"
    )
    parser.add_argument("--meshes", nargs="+", default=["2x4", "4x8", "8x8"], help="HSDP replicas x shards")
    parser.add_argument("--models", nargs="+", default=None, choices=list(MODELS), help="default: per report")
    parser.add_argument("--out", default=None, help="JSON (default: runs/bench/simulate_<report>.json)")
    args = parser.parse_args()
    args.world_sizes = args.world_sizes or (
        [8, 64, 256, 1024] if args.report == "e2e" else [8, 16, 32, 64, 128, 256, 512, 1024]
    )
    out = Path(args.out or f"runs/bench/simulate_{args.report}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out = str(out)
    results = REPORTS[args.report](args)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nJSON: {out}" + (f"\nplot: {out.with_suffix('.png')}" if args.report == "step" else ""))


if __name__ == "__main__":
    main()
