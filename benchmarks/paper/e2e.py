"""A whole training step with backward, on paper, over the network as deployed: ``--report e2e``.

``--report e2e``: a whole training step, forward + backward + optimizer, for AdamW and DMuonFSDP
(plain, and with ``overlap_backward``), per model and mesh: flat FSDP on W ranks (``--world-sizes``)
and HSDP R x S (``--meshes``, shard dim innermost). Per rank:
- The network (``instruments.traffic.Network``): nodes of ``--gpus-per-node`` GPUs (consecutive
  ranks), ``--node-gbs`` per GPU within a node, ``--link-gbs`` per GPU between nodes, a latency of
  ``--latency-us`` per peer of an exchange. An all-to-all lasts as long as its busiest rank: the
  slower of its two links (bytes sent or received over it, the larger) plus its peers' latency.
- A model is its layers in forward order, each its matrices and its seconds of backward
  (``Layer``; ``end_to_end`` takes any such list: ``benchmarks.paper.embodied`` gives VLAs' units
  of unequal sizes and tokens). Here, a Llama model's equal layers (``llama_layers``): backward =
  4 x (matrix parameters) x --tokens-per-rank flops / (peak x --mfu), per layer in proportion to
  its parameters, last layer first; forward = half of that. Embeddings, head and
  attention-score flops are ignored (a shorter step: the optimizer's share is overstated, and
  there is less backward to hide it behind); every parameter counts as active.
- AdamW = forward + backward + element-wise (``benchmarks.paper.costs``: the rank's 1/S of the
  parameters through HBM, after backward), on the same mesh.
- DMuonFSDP: the planner's plan (shipped ``bucket_bytes`` and ``ns_flops_per_byte``) and its
  three exchanges per bucket counted rank by rank (``instruments.traffic``), run through the bucket
  loop's model (``dmuon_fsdp._step.pipeline.timeline``: one process group, exchanges in launch
  order, each owner's NS of a bucket once it arrived), from the end of backward; then
  element-wise. ``overlap_backward``: the buckets before the flags' carrier launch their exchange
  to the owners once backward is done with every layer holding their matrices. The critical path
  after backward is printed by kind (NS, to owners, back, relay, spill: an exchange launched in
  backward still on the link after it). ``overlap_forward`` (with replicas): the plan with its
  relays left to the next forward (its buckets, cut without the relays' load, may differ).
- Bytes per rank per step (sent, every exchange) and across nodes (the larger of sent and
  received), against the least that any schedule orthogonalizing each matrix once in the job
  moves across nodes per rank (``instruments.traffic.least_far``).
- One-owner bound (``instruments.plans.one_owner_bound``): no schedule that gives each matrix one
  owner ends the step sooner in this model: every matrix of the first layer (its gradient lands
  last) goes to its owner, through NS and back to every holder after backward, each over the
  links it must cross; every rank's NS runs after backward; element-wise work follows.
- ``--before REV``: the package at git revision REV plans the same meshes (its owners and buckets,
  in a process of its own); each of its results goes from its owner to every holder, as it did
  before the relay.
- Not modelled: FSDP's own all-gathers and reduce-scatters (folded into --mfu; the "grad sync link
  load" column is HSDP's gradient traffic over backward's time on the link it crosses: intra-node
  reduce-scatters for S <= GPUs per node, the all-reduce across replicas between nodes).
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from benchmarks.paper.costs import (
    WIRE_BYTES,
    elementwise_seconds,
    ns_costs,
    ns_rate,
    print_header,
    print_row,
    resolve_gpu,
)
from benchmarks.paper.shapes import LLAMA_CONFIGS, MODELS, Shape, mesh_layouts
from dmuon_fsdp._step.pipeline import timeline
from dmuon_fsdp._step.planner import Bucket, Plan, build_plan
from instruments.plans import one_owner_bound, rank_loads
from instruments.traffic import WAYS, Network, Traffic, least_far

Mesh = tuple[int, int]  # replicas x shards
# A layer of a model (an FSDP unit): its matrices (the model's, in order) and its seconds of backward
Layer = tuple[list[Shape], float]


def network_of(args: argparse.Namespace) -> Network:
    return Network(args.gpus_per_node, args.node_gbs, args.link_gbs, args.latency_us * 1e-6, WIRE_BYTES)


def plan_of(shapes: list[Shape], mesh: Mesh, args: argparse.Namespace, forward_relays: bool = False) -> Plan:
    """The planner's plan for the matrices ``shapes`` on ``mesh`` (shipped settings from ``args``)."""
    costs = ns_costs(shapes, args.ns_algorithms[0], args.ns_steps)
    world = mesh[0] * mesh[1]
    bucket = args.bucket_mib * 2**20
    matrices = mesh_layouts(shapes, *mesh)
    return build_plan(
        matrices, costs, world, bucket, WIRE_BYTES, None, args.ns_flops_per_byte, forward_relays
    )


