"""A pi0-shaped vision-language-action policy, small enough to train on two CPU cores.

What it shares with pi0 (openpi's ``PaliGemmaWithExpertModel``, lerobot's ``PI0Pytorch``): a
vision tower with a convolutional patch embedding; a language stream that reads the image's
tokens and the instruction's (the *prefix*); an *action expert* of another width, with as many
layers, whose tokens (the robot's state, then a chunk of noisy actions: the *suffix*) attend
jointly with the prefix, layer by layer (each stream's own q/k/v/o projections and MLP, one
attention over both; the prefix does not see the suffix); continuous inputs through
``state_proj``, ``action_in_proj`` and a time MLP, actions out through ``action_out_proj``; flow
matching over action chunks, integrated with Euler steps at inference. A joint layer is one
module (``JointLayer``) whose ``forward`` runs both streams, so that ``fully_shard`` of each
layer (and of the vision blocks) is FSDP2's usual per-block wrapping.

Routing (``param_groups(policy, head=..., adamw=...)``, ``Policy.routing``): the hidden matrices
of the vision tower, the language stream, the expert and the time MLP go to Muon; the patch
embedding, the token embedding, the input projections and the action head to AdamW (Muon's
authors keep input and output layers there), with the norms and the position table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class PolicyConfig:
    image_size: int = 32
    channels: int = 3
    patch: int = 4
    vocab_size: int = 16
    text_len: int = 8
    state_dim: int = 2
    action_dim: int = 2
    chunk: int = 8  # actions predicted per query
    width: int = 64  # the vision tower's and the language stream's
    expert_width: int = 32  # the action expert's
    layers: int = 2  # joint layers (language stream and expert alike)
    vision_layers: int = 2
    heads: int = 4
    head_dim: int = 16
    mlp_ratio: int = 4

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2


# name -> settings: "cpu-demo" trains at ~70 ms a step on two CPU cores (it does not learn the
# reaching task yet: docs/embodied.md); "pi0" has the depths, widths and heads of pi0's Gemma 2B
# and action expert, a vision tower as deep as SigLIP So400m but at the language width and one
# MLP ratio for all (for GPUs).
PRESETS = {
    "cpu-demo": {},
    "small": {"width": 128, "expert_width": 64, "layers": 4, "vision_layers": 4, "heads": 8},
    "pi0": {
        "image_size": 224,
        "patch": 14,
        "width": 2048,
        "expert_width": 1024,
        "layers": 18,
        "vision_layers": 27,
        "heads": 8,
        "head_dim": 256,
        "chunk": 50,
    },
}


def preset(name: str, **overrides: int) -> PolicyConfig:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PolicyConfig(**{**PRESETS[name], **overrides})


class Attention(nn.Module):
    """One stream's projections (q, k, v into ``heads`` x ``head_dim``, o back to its width,
    unless the stream ends here: ``keys_only``)."""

    def __init__(self, width: int, heads: int, head_dim: int, keys_only: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        if not keys_only:
            self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, heads * head_dim, bias=False)
        if not keys_only:
            self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def heads_of(self, proj: nn.Linear, x: Tensor) -> Tensor:
        """(B, N, width) -> (B, heads, N, head_dim) through ``proj``."""
        b, n, _ = x.shape
        return proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def query(self, x: Tensor) -> Tensor:
        return self.heads_of(self.q_proj, x)

    def key(self, x: Tensor) -> Tensor:
        return self.heads_of(self.k_proj, x)

    def value(self, x: Tensor) -> Tensor:
        return self.heads_of(self.v_proj, x)

    def out(self, y: Tensor) -> Tensor:
        b, _, n, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Stream(nn.Module):
    """One stream's half of a layer: pre-norm attention projections and MLP; a stream that ends
    here (``keys_only``: the language stream's in the last layer, whose output nothing reads)
    only lends its keys and values (pi0 keeps those weights, never trained: DDP would refuse
    them)."""

    def __init__(self, width: int, cfg: PolicyConfig, keys_only: bool = False):
        super().__init__()
        self.input_norm = nn.RMSNorm(width)
        self.attn = Attention(width, cfg.heads, cfg.head_dim, keys_only)
        if not keys_only:
            self.post_norm = nn.RMSNorm(width)
            self.mlp = MLP(width, cfg.mlp_ratio * width)


class VisionBlock(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.stream = Stream(cfg.width, cfg)

    def forward(self, x: Tensor) -> Tensor:
        s = self.stream
        h = s.input_norm(x)
        q, k, v = s.attn.query(h), s.attn.key(h), s.attn.value(h)
        x = x + s.attn.out(F.scaled_dot_product_attention(q, k, v))
        return x + s.mlp(s.post_norm(x))


class JointLayer(nn.Module):
    """Layer i of the language stream (``vlm``) and of the action expert (``expert``): one
    attention over the prefix and the suffix, each with its own projections; prefix tokens
    attend the prefix only, suffix tokens everything."""

    def __init__(self, cfg: PolicyConfig, last: bool = False):
        super().__init__()
        self.vlm = Stream(cfg.width, cfg, keys_only=last)
        self.expert = Stream(cfg.expert_width, cfg)

    def forward(self, prefix: Tensor, suffix: Tensor) -> tuple[Tensor, Tensor]:
        """The next prefix (the same tensor after the last layer) and suffix."""
        p, s = self.vlm.attn, self.expert.attn
        hp, hs = self.vlm.input_norm(prefix), self.expert.input_norm(suffix)
        kp, vp = p.key(hp), p.value(hp)
        k = torch.cat([kp, s.key(hs)], dim=2)
        v = torch.cat([vp, s.value(hs)], dim=2)
        suffix = suffix + s.out(F.scaled_dot_product_attention(s.query(hs), k, v))
        suffix = suffix + self.expert.mlp(self.expert.post_norm(suffix))
        if not hasattr(p, "q_proj"):
            return prefix, suffix
        prefix = prefix + p.out(F.scaled_dot_product_attention(p.query(hp), kp, vp))  # (not the suffix)
        return prefix + self.vlm.mlp(self.vlm.post_norm(prefix)), suffix


def time_embedding(t: Tensor, width: int) -> Tensor:
    """Sine-cosine features of the flow-matching time ``t`` (B,), periods from 4e-3 to 4."""
    half = width // 2
    fraction = torch.linspace(0.0, 1.0, half, dtype=torch.float32, device=t.device)
    period = 4e-3 * (4.0 / 4e-3) ** fraction
    angle = 2 * math.pi * t.float()[:, None] / period[None, :]
    return torch.cat([angle.sin(), angle.cos()], dim=-1)


class Policy(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        if cfg.image_size % cfg.patch:
            raise ValueError(f"patch {cfg.patch} does not divide image_size {cfg.image_size}")
        self.patch_embedding = nn.Conv2d(cfg.channels, cfg.width, cfg.patch, stride=cfg.patch)
        # Of the patch embedding's scale (ViT's 0.02 is 30x smaller here): each token enters the
        # pre-norm blocks normalized, and a position table that small is lost against the patch.
        self.position = nn.Parameter(torch.randn(1, cfg.patches, cfg.width))
        self.vision = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_layers))
        self.projector = nn.Linear(cfg.width, cfg.width)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.width)
        self.layers = nn.ModuleList(JointLayer(cfg, last=i == cfg.layers - 1) for i in range(cfg.layers))
        self.state_proj = nn.Linear(cfg.state_dim, cfg.expert_width)
        self.action_in_proj = nn.Linear(cfg.action_dim, cfg.expert_width)
        self.action_time_mlp_in = nn.Linear(2 * cfg.expert_width, cfg.expert_width)
        self.action_time_mlp_out = nn.Linear(cfg.expert_width, cfg.expert_width)
        self.norm = nn.RMSNorm(cfg.expert_width)
        self.action_out_proj = nn.Linear(cfg.expert_width, cfg.action_dim)

    def routing(self) -> dict[str, list[nn.Module]]:
        """``param_groups``' ``head`` and ``adamw`` for this policy: input and output layers on
        AdamW (the embedding tables, norms and position table go there by their kind)."""
        return {
            "head": [self.action_out_proj],
            "adamw": [self.patch_embedding, self.state_proj, self.action_in_proj],
        }

    def prefix(self, images: Tensor, tokens: Tensor) -> Tensor:
        """Image tokens (vision tower, projector) then instruction tokens: (B, patches + L, width)."""
        x = self.patch_embedding(images.to(self.position.dtype)).flatten(2).transpose(1, 2) + self.position
        for block in self.vision:
            x = block(x)
        text = self.embed_tokens(tokens) * math.sqrt(self.cfg.width)
        return torch.cat([self.projector(x), text], dim=1)

    def forward(self, images: Tensor, tokens: Tensor, state: Tensor, noisy: Tensor, t: Tensor) -> Tensor:
        """The flow's velocity at ``noisy`` actions (B, chunk, action_dim) and times ``t`` (B,)."""
        dtype = self.position.dtype
        prefix = self.prefix(images, tokens)
        actions = self.action_in_proj(noisy.to(dtype))
        times = time_embedding(t, self.cfg.expert_width).to(dtype)[:, None].expand_as(actions)
        actions = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(torch.cat([actions, times], -1))))
        suffix = torch.cat([self.state_proj(state.to(dtype))[:, None], actions], dim=1)
        for layer in self.layers:
            prefix, suffix = layer(prefix, suffix)
        return self.action_out_proj(self.norm(suffix[:, 1:])).float()


