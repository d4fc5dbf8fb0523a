"""The models the paper model runs and how their matrices lie on the ranks.

Dense models (``MODELS``): the hidden matrices of a Llama decoder as (out, in), q, k, v, o, gate,
up, down per layer; an MoE model there (Mixtral) counts each expert's three matrices as matrices
of their own. Embeddings, head and vectors are left out (they cost the same under every
optimizer). Laid out by ``row_sharded``: FSDP2, torch.chunk rows over all W ranks.

MoE models (``MOE_MODELS``, ``--report moe``): (shape, experts) per parameter, experts 0 for a
plain matrix, else an expert stack of that many (rows, cols) matrices; a layer's parameters in
module order. Laid out by ``ep_layouts``:
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
grouped experts).
"""

from __future__ import annotations

from collections.abc import Callable

from dmuon_fsdp._step.layouts import EMPTY, MatrixLayout, Piece
from instruments.plans import chunk_row_counts, replicated, row_sharded_layout

Shape = tuple[int, int]
Stack = tuple[Shape, int]  # (rows, cols) and experts: 0 for a plain matrix


def llama_attention(dim: int, kv_dim: int) -> list[Shape]:
    """q, k, v, o of a Llama decoder layer."""
    return [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim)]


def llama_mlp(dim: int, ffn: int) -> list[Shape]:
    """gate, up, down of a SwiGLU MLP (or of one expert)."""
    return [(ffn, dim), (ffn, dim), (dim, ffn)]


def llama_matrices(layers: int, dim: int, kv_dim: int, ffn: int, experts: int = 0) -> list[Shape]:
    """Hidden matrices of a Llama decoder (q, k, v, o, gate, up, down per layer) as (out, in); with
    ``experts``, that many SwiGLU experts per layer instead of one MLP, each expert's three
    matrices orthogonalized on their own (an expert stack [E, m, n] is E matrices)."""
    return (llama_attention(dim, kv_dim) + llama_mlp(dim, ffn) * max(experts, 1)) * layers


LLAMA_CONFIGS = {  # layers, dim, kv_dim, ffn, experts
    "gpt2-124m": (12, 768, 768, 3072, 0),
    "llama-1b": (16, 2048, 512, 8192, 0),
    "llama3-8b": (32, 4096, 1024, 14336, 0),
    "llama3-70b": (80, 8192, 1024, 28672, 0),
    "mixtral-8x7b": (32, 4096, 1024, 14336, 8),
}

MODELS = {name: llama_matrices(*config) for name, config in LLAMA_CONFIGS.items()}


def row_sharded(shapes: list[Shape], world: int) -> list[MatrixLayout]:
    """``shapes`` under FSDP2 on ``world`` ranks: torch.chunk rows."""
    return [row_sharded_layout(str(i), r, c, chunk_row_counts(r, world)) for i, (r, c) in enumerate(shapes)]


def mesh_layouts(shapes: list[Shape], replicas: int, shards: int) -> list[MatrixLayout]:
    """``shapes`` row-sharded over ``shards`` ranks and replicated ``replicas`` times (HSDP on a
    (replicas, shards) mesh; one replica: FSDP)."""
    rows = row_sharded(shapes, shards)
    return [replicated(m, replicas) for m in rows] if replicas > 1 else rows


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
    dense = [(shape, 0) for shape in llama_mlp(dim, 18432)]
    shared = [(shape, 0) for shape in llama_mlp(dim, expert_ffn)]
    routed = [((expert_ffn, dim), experts), ((dim, expert_ffn), experts), ((expert_ffn, dim), experts)]
    moe = [((experts, dim), 0), *shared, *routed]
    return (attention + dense) * dense_layers + (attention + moe) * moe_layers


def mixtral_stacks(layers: int = 32) -> list[Stack]:
    """Mixtral 8x7B: ``LLAMA_CONFIGS["mixtral-8x7b"]`` with a router (8 x 4096) per layer and each
    layer's 8 experts as three stacks (torchtitan's grouped experts)."""
    _, dim, kv_dim, ffn, experts = LLAMA_CONFIGS["mixtral-8x7b"]
    attention = [(shape, 0) for shape in llama_attention(dim, kv_dim)]
    moe = [((experts, dim), 0), ((ffn, dim), experts), ((dim, ffn), experts), ((ffn, dim), experts)]
    return (attention + moe) * layers


# name: (its stacks for a number of MoE layers, default MoE layers, dense layers before them)
MOE_MODELS: dict[str, tuple[Callable[[int], list[Stack]], int, int]] = {
    "deepseek-v3": (deepseek_v3_stacks, 58, 3),
    "mixtral-8x7b": (mixtral_stacks, 32, 0),
}


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
            key: tuple[int, ...] = (rows, cols)
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