def forward_with_relays(relays: list[float], needed: list[int], layers: list[float], start: float) -> float:
    """When the next forward ends, from ``start`` (the end of the step, where every relay is
    launched, its parts in place), when its layer i (``layers[i]`` seconds, in order) may start
    only once the relays through ``needed[i]`` arrived (``relays[g]`` seconds each, one after
    another on the link; ``dmuon_fsdp.forward``)."""
    ends = list(itertools.accumulate(relays, initial=start))[1:]
    clock = start
    for layer, last in zip(layers, needed, strict=True):
        clock = max(clock, ends[last]) if last >= 0 else clock
        clock += layer
    return clock


def llama_layers(model: str, args: argparse.Namespace) -> list[Layer]:
    """A Llama model of ``MODELS`` as its equal layers, each 4 x its parameters x
    --tokens-per-rank flops of backward at --mfu of peak."""
    shapes, layers = MODELS[model], LLAMA_CONFIGS[model][0]
    per_layer = len(shapes) // layers
    out = []
    for i in range(layers):
        matrices = shapes[i * per_layer : (i + 1) * per_layer]
        n = sum(r * c for r, c in matrices)
        out.append((matrices, 4 * n * args.tokens_per_rank / (args.tflops * 1e12 * args.mfu)))
    return out


def end_to_end(layers: list[Layer], mesh: Mesh, plan: Plan, relayed: bool, args: argparse.Namespace) -> dict:
    """Predicted forward + backward + optimizer step (ms) of AdamW and of DMuonFSDP, plain and
    with overlap_backward, for the model of ``layers`` (in forward order; its matrices in order
    are the plan's) on ``mesh`` under ``plan`` (``relayed``: with the relay; else each result
    from its owner to every holder)."""
    replicas, shards = mesh
    world = replicas * shards
    shapes = [shape for matrices, _ in layers for shape in matrices]
    params = sum(r * c for r, c in shapes)
    layer_seconds = [s for _, s in layers]
    backward, forward = sum(layer_seconds), sum(layer_seconds) / 2
    elementwise = elementwise_seconds(params, shards, args)
    network = network_of(args)
    traffic = Traffic.of(plan, network, relayed)
    seconds = {way: traffic.seconds(way) for way in WAYS}
    rate = ns_rate(args)
    ns = _ns_seconds(plan, rate)
    adamw = forward + backward + elementwise
    nodes = network.nodes(world)
    sent = traffic.total("sent")
    far_in = traffic.total("received_far")
    far = np.maximum(traffic.total("sent_far"), far_in)
    row: dict[str, Any] = {
        "mesh": f"{replicas}x{shards}",
        "world": world,
        "relayed": relayed,
        "buckets": len(plan.buckets),
        "busiest_ns_ms": max(rank_loads(plan)) / rate * 1e3,
        "elementwise_ms": elementwise * 1e3,
        "forward_ms": forward * 1e3,
        "backward_ms": backward * 1e3,
        "grad_sync_load": _grad_sync_load(params, mesh, network, backward),
        "adamw_ms": adamw * 1e3,
        "sent_max_gib": float(sent.max()) * WIRE_BYTES / 2**30,
        "sent_mean_gib": float(sent.mean()) * WIRE_BYTES / 2**30,
        "far_max_gib": float(far.max()) * WIRE_BYTES / 2**30,
        "far_mean_gib": float(far_in.mean()) * WIRE_BYTES / 2**30,
        "far_least_gib": least_far(plan, nodes) * WIRE_BYTES / 2**30,
        "exchange_ms": {way: sum(s) * 1e3 for way, s in seconds.items()},
    }
    started = _started_in_backward(plan, layers, args)
    for name, begun in (("plain_pipelined", ()), ("overlap", started)):
        line = timeline(seconds, ns, backward, begun)
        step_end = line.end + elementwise
        exchange = sum(s for kind, s in line.path.items() if kind != "NS")
        row[name] = {
            "exposed_ms": (step_end - backward) * 1e3,
            "exposed_exchange_share": exchange / (step_end - backward),
            "path_ms": {kind: s * 1e3 for kind, s in line.path.items()},
            "step_ms": (forward + step_end) * 1e3,
            "over_adamw": (forward + step_end) / adamw - 1,
        }
    if relayed and plan.relays:
        row["overlap_forward"] = _finished_in_forward(layers, mesh, args, network)
        row["overlap_forward"]["over_adamw"] = row["overlap_forward"]["step_ms"] / (adamw * 1e3) - 1
    # (module docstring; the first layer's matrices come first)
    bound = one_owner_bound(plan, range(len(layers[0][0])), 1 / rate, network)
    row["one_owner_bound_ms"] = (bound + elementwise) * 1e3
    return row


