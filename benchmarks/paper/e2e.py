"""A whole training step with backward, on paper: ``--report e2e``.

``--report e2e``: a whole training step, forward + backward + optimizer, for AdamW, DMuonFSDP and
DMuonFSDP(overlap_backward=True), per model and world size (default 8 64 256 1024). Per rank:
- Backward = 4 x (matrix parameters) x --tokens-per-rank flops / (peak x --mfu), per layer in
  proportion to its parameters, last layer first; forward = half of that. Embeddings, head and
  attention-score flops are ignored (a shorter step: the optimizer's share is overstated, and
  there is less backward to hide it behind); every parameter counts as active (MoE: overstated).
- AdamW = forward + backward + element-wise (``benchmarks.paper.costs``, after backward).
- DMuonFSDP, no overlap credit = AdamW + NS + exchange, as in ``--report step`` (exchange = the busiest
  sender's bytes of the whole step, as if every rank's link were busy the whole time).
- Bucket pipeline (``step_timeline``): the planner's buckets (each about --bucket-mib per owner,
  spread over every owner), one link, one all-to-all at a time in launch order (one process
  group), each as long as the busiest rank's larger of sent and received bytes in that bucket;
  every rank runs its owned NS of each bucket in bucket order once the bucket arrived, and a
  bucket's return is ready when every rank is through it. "DMuonFSDP, bucket pipeline" is the
  plain step (to owners 0 and 1, then each next bucket one ahead of NS).
- overlap_backward (``overlap``): the same plan; the buckets before the flags' carrier (bucket 0)
  go to their owners from the hooks, once backward is done with every layer holding their
  matrices (the planner puts the last layers' matrices first among equal costs); the rest as
  in the plain step. Exposed = end minus the end of backward; its critical path is printed by
  kind: NS, to-owners at step, returns, and spill (a to-owners exchange from backward still on
  the link after it). The busiest rank's total NS is printed beside it.
- Not modelled: FSDP's own all-gathers and reduce-scatters, neither on compute (folded into
  --mfu) nor on the link, nor the delay of a gradient's landing behind its reduce-scatter; the
  "FSDP link load" column is their bf16 bytes over the link time of backward: near 100% at the
  defaults, leaving little room for DMuonFSDP's exchange in backward beside them (the
  overlap_backward model is optimistic there). Intra-node links (NVLink) are not faster than
  --link-gbs here.
- One-owner bound (``instruments.plans.one_owner_bound``): no schedule that gives each matrix
  one owner finishes the step sooner in this model, however it cuts or launches: every matrix
  of the first layer (its gradient lands last) goes to its owner, through NS and back after
  backward, and every rank's NS runs after backward; element-wise work follows.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from benchmarks.paper.costs import (
    WIRE_BYTES,
    dmuon_step,
    elementwise_seconds,
    link_rate,
    ns_rate,
    plan_for,
    print_header,
    print_row,
    resolve_gpu,
)
from benchmarks.paper.shapes import LLAMA_CONFIGS, MODELS
from dmuon_fsdp._step.planner import Plan
from instruments.plans import one_owner_bound


def bucket_costs(plan: Plan, args: argparse.Namespace) -> tuple[list[float], list[dict[int, float]]]:
    """Per bucket of ``plan``: the seconds of one of its all-to-alls (the busiest rank's larger of
    sent and received bytes; the return exchange mirrors the forward one, so both take as long)
    and {owner: seconds of its NS of the bucket's matrices}."""
    rate, link = ns_rate(args), link_rate(args)
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
        exchange.append(busiest * WIRE_BYTES / link)
        ns.append(dict(owned))
    return exchange, ns


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
    """Predicted forward + backward + optimizer step (ms) of AdamW and of DMuonFSDP, plain and
    with overlap_backward, for ``model``."""
    shapes, layers = MODELS[model], LLAMA_CONFIGS[model][0]
    per_layer = len(shapes) // layers
    layer_params = [sum(r * c for r, c in shapes[i * per_layer : (i + 1) * per_layer]) for i in range(layers)]
    params = sum(layer_params)
    layer_seconds = [4 * n * args.tokens_per_rank / (args.tflops * 1e12 * args.mfu) for n in layer_params]
    backward, forward = sum(layer_seconds), sum(layer_seconds) / 2
    elementwise = elementwise_seconds(params, world, args)
    algorithm = args.ns_algorithms[0]
    plan = plan_for(shapes, world, args.bucket_mib * 2**20, algorithm, args.ns_steps, args.ns_flops_per_byte)
    optimizer, loads, _ = dmuon_step(plan, world, elementwise, args)
    busiest_ns = max(loads) / ns_rate(args)
    exchange, ns = bucket_costs(plan, args)
    adamw = forward + backward + elementwise
    row = {
        "world": world,
        "params": params,
        "algorithm": algorithm,
        "buckets": len(plan.buckets),
        "first_bucket_exchange_ms": exchange[0] * 1e3,
        "busiest_ns_ms": busiest_ns * 1e3,
        "elementwise_ms": elementwise * 1e3,
        "forward_ms": forward * 1e3,
        "backward_ms": backward * 1e3,
        "fsdp_link_load": (world - 1) / world * params * 2 * WIRE_BYTES / link_rate(args) / backward,
        "adamw_ms": adamw * 1e3,
        "dmuon_ms": (forward + backward + optimizer) * 1e3,
        "dmuon_over_adamw": (optimizer - elementwise) / adamw,
    }
    layer_done = [sum(layer_seconds[layer:]) for layer in range(layers)]  # backward: last layer first
    carrier = min(args.backward_buckets, len(plan.buckets) - 1)  # the buckets before it start in backward
    started = [layer_done[min(j // per_layer for j in b.matrices)] for b in plan.buckets[:carrier]]
    for name, timeline in (
        ("plain_pipelined", step_timeline(backward, exchange, ns)),
        ("overlap", step_timeline(backward, exchange, ns, started)),
    ):
        last_return, path = timeline
        step_end = last_return + elementwise
        exchange_path = sum(seconds for kind, seconds in path.items() if kind != "NS")
        row[name] = {
            "exposed_ms": (step_end - backward) * 1e3,
            "exposed_exchange_share": exchange_path / (step_end - backward),
            "path_ms": {kind: seconds * 1e3 for kind, seconds in path.items()},
            "step_ms": (forward + step_end) * 1e3,
            "over_adamw": (forward + step_end) / adamw - 1,
        }
    row["first_bucket_lands_ms"] = started[0] * 1e3 if started else None
    # (module docstring; the first layer's matrices come first in the shape lists)
    bound = one_owner_bound(plan, range(per_layer), 1 / ns_rate(args), WIRE_BYTES / link_rate(args))
    row["one_owner_bound_ms"] = (bound + elementwise) * 1e3
    return row


def e2e_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama-1b", "llama3-8b", "llama3-70b"]
    results = {m: [end_to_end(m, w, args) for w in args.world_sizes] for m in models}
    print(
        f"## Predicted training step (forward + backward + optimizer), {args.gpu}: {args.tflops:g} TFLOP/s, "
        f"MFU {args.mfu:g}, NS at {args.ns_efficiency:g} of peak ({args.ns_algorithms[0]}), "
        f"{args.tokens_per_rank} tokens per rank, {args.link_gbs:g} GB/s link, {args.hbm_gbs:g} GB/s HBM, "
        f"{args.bucket_mib} MiB buckets shaped at {args.ns_flops_per_byte:g} NS flops per link byte, "
        f"{args.backward_buckets} bucket(s) started in backward with overlap_backward\n"
    )
    header = [
        "model",
        "W",
        "fwd + bwd ms",
        "FSDP link load in bwd",
        "AdamW ms",
        "DMuonFSDP, no overlap credit: ms",
        "vs AdamW",
        "buckets",
        "DMuonFSDP, bucket pipeline: ms",
        "vs AdamW",
        "overlap_backward: ms",
        "vs AdamW",
        "exposed ms",
        "one-owner bound ms",
        "element-wise ms",
        "path: NS ms",
        "path: to-owners at step ms",
        "path: returns ms",
        "path: bwd to-owners spill ms",
        "exchange share of exposed",
        "busiest rank NS ms",
        "first bucket's exchange ms",
    ]
    print_header(header)
    for model, rows in results.items():
        for r in rows:
            overlap, path = r["overlap"], r["overlap"]["path_ms"]
            cells = [
                model,
                r["world"],
                f"{r['forward_ms'] + r['backward_ms']:.0f}",
                f"{r['fsdp_link_load']:.0%}",
                f"{r['adamw_ms']:.1f}",
                f"{r['dmuon_ms']:.1f}",
                f"{r['dmuon_over_adamw']:+.2%}",
                r["buckets"],
                f"{r['plain_pipelined']['step_ms']:.1f}",
                f"{r['plain_pipelined']['over_adamw']:+.2%}",
                f"{overlap['step_ms']:.1f}",
                f"{overlap['over_adamw']:+.2%}",
                f"{overlap['exposed_ms']:.1f}",
                f"{r['one_owner_bound_ms']:.1f}",
                f"{r['elementwise_ms']:.1f}",
                *(f"{path[kind]:.1f}" for kind in ("NS", "to-owners at step", "returns", "spill")),
                f"{overlap['exposed_exchange_share']:.0%}",
                f"{r['busiest_ns_ms']:.1f}",
                f"{r['first_bucket_exchange_ms']:.1f}",
            ]
            print_row(cells)
    return results
