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

Vision-language-action models (``VLA_MODELS``, ``--report embodied``): the Muon-routed hidden
matrices as (out, in), in forward order, cut into units (``Unit``: the matrices of one FSDP unit
or layer, grouped by the stack whose tokens they see); embeddings, patch embeddings, state and
action projections from raw inputs, heads, norms and biases go to AdamW and are left out, as the
Llama models' embeddings are. ``VLA_TOKENS``: tokens per sample each stack's matrices see.
- pi0 (``pi0_units``; openpi ``src/openpi/models/gemma.py`` gemma_2b / gemma_300m and
  ``pi0_config.py``, lerobot ``src/lerobot/policies/pi0/paligemma_with_expert.py``): SigLIP
  So400m/14 (27 blocks, width 1152, MLP 4304: q, k, v, o, fc1, fc2), PaliGemma's projector
  1152 -> 2048, the time MLP (``action_time_mlp_in`` 2048 -> 1024, ``_out`` 1024 -> 1024), then
  18 joint layers, each Gemma 2B's (width 2048, 8 heads and 1 KV head of 256, MLP 16384) and the
  action expert's (Gemma 300M: width 1024, 8 heads and 1 KV head of 256, MLP 4096) q, k, v, o,
  gate, up, down in one unit (the forward calls both stacks' modules layer by layer). Tokens: 3
  camera images at 224 x 224 -> 256 patches each (768) through SigLIP and the projector; Gemma
  768 image + 48 text tokens (``max_token_len``); the expert 1 state + 50 action tokens
  (``action_horizon``); the time MLP the 50 action tokens.
- WALL-OSS (``wall_oss_units``; X-Square-Robot/wall-x ``workspace/models_config/
  qwen2_5_moe_flash.json`` and ``wall_x/model/qwen2_5_based/modeling_qwen2_5_vl_act.py``,
  ``action_head.py``): Qwen2.5-VL-3B's vision tower (32 blocks, width 1280: qkv as one
  3840 x 1280 matrix, proj, SwiGLU MLP 3420), its merger MLP (2 x 2 patches: 5120 -> 5120 ->
  2048), the action processor's time MLP (w2 4096 -> 2048, w3 2048 -> 2048; w1 and the state
  projection take raw inputs), then 36 decoder layers: shared attention (hidden 2048, 16 heads
  and 2 KV heads of 128) and two FFN experts routed by token type (``num_experts`` 2, static
  routing): the VL FFN (Qwen's MLP, 11008) and the action FFN (2048), gate, up and down each.
  (wall-x's later code fuses each expert's gate and up into one matrix; taken apart here, as in
  the release and in Qwen2.5-VL.) 3.9B matrix parameters, 4.2B with the tied embedding. Tokens:
  3 views (wall-x's aloha example: cam_high and both wrists) at ``resolution`` 256, 4:3 frames
  -> 256 x 192 -> smart_resize to 252 x 196 = 18 x 14 = 252 patches each (756) through the vision
  tower, 63 each after the 2 x 2 merge (189) into the merger and the LLM; about 72 text tokens
  (the chat template, camera names, an instruction of some 15 tokens, ``<|propri|>``; an
  estimate); 32 ``<|action|>`` tokens (``action_horizon`` 32), which alone take the action FFN
  and the time MLP; the attention sees all 293, the VL FFN the other 261.
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


# A unit of a VLA: (stack, its matrices) for each stack with matrices in it, in forward order.
Unit = list[tuple[str, list[Shape]]]


def pi0_units(vision_layers: int = 27, joint_layers: int = 18) -> list[Unit]:
    """pi0's Muon matrices in forward order (module docstring): ``vision_layers`` SigLIP blocks,
    the projector, the time MLP, ``joint_layers`` joint layers (Gemma 2B's and the action
    expert's matrices in one unit)."""
    siglip = [(1152, 1152)] * 4 + [(4304, 1152), (1152, 4304)]  # q, k, v, o, fc1, fc2
    gemma = llama_attention(2048, 256) + llama_mlp(2048, 16384)  # 8 heads of 256 = 2048
    expert = [(2048, 1024), (256, 1024), (256, 1024), (1024, 2048)] + llama_mlp(1024, 4096)
    return (
        [[("vision", siglip)] for _ in range(vision_layers)]
        + [[("projector", [(2048, 1152)])], [("time MLP", [(1024, 2048), (1024, 1024)])]]
        + [[("gemma", gemma), ("expert", expert)] for _ in range(joint_layers)]
    )


def wall_oss_units(vision_layers: int = 32, layers: int = 36) -> list[Unit]:
    """WALL-OSS's Muon matrices in forward order (module docstring): ``vision_layers`` blocks of
    Qwen2.5-VL-3B's vision tower, its merger, the action processor's time MLP, ``layers`` decoder
    layers (shared attention, the VL FFN and the action FFN)."""
    vision = [(3840, 1280), (1280, 1280)] + llama_mlp(1280, 3420)  # qkv, proj, gate, up, down
    return (
        [[("vision", vision)] for _ in range(vision_layers)]
        + [[("merger", [(5120, 5120), (2048, 5120)])], [("time MLP", [(2048, 4096), (2048, 2048)])]]
        + [
            [("attention", llama_attention(2048, 256)), ("VL FFN", llama_mlp(2048, 11008))]
            + [("action FFN", llama_mlp(2048, 2048))]
            for _ in range(layers)
        ]
    )


VLA_MODELS: dict[str, Callable[[], list[Unit]]] = {"pi0": pi0_units, "wall-oss": wall_oss_units}

VLA_TOKENS = {  # tokens per sample each stack's matrices see (module docstring)
    "pi0": {"vision": 768, "projector": 768, "time MLP": 50, "gemma": 816, "expert": 51},
    "wall-oss": {
        "vision": 756,
        "merger": 189,
        "time MLP": 32,
        "attention": 293,
        "VL FFN": 261,
        "action FFN": 32,
    },
}


def unit_shapes(units: list[Unit]) -> list[Shape]:
    """Every matrix of ``units``, in order."""
    return [shape for unit in units for _, shapes in unit for shape in shapes]


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