def _ns_seconds(plan: Plan, rate: float) -> list[dict[int, float]]:
    """Per bucket of ``plan``, each owner's seconds of NS in it at ``rate`` flop/s."""
    ns: list[dict[int, float]] = [{} for _ in plan.buckets]
    for k, bucket in enumerate(plan.buckets):
        for j in bucket.matrices:
            ns[k][plan.owners[j]] = ns[k].get(plan.owners[j], 0.0) + plan.costs[j] / rate
    return ns


def _started_in_backward(plan: Plan, layers: list[Layer], args: argparse.Namespace) -> list[float]:
    """With overlap_backward, when each bucket before the flags' carrier launches its exchange to
    the owners: once backward (last layer first) is done with every layer holding its matrices."""
    layer_of = [i for i, (matrices, _) in enumerate(layers) for _ in matrices]
    layer_seconds = [s for _, s in layers]
    layer_done = [sum(layer_seconds[layer:]) for layer in range(len(layers))]  # backward: last layer first
    carrier = min(args.backward_buckets, len(plan.buckets) - 1)  # the buckets before it start in backward
    return [layer_done[min(layer_of[j] for j in b.matrices)] for b in plan.buckets[:carrier]]


def _finished_in_forward(layers: list[Layer], mesh: Mesh, args: argparse.Namespace, network: Network) -> dict:
    """The step with ``overlap_backward`` and ``overlap_forward``: its relays, in parameter order,
    left to the next forward (``forward_with_relays``); the forward's delay counts as the step's.
    Its plan's buckets may differ from the plan without (a bucket's load leaves its relays out)."""
    shapes = [shape for matrices, _ in layers for shape in matrices]
    plan = plan_of(shapes, mesh, args, forward_relays=True)
    ns, started = _ns_seconds(plan, ns_rate(args)), _started_in_backward(plan, layers, args)
    traffic = Traffic.of(plan, network)
    seconds = {way: traffic.seconds(way) for way in WAYS[:2]} | {"relay": [0.0] * len(plan.buckets)}
    layer_seconds = [s for _, s in layers]
    backward, forward = sum(layer_seconds), sum(layer_seconds) / 2
    elementwise = elementwise_seconds(sum(r * c for r, c in shapes), mesh[1], args)
    line = timeline(seconds, ns, backward, started)
    step_end = line.end + elementwise
    first = list(itertools.accumulate((len(matrices) for matrices, _ in layers), initial=0))
    needed = [
        max((plan.relay_of[j] for j in range(first[i], first[i + 1])), default=-1) for i in range(len(layers))
    ]
    forwards = [s / 2 for s in layer_seconds]  # forward: half of backward, layer by layer
    delay = forward_with_relays(traffic.relay_seconds(), needed, forwards, step_end) - step_end - forward
    return {
        "exposed_ms": (step_end - backward) * 1e3,
        "forward_delay_ms": delay * 1e3,
        "relay_ms": sum(traffic.relay_seconds()) * 1e3,
        "step_ms": (forward + step_end + delay) * 1e3,
    }


def _grad_sync_load(params: int, mesh: Mesh, network: Network, backward: float) -> float:
    """HSDP's (and FSDP's) gradient traffic in backward, bf16, over backward's time on the slower
    link it crosses: a reduce-scatter over S (within a node when S fits one, else mostly across)
    and, with R > 1, an all-reduce of the 1/S shard across replicas (between nodes)."""
    replicas, shards = mesh
    scatter = (shards - 1) / shards * params * WIRE_BYTES
    near = shards <= network.gpus_per_node
    reduce = 2 * (replicas - 1) / replicas * params / shards * WIRE_BYTES
    far_bytes = reduce + (0 if near else scatter)
    near_bytes = scatter if near else 0
    return max(far_bytes / (network.link_gbs * 1e9), near_bytes / (network.node_gbs * 1e9)) / backward


def meshes_of(args: argparse.Namespace) -> list[Mesh]:
    flat = [(1, w) for w in args.world_sizes]
    return flat + [_mesh(text) for text in args.meshes]


def _mesh(text: str) -> Mesh:
    replicas, shards = (int(n) for n in text.lower().split("x"))
    return replicas, shards


def plans_before(rev: str, models: list[str], meshes: list[Mesh], args: argparse.Namespace) -> dict:
    """{(model, mesh): (owners, buckets)} of the package at git revision ``rev``, planned in a
    process that imports it (``benchmarks.paper.before``)."""
    from benchmarks.emulate_scale import export

    folder = export(rev)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        given = [out.name, models, meshes, _plan_args(args)]
        code = (  # the older package first on the path, before anything imports it
            f"import sys; sys.path.insert(0, {folder!r}); from benchmarks.paper.before import plan_here; "
            f"plan_here(*{given!r})"
        )
        subprocess.run([sys.executable, "-c", code], check=True)
        with open(out.name) as f:
            found = json.load(f)
    return {(m, tuple(mesh)): (owners, buckets) for m, mesh, owners, buckets in found}


