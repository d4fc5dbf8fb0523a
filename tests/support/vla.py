"""Vision-language-action models at tiny sizes, built from transformers' own classes (no
downloads), laid out as the public policies are.

``Pi0``: lerobot's ``PI0Pytorch`` / openpi's ``PaliGemmaWithExpertModel`` layout. PaliGemma (a
SigLIP vision tower with a Conv2d patch embedding, a projector, Gemma) and a Gemma action expert
of another width whose token embedding and head are removed; attention is joint, layer by layer,
calling each stack's norms, q/k/v/o projections and MLP directly (the decoder layers' own
``forward`` never runs); the robot state and the noisy action chunk come in through
``state_proj``, ``action_in_proj`` and a time MLP, actions leave through ``action_out_proj``; a
flow-matching loss. ``query_tokens`` is a learned (1, 2, width) parameter (as learned queries
and register tokens are): not a matrix."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
STATE, ACTION, HORIZON = 6, 4, 5  # state and action dims, action chunk length
IMAGE, PATCH = 28, 14  # 4 patches an image


def _gemma(width: int, mlp: int, layers: int, heads: int = 2, head_dim: int = 8):
    from transformers import GemmaConfig

    return GemmaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        attn_implementation="eager",
    )


class Pi0(nn.Module):
    """A pi0-shaped policy (see the module docstring): ``vlm`` is PaliGemma, ``expert`` the
    action expert's Gemma model."""

    def __init__(self, layers: int = 2, width: int = 32, expert_width: int = 16, vision_width: int = 24):
        super().__init__()
        from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig
        from transformers.models.gemma.modeling_gemma import GemmaModel

        torch.manual_seed(0)
        vision = SiglipVisionConfig(
            hidden_size=vision_width,
            intermediate_size=2 * vision_width,
            num_hidden_layers=layers,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=PATCH,
            vision_use_head=False,  # (PaliGemma's tower ends at its last norm)
            attn_implementation="eager",
        )
        text = _gemma(width, 2 * width, layers)
        config = PaliGemmaConfig(vision_config=vision, text_config=text, projection_dim=width)
        config.text_config.attn_implementation = "eager"
        self.vlm = PaliGemmaForConditionalGeneration(config)
        self.expert = GemmaModel(_gemma(expert_width, 2 * expert_width, layers))
        self.expert.embed_tokens = None  # the expert reads projections, not tokens
        self.state_proj = nn.Linear(STATE, expert_width)
        self.action_in_proj = nn.Linear(ACTION, expert_width)
        self.action_time_mlp_in = nn.Linear(2 * expert_width, expert_width)
        self.action_time_mlp_out = nn.Linear(expert_width, expert_width)
        self.action_out_proj = nn.Linear(expert_width, ACTION)
        self.query_tokens = nn.Parameter(torch.randn(1, 2, expert_width) * 0.02)
