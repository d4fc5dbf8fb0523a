"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention, optional
tied embeddings, with named size presets."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    seq_len: int
    vocab_size: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


PRESETS = {
    # For tests: a few seconds on CPU.
    "tiny": ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, seq_len=32),
    # The README's main job: a few minutes on 2 CPU ranks.
    "cpu-demo": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, seq_len=128),
    # Benchmarks on CPU: big enough that Newton-Schulz dominates the optimizer step.
    "cpu-bench": ModelConfig(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=688, seq_len=128),
    "124m": ModelConfig(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        seq_len=1024,
        vocab_size=50304,
        tie_embeddings=True,
    ),
    "1b": ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        seq_len=2048,
        vocab_size=50304,
        tie_embeddings=True,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x (batch, heads, time, head_dim) by position-dependent angles."""
    pairs = rearrange(x.float(), "... (d two) -> ... d two", two=2)
    real, imag = pairs.unbind(-1)
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return rearrange(rotated, "... d two -> ... (d two)").type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"dim {cfg.dim}, n_heads {cfg.n_heads}, n_kv_heads {cfg.n_kv_heads} do not divide"
            )
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=False)
        self.track_max_logits = False  # record each head's largest pre-softmax logit (for QK-clip), in
        # forwards with gradients only: validation under no_grad leaves the training batch's record
        self.max_logits: torch.Tensor | None = None  # (n_heads,), the largest since it was last reset

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = rearrange(self.wq(x), "b t (h d) -> b h t d", h=self.n_heads)
        k = rearrange(self.wk(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        v = rearrange(self.wv(x), "b t (h d) -> b h t d", h=self.n_kv_heads)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.track_max_logits and torch.is_grad_enabled():
            seen = causal_max_logits(q.detach(), k.detach())
            self.max_logits = seen if self.max_logits is None else torch.maximum(self.max_logits, seen)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(rearrange(out, "b h t d -> b t (h d)"))


def causal_max_logits(q: torch.Tensor, k: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Each head's largest causal pre-softmax logit q . k / sqrt(d) over a batch: q, k of shape
    (batch, heads, time, d). Queries are taken ``chunk`` at a time, so memory is fp32 copies of q
    and k and batch x heads x chunk x time scores, not the full time x time; the work is one more
    causal q k^T per layer and micro-batch."""
    t, scale = q.shape[2], q.shape[-1] ** -0.5
    q, k = q.float(), k.float()
    best = torch.full((q.shape[1],), -torch.inf, device=q.device)
    for start in range(0, t, chunk):
        stop = min(start + chunk, t)  # keys past the chunk's last query are all masked: left out
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, start:stop], k[:, :, :stop]) * scale
        rows = torch.arange(start, stop, device=q.device)
        scores.masked_fill_(
            torch.arange(stop, device=q.device) > rows[:, None], -torch.inf
        )  # key after query
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    rope_cos: torch.Tensor  # (buffers)
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks():  # scaled residual projections, as in GPT-2
            for proj in (block.attention.wo, block.feed_forward.w2):
                nn.init.normal_(proj.weight, std=0.02 / (2 * self.cfg.n_layers) ** 0.5)

    def blocks(self) -> list[Block]:
        """The transformer blocks, typed (``self.layers`` holds them as modules)."""
        return [cast(Block, block) for block in self.layers]

    def max_logits(self) -> list[torch.Tensor]:
        """Each layer's largest pre-softmax logit per head since ``reset_max_logits``; an empty
        tensor for a layer that recorded none, which ``QKClip.clip`` then names, alike on every
        rank (raising here could leave the other ranks in its collective)."""
        return [
            torch.empty(0) if (logits := block.attention.max_logits) is None else logits
            for block in self.blocks()
        ]

    def reset_max_logits(self) -> None:
        for block in self.blocks():
            block.attention.max_logits = None

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, time, vocab), or the mean cross-entropy when ``targets`` are given."""
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            h = block(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
