"""Matrix shape lists of Llama-style models, for planner tests (no parameters are allocated)."""

from __future__ import annotations


def llama_matrices(layers: int, dim: int, kv_dim: int, ffn: int) -> list[tuple[int, int]]:
    """Hidden matrices of a Llama decoder (q, k, v, o, gate, up, down per layer), as (out, in)."""
    block = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return block * layers


LLAMA_SHAPES = {
    "gpt2-124m": llama_matrices(12, 768, 768, 3072),
    "llama-1b": llama_matrices(16, 2048, 512, 8192),
    "llama3-8b": llama_matrices(32, 4096, 1024, 14336),
    "llama3-70b": llama_matrices(80, 8192, 1024, 28672),
}


def moe_matrices(layers: int, dim: int, kv_dim: int, ffn: int, experts: int) -> list[tuple[int, int]]:
    """A mixture-of-experts decoder: attention as Llama, then ``experts`` SwiGLU experts per layer,
    each expert's three matrices orthogonalized on their own (an expert stack [E, m, n] is E
    matrices)."""
    attention = [(dim, dim), (kv_dim, dim), (kv_dim, dim), (dim, dim)]
    return (attention + [(ffn, dim), (ffn, dim), (dim, ffn)] * experts) * layers


MOE_SHAPES = {"mixtral-8x7b": moe_matrices(32, 4096, 1024, 14336, 8)}