def _plan_args(args: argparse.Namespace) -> dict:
    keys = ("ns_algorithms", "ns_steps", "bucket_mib", "ns_flops_per_byte")
    return {key: getattr(args, key) for key in keys}


def e2e_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    models = args.models or ["llama3-8b", "llama3-70b"]
    meshes = meshes_of(args)
    before = plans_before(args.before, models, meshes, args) if args.before else {}
    results: dict[str, list[dict]] = {m: [] for m in models}
    for model in models:
        costs = ns_costs(MODELS[model], args.ns_algorithms[0], args.ns_steps)
        for mesh in meshes:
            if (model, mesh) in before:
                owners, buckets = before[model, mesh]
                matrices, world = mesh_layouts(MODELS[model], *mesh), mesh[0] * mesh[1]
                old = Plan(
                    tuple(matrices),
                    tuple(costs),
                    tuple(owners),
                    tuple(Bucket(tuple(b)) for b in buckets),
                    world,
                    tuple(range(len(matrices))),
                )
                layers = llama_layers(model, args)
                results[model].append({"package": "before", **end_to_end(layers, mesh, old, False, args)})
            plan = plan_of(MODELS[model], mesh, args)
            results[model].append(
                {"package": "after", **end_to_end(llama_layers(model, args), mesh, plan, True, args)}
            )
    print_table(results, args)
    return results


def print_table(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(
        f"## Predicted training step (forward + backward + optimizer), {args.gpu}: {args.tflops:g} TFLOP/s, "
        f"MFU {args.mfu:g}, NS at {args.ns_efficiency:g} of peak ({args.ns_algorithms[0]}), "
        f"{args.tokens_per_rank} tokens per rank; {args.gpus_per_node} GPUs a node, {args.node_gbs:g} GB/s "
        f"within, {args.link_gbs:g} GB/s between nodes, {args.latency_us:g} us a peer; {args.hbm_gbs:g} GB/s "
        f"HBM; {args.bucket_mib} MiB buckets shaped at {args.ns_flops_per_byte:g} NS flops per link byte, "
        f"{args.backward_buckets} bucket(s) started in backward with overlap_backward\n"
    )
    header = [
        "model",
        "R x S",
        "package",
        "AdamW ms",
        "grad sync link load",
        "buckets",
        "pipeline ms",
        "vs AdamW",
        "overlap_backward ms",
        "vs AdamW",
        "+ overlap_forward ms",
        "vs AdamW",
        "relays ms (forward delay)",
        "exposed ms",
        "one-owner bound ms",
        "path: NS / to / back / relay / spill ms",
        "sent GiB: max / mean",
        "max / mean",
        "across nodes GiB: max / mean / least",
        "mean / least",
        "busiest NS ms",
    ]
    print_header(header, left=3)
    for model, rows in results.items():
        for r in rows:
            overlap, path = r["overlap"], r["overlap"]["path_ms"]
            later = r.get("overlap_forward")
            forward_cells = (
                [
                    f"{later['step_ms']:.1f}",
                    f"{later['over_adamw']:+.2%}",
                    f"{later['relay_ms']:.1f} ({later['forward_delay_ms']:.1f})",
                ]
                if later
                else ["-", "-", "-"]
            )
            print_row(
                [
                    model,
                    r["mesh"],
                    r["package"],
                    f"{r['adamw_ms']:.1f}",
                    f"{r['grad_sync_load']:.0%}",
                    r["buckets"],
                    f"{r['plain_pipelined']['step_ms']:.1f}",
                    f"{r['plain_pipelined']['over_adamw']:+.2%}",
                    f"{overlap['step_ms']:.1f}",
                    f"{overlap['over_adamw']:+.2%}",
                    *forward_cells,
                    f"{overlap['exposed_ms']:.1f}",
                    f"{r['one_owner_bound_ms']:.1f}",
                    " / ".join(f"{path[k]:.1f}" for k in ("NS", "to owners", "back", "relay", "spill")),
                    f"{r['sent_max_gib']:.2f} / {r['sent_mean_gib']:.2f}",
                    f"{r['sent_max_gib'] / r['sent_mean_gib']:.2f}",
                    f"{r['far_max_gib']:.2f} / {r['far_mean_gib']:.2f} / {r['far_least_gib']:.2f}",
                    f"{r['far_mean_gib'] / r['far_least_gib']:.3f}" if r["far_least_gib"] else "-",
                    f"{r['busiest_ns_ms']:.1f}",
                ]
            )