Velocity = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]  # a Policy, or one wrapped (DDP)


def flow_matching_loss(
    model: Velocity,
    images: Tensor,
    tokens: Tensor,
    state: Tensor,
    actions: Tensor,
    mask: Tensor,
    generator: torch.Generator,
) -> Tensor:
    """Flow matching (pi0's convention): x_t = t noise + (1 - t) actions, the target velocity
    noise - actions, t from Beta(1.5, 1) kept off 0; the mean squared error over the chunk's
    valid steps (``mask`` (B, chunk)). ``generator`` (on the CPU) draws the noise and times, so
    that a step's draws depend on its seed alone."""
    b = actions.shape[0]
    noise = torch.randn(actions.shape, generator=generator).to(actions.device)
    u = torch.rand(b, generator=generator).to(actions.device)
    t = 0.001 + 0.999 * u ** (1 / 1.5)  # Beta(1.5, 1), by inverting its CDF t^1.5
    noisy = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    error = (model(images, tokens, state, noisy, t) - (noise - actions)).square().mean(-1)
    mask = mask.to(error.dtype)
    return (error * mask).sum() / mask.sum().clamp_min(1)


@torch.no_grad()
def sample_actions(
    model: Velocity,
    cfg: PolicyConfig,
    images: Tensor,
    tokens: Tensor,
    state: Tensor,
    generator: torch.Generator,
    steps: int = 10,
) -> Tensor:
    """An action chunk (B, chunk, action_dim): ``steps`` Euler steps of the flow from noise
    (t = 1) to t = 0."""
    b = images.shape[0]
    x = torch.randn((b, cfg.chunk, cfg.action_dim), generator=generator).to(images.device)
    for i in range(steps):
        t = torch.full((b,), 1.0 - i / steps, device=images.device)
        x = x - model(images, tokens, state, x, t) / steps
    return x
