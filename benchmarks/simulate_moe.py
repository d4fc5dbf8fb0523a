"""DMuonFSDP at scale, on paper: ``python -m benchmarks.simulate_scale --report moe``.

``--report moe``: MoE models with expert parallelism (--ep, default 8, capped at a model's experts
per layer), per world size (default 64 256 1024), DMuonFSDP's plan with every expert matrix its
own matrix and owners anywhere in the job (the planner's choice; an expert held whole by one rank,
efsdp = 1, is owned there): the busiest rank's NS flops (and ms at --ns-efficiency) over
``assignment_lower_bound`` and ``makespan_lower_bound``, bf16 bytes each rank sends per step (max
and mean, both exchanges, as ``Plan.elements_moved``), the share of expert matrices owned by a
rank that holds none of them, and the host side: matrices owned per rank, distinct shapes owned,
and NS batches per step (distinct shapes per owner per --bucket-mib bucket). Layout (``ep_layouts``):
- ranks r = efsdp index x ep + ep index, ep innermost (torchtitan: ep = dp_shard_in_ep), W = ep x
  efsdp, no HSDP, TP or CP; dense matrices row-sharded over all W ranks (FSDP2, torch.chunk rows);
- an expert stack [E, rows, cols] is Shard(0) over ep (EP rank g holds experts g E/ep .. (g+1)
  E/ep - 1) and Shard(1) over efsdp (torchtitan's shard_placement_fn): expert e's matrix lives on
  the W/ep ranks g, g + ep, ..., a torch.chunk of its rows each, an EMPTY piece everywhere else;
- the shared expert is a dense MLP (row-sharded over all W), the router a dense matrix.
DeepSeek-V3 (its public config.json): 61 layers, hidden 7168, vocab 129280 (not counted); MLA with
128 heads: wq_a 7168 -> 1536, wq_b 1536 -> 128 x (128 nope + 64 rope), wkv_a 7168 -> 512 + 64,
wkv_b 512 -> 128 x (128 + 128 v), wo 128 x 128 -> 7168; layers 0-2 dense (SwiGLU, ffn 18432),
3-60 MoE: router 7168 -> 256, 1 shared expert and 256 routed experts of ffn 2048 (gate, up, down).
Simplified: the multi-token-prediction module, embeddings, head, norms and the router's bias are
left out; each MLA projection is one matrix (not cut per head). Mixtral 8x7B: ``LLAMA_CONFIGS``'
shapes plus a 4096 -> 8 router per layer, its 8 experts per layer as three stacks (torchtitan's
grouped experts). --moe-layers runs fewer MoE layers (DeepSeek-V3 keeps its 3 dense ones).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from benchmarks.scale_model import (
    LLAMA_CONFIGS,
    WIRE_BYTES,
    ns_costs,
    print_header,
    resolve_gpu,
    spread,
)
from dmuon_fsdp.layouts import EMPTY, MatrixLayout, Piece
from dmuon_fsdp.planner import build_plan
from instruments.plans import (
    assignment_lower_bound,
    chunk_row_counts,
    makespan_lower_bound,
    rank_loads,
    row_sharded_layout,
)

# MoE models for ``--report moe``: (shape, experts) per parameter, experts 0 for a plain matrix,
# else an expert stack of that many (rows, cols) matrices; a layer's parameters in module order.
Stack = tuple[tuple[int, int], int]


def deepseek_v3_stacks(moe_layers: int = 58, dense_layers: int = 3) -> list[Stack]:
    """DeepSeek-V3's hidden matrices (public config.json): hidden 7168; MLA attention with 128
    heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128 + qk_rope 64, v_head_dim 128; the first
    ``dense_layers`` with a SwiGLU MLP of ffn 18432, the others MoE: a router (256 x 7168), one
    shared expert of ffn 2048 (a plain MLP) and 256 routed experts of ffn 2048 in three stacks."""
    dim, heads, expert_ffn, experts = 7168, 128, 2048, 256
    attention = [
        ((1536, dim), 0),  # wq_a
        ((heads * (128 + 64), 1536), 0),  # wq_b
        ((512 + 64, dim), 0),  # wkv_a
        ((heads * (128 + 128), 512), 0),  # wkv_b
        ((dim, heads * 128), 0),  # wo
    ]
    dense = [((18432, dim), 0), ((18432, dim), 0), ((dim, 18432), 0)]
    shared = [((expert_ffn, dim), 0), ((expert_ffn, dim), 0), ((dim, expert_ffn), 0)]
    routed = [((expert_ffn, dim), experts), ((dim, expert_ffn), experts), ((expert_ffn, dim), experts)]
    moe = [((experts, dim), 0), *shared, *routed]
    return (attention + dense) * dense_layers + (attention + moe) * moe_layers


def mixtral_stacks(layers: int = 32) -> list[Stack]:
    """Mixtral 8x7B: ``LLAMA_CONFIGS["mixtral-8x7b"]`` with a router (8 x 4096) per layer and each
    layer's 8 experts as three stacks (torchtitan's grouped experts)."""
    _, dim, kv_dim, ffn, experts = LLAMA_CONFIGS["mixtral-8x7b"]
    attention = [((dim, dim), 0), ((kv_dim, dim), 0), ((kv_dim, dim), 0), ((dim, dim), 0)]
    moe = [((experts, dim), 0), ((ffn, dim), experts), ((dim, ffn), experts), ((ffn, dim), experts)]
    return (attention + moe) * layers


MOE_MODELS = {"deepseek-v3": deepseek_v3_stacks, "mixtral-8x7b": mixtral_stacks}


def ep_layouts(
    stacks: list[Stack], world: int, ep: int
) -> tuple[list[MatrixLayout], list[tuple[int, ...]], list[bool], list[int]]:
    """(layouts, holders: the ranks with a piece of each, whether it is an expert matrix, the
    parameter each belongs to) of ``stacks`` on W = ``world`` ranks with expert parallelism
    ``ep``: rank r = (efsdp index) * ep + (ep index), ep innermost (torchtitan's mesh, ep =
    dp_shard_in_ep). A plain matrix is row-sharded over all W (FSDP2, torch.chunk rows). An expert
    stack [E, rows, cols] is Shard(0) over ep (EP rank g holds experts [g E/ep, (g+1) E/ep)) and
    Shard(1) over efsdp = W / ep (FSDP2 with shard_placement_fn Shard(1)): expert e's matrix lives
    on the W/ep ranks g, g + ep, g + 2 ep, ..., a torch.chunk of its rows each; every other rank's
    piece is EMPTY. Piece tuples are shared between matrices that have the same ones."""
    efsdp = world // ep
    pieces_of: dict[tuple, tuple[Piece, ...]] = {}
    layouts, holders, is_expert, param_of = [], [], [], []
    for index, ((rows, cols), experts) in enumerate(stacks):
        if not experts:
            key = (rows, cols)
            if key not in pieces_of:
                pieces_of[key] = row_sharded_layout("", rows, cols, chunk_row_counts(rows, world)).pieces
            pieces = pieces_of[key]
            layouts.append(MatrixLayout(f"{index}", rows, cols, pieces))
            holders.append(tuple(r for r, p in enumerate(pieces) if p.numel))
            is_expert.append(False)
            param_of.append(index)
            continue
        per_rank = experts // ep
        counts = chunk_row_counts(rows, efsdp)
        for e in range(experts):
            g, local = divmod(e, per_rank)
            key = (rows, cols, g, local)
            if key not in pieces_of:
                row_pieces = [EMPTY] * world
                start = 0
                for k, count in enumerate(counts):
                    if count:  # local shard [E/ep, count, cols] viewed as (-1, cols)
                        row_pieces[k * ep + g] = Piece(start, count, 0, cols, local * count)
                    start += count
                pieces_of[key] = tuple(row_pieces)
            pieces = pieces_of[key]
            layouts.append(MatrixLayout(f"{index}[{e}]", rows, cols, pieces))
            holders.append(tuple(k * ep + g for k, count in enumerate(counts) if count))
            is_expert.append(True)
            param_of.append(index)
    return layouts, holders, is_expert, param_of


def moe_scale(stacks: list[Stack], world: int, ep: int, args: argparse.Namespace) -> dict:
    """DMuonFSDP's plan (every expert matrix its own matrix, owners chosen by the planner over all
    W ranks) for ``stacks`` on ``world`` ranks with expert parallelism ``ep``: the busiest rank's
    NS against the lower bounds, bytes sent per rank (bf16, both exchanges), the expert matrices
    owned outside the ranks that hold them, matrices owned and NS batches per rank."""
    algorithm = args.ns_algorithms[0]
    started = time.perf_counter()
    layouts, holders, is_expert, param_of = ep_layouts(stacks, world, ep)
    cost_of: dict[tuple[int, int], int] = {}
    for m in layouts:
        if (m.rows, m.cols) not in cost_of:
            cost_of[m.rows, m.cols] = ns_costs([(m.rows, m.cols)], algorithm, args.ns_steps)[0]
    costs = [cost_of[m.rows, m.cols] for m in layouts]
    plan = build_plan(layouts, costs, world, args.bucket_mib * 2**20, WIRE_BYTES, param_of)
    plan_seconds = time.perf_counter() - started
    # Plan.elements_moved per rank, summed over the holders only (one pass; senders = holders, as
    # every matrix here is held once): a holder sends its piece to another owner, and the owner
    # sends every other holder's piece back.
    sent = [0] * world
    outside = 0
    for m, holder, expert, owner in zip(layouts, holders, is_expert, plan.owners, strict=True):
        for r in holder:
            if r != owner:
                sent[r] += m.pieces[r].numel
        sent[owner] += m.numel - m.pieces[owner].numel
        outside += expert and m.pieces[owner].numel == 0
    loads = rank_loads(plan)
    owned = [0] * world
    shapes: list[set] = [set() for _ in range(world)]
    batches = [0] * world  # NS batches a step runs: distinct shapes per owner per bucket
    for bucket in plan.buckets:
        in_bucket: dict[int, set] = defaultdict(set)
        for j in bucket.matrices:
            shape = (plan.matrices[j].rows, plan.matrices[j].cols)
            in_bucket[plan.owners[j]].add(shape)
            owned[plan.owners[j]] += 1
            shapes[plan.owners[j]].add(shape)
        for owner, owned_shapes in in_bucket.items():
            batches[owner] += len(owned_shapes)
    experts = sum(is_expert)
    return {
        "world": world,
        "ep": ep,
        "efsdp": world // ep,
        "algorithm": algorithm,
        "matrices": len(layouts),
        "expert_matrices": experts,
        "params": sum(m.numel for m in layouts),
        "busiest_ns_gflop": max(loads) / 1e9,
        "busiest_ns_ms": max(loads) / (args.tflops * 1e12 * args.ns_efficiency) * 1e3,
        "busiest_over_bound": max(loads) / assignment_lower_bound(costs, world),
        "busiest_over_l2_bound": max(loads) / makespan_lower_bound(costs, world),
        "max_over_mean": max(loads) * world / sum(loads),
        **spread(sent),
        "expert_owned_outside": outside / experts if experts else 0.0,
        "owned_max": max(owned),
        "owned_mean": sum(owned) / world,
        "shapes_max": max(len(s) for s in shapes),
        "buckets": len(plan.buckets),
        "ns_batches_max": max(batches),
        "plan_seconds": plan_seconds,
    }


def moe_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    results = {}
    print(
        f"## MoE at scale: DMuonFSDP, every expert matrix its own, --ep {args.ep} (capped at a model's "
        f"experts), NS {args.ns_algorithms[0]} at {args.ns_efficiency:g} of {args.tflops:g} TFLOP/s, "
        f"bf16 on the wire, {args.bucket_mib} MiB buckets\n"
    )
    header = [
        "model",
        "layers",
        "W",
        "ep x efsdp",
        "matrices",
        "busiest NS GFLOP",
        "busiest NS ms",
        "busiest / bound",
        "busiest / L2 bound",
        "max / mean",
        "MiB sent / rank: max",
        "mean",
        "expert owners outside EP group",
        "matrices owned / rank: max",
        "mean",
        "shapes owned / rank: max",
        "NS batches / rank / step: max",
        "buckets",
        "plan s",
    ]
    print_header(header)
    for model in args.moe_models:
        default_layers = 58 if model == "deepseek-v3" else 32
        layers = args.moe_layers or default_layers
        stacks = MOE_MODELS[model](layers)
        experts = max(n for _, n in stacks)
        ep = min(args.ep, experts)
        label = f"{layers + 3} (3 dense + {layers} MoE)" if model == "deepseek-v3" else str(layers)
        results[model] = {"layers": label, "rows": []}
        for world in args.world_sizes:
            if world % ep or experts % ep:
                print(f"| {model} | {label} | {world} | ep {ep} does not divide W and {experts} experts |")
                continue
            r = moe_scale(stacks, world, ep, args)
            results[model]["rows"].append(r)
            cells = [
                model,
                label,
                world,
                f"{r['ep']} x {r['efsdp']}",
                r["matrices"],
                f"{r['busiest_ns_gflop']:.0f}",
                f"{r['busiest_ns_ms']:.1f}",
                f"{r['busiest_over_bound']:.3f}",
                f"{r['busiest_over_l2_bound']:.3f}",
                f"{r['max_over_mean']:.3f}",
                f"{r['max_mib']:.1f}",
                f"{r['mean_mib']:.1f}",
                f"{r['expert_owned_outside']:.1%}",
                r["owned_max"],
                f"{r['owned_mean']:.1f}",
                r["shapes_max"],
                r["ns_batches_max"],
                r["buckets"],
                f"{r['plan_seconds']:.1f}",
            ]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    return results
