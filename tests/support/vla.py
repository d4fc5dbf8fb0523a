"""Vision-language-action models at tiny sizes, built from transformers' own classes (no
downloads), laid out as the public policies are.

``Pi0``: lerobot's ``PI0Pytorch`` / openpi's ``PaliGemmaWithExpertModel`` layout. PaliGemma (a
SigLIP vision tower with a Conv2d patch embedding, a projector, Gemma) and a Gemma action expert
of another width whose token embedding and head are removed; attention is joint, layer by layer,
calling each stack's norms, q/k/v/o projections and MLP directly (the decoder layers' own
``forward`` never runs); the robot state and the noisy action chunk come in through
``state_proj``, ``action_in_proj`` and a time MLP, actions leave through ``action_out_proj``; a
flow-matching loss. ``query_tokens`` is a learned (1, 2, width) parameter (as learned queries
and register tokens are): not a matrix.

``WallOSS``: WALL-OSS's layout (X-Square-Robot's wall-x): Qwen2.5-VL (a vision tower with a
Conv3d patch embedding, windowed and full-attention blocks and a patch merger; a Qwen2 decoder)
whose decoder layers are shared by the vision-language tokens and the action tokens in attention,
each token kind then taking its own FFN: the decoder layer's MLP, or an action expert beside it.
The forward calls each decoder layer's norms, attention and MLP directly (the layers' own
``forward`` never runs)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
STATE, ACTION, HORIZON = 6, 4, 5  # state and action dims, action chunk length
IMAGE, PATCH = 28, 14  # 4 patches an image
QWEN_PATCH = 4


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

    def joint_layers(self) -> list[tuple[nn.Module, nn.Module]]:
        """Layer i of the language model and of the action expert, attended jointly."""
        return list(zip(self.vlm.model.language_model.layers, self.expert.layers, strict=True))

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss of ``batch`` (``images``, ``tokens``, ``state``, ``actions``,
        ``noise``, ``time``): the prefix (image and text tokens) through PaliGemma, the suffix
        (the state token and the noisy action chunk with its time) through the expert, jointly
        layer by layer: each stack's norms, projections and MLP are called directly, so their
        decoder layers' own forward never runs (nor, in the last layer, the language model's
        output projection and MLP, whose outputs nothing reads)."""
        vlm = self.vlm.model
        images = vlm.get_image_features(batch["images"]).pooler_output
        text = vlm.language_model.embed_tokens(batch["tokens"]) * math.sqrt(images.shape[-1])
        prefix = torch.cat([images, text], dim=1)
        time = batch["time"][:, None, None]
        noisy = time * batch["noise"] + (1 - time) * batch["actions"]
        actions = self.action_in_proj(noisy)
        embedded = _sinusoid(batch["time"], actions.shape[-1])[:, None].expand_as(actions)
        actions = self.action_time_mlp_out(
            F.silu(self.action_time_mlp_in(torch.cat([actions, embedded], -1)))
        )
        suffix = torch.cat([self.state_proj(batch["state"])[:, None], actions], dim=1)
        layers = self.joint_layers()
        for i, (vl, ex) in enumerate(layers):
            last = i == len(layers) - 1
            prefix, suffix = _joint(vl, ex, prefix, suffix, last)
        velocity = self.action_out_proj(self.expert.norm(suffix)[:, 1:])
        return F.mse_loss(velocity, batch["noise"] - batch["actions"])


def _sinusoid(time: torch.Tensor, width: int) -> torch.Tensor:
    frequencies = torch.exp(-math.log(1000.0) * torch.arange(width // 2, dtype=time.dtype) / (width // 2))
    angles = time[:, None] * frequencies[None] * 2 * math.pi
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def _joint(vl: nn.Module, ex: nn.Module, prefix: torch.Tensor, suffix: torch.Tensor, last: bool):
    """One layer of joint attention: the prefix attends to itself, the suffix to everything."""
    heads = []
    for layer, h in ((vl, prefix), (ex, suffix)):
        x = layer.input_layernorm(h)
        attn = layer.self_attn
        q, k, v = (
            proj(x).unflatten(-1, (-1, attn.head_dim)).transpose(1, 2)
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        heads.append((q, k, v))
    q = torch.cat([heads[0][0], heads[1][0]], dim=2)
    k, v = (torch.cat([heads[0][j], heads[1][j]], dim=2) for j in (1, 2))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # one KV head
    n, total = prefix.shape[1], q.shape[2]
    allowed = torch.ones(total, total, dtype=torch.bool)
    allowed[:n, n:] = False  # the prefix does not see the suffix
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).flatten(2)
    outs = []
    for layer, h, o in ((vl, prefix, out[:, :n]), (ex, suffix, out[:, n:])):
        if last and layer is vl:  # (nothing reads the language model's last outputs)
            outs.append(h)
            continue
        h = h + layer.self_attn.o_proj(o)
        outs.append(h + layer.mlp(layer.post_attention_layernorm(h)))
    return outs[0], outs[1]


class WallOSS(nn.Module):
    """A WALL-OSS-shaped policy (see the module docstring): ``vlm`` is Qwen2.5-VL, ``experts``
    one action FFN (a norm and a gated MLP of its own width) per decoder layer."""

    def __init__(self, layers: int = 2, width: int = 32, expert_mlp: int = 24, vision_width: int = 16):
        super().__init__()
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

        torch.manual_seed(0)
        vision = dict(
            depth=layers,
            hidden_size=vision_width,
            intermediate_size=2 * vision_width,
            num_heads=2,
            out_hidden_size=width,
            patch_size=QWEN_PATCH,
            window_size=2 * QWEN_PATCH,  # a window per merged 2 x 2 patch
            fullatt_block_indexes=[layers - 1],
        )
        text = dict(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            bos_token_id=None,
            eos_token_id=None,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 3, 3],
            },  # head 16
        )
        config = Qwen2_5_VLConfig(vision_config=vision, text_config=text, attn_implementation="eager")
        self.vlm = Qwen2_5_VLForConditionalGeneration(config)
        expert = config.text_config.__class__(**{**text, "intermediate_size": expert_mlp})
        self.experts = nn.ModuleList(
            nn.ModuleDict({"norm": Qwen2RMSNorm(width), "mlp": Qwen2MLP(expert)}) for _ in range(layers)
        )
        self.state_proj = nn.Linear(STATE, width)
        self.action_in_proj = nn.Linear(ACTION + 1, width)  # the noisy action and its time
        self.action_out_proj = nn.Linear(width, ACTION)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The flow-matching loss of ``batch`` (``pixels``, ``grid``, ``tokens``, ``state``,
        ``actions``, ``noise``, ``time``): merged image tokens, text, the state token and the noisy
        action chunk, one sequence through the decoder; the prefix (image and text) attends within
        itself, the suffix (state and actions) to everything; each layer's MLP takes the prefix,
        its action expert the suffix (in the last layer nothing reads the prefix: its MLP is
        skipped)."""
        vlm = self.vlm.model
        images = torch.stack(vlm.get_image_features(batch["pixels"], batch["grid"]).pooler_output)
        text = vlm.language_model.embed_tokens(batch["tokens"])
        time = batch["time"][:, None, None]
        noisy = time * batch["noise"] + (1 - time) * batch["actions"]
        actions = self.action_in_proj(torch.cat([noisy, time.expand(-1, noisy.shape[1], 1)], -1))
        prefix = torch.cat([images, text], dim=1)
        h = torch.cat([prefix, self.state_proj(batch["state"])[:, None], actions], dim=1)
        n, total = prefix.shape[1], h.shape[1]
        blocked = torch.zeros(total, total, dtype=h.dtype)
        blocked[:n, n:] = torch.finfo(h.dtype).min  # the prefix does not see the suffix
        positions = torch.arange(total).expand(3, h.shape[0], total)  # (Qwen2.5-VL's 3-D rope)
        rope = vlm.language_model.rotary_emb(h, positions)
        layers = vlm.language_model.layers
        for i, (layer, expert) in enumerate(zip(layers, self.experts, strict=True)):
            attended, _ = layer.self_attn(
                layer.input_layernorm(h), blocked[None, None], position_embeddings=rope
            )
            h = h + attended
            prefix, suffix = h[:, :n], h[:, n:]
            if i < len(layers) - 1:
                prefix = prefix + layer.mlp(layer.post_attention_layernorm(prefix))
            suffix = suffix + expert["mlp"](expert["norm"](suffix))
            h = torch.cat([prefix, suffix], dim=1)
        velocity = self.action_out_proj(vlm.language_model.norm(h[:, n + 1 :]))
        return F.mse_loss(velocity, batch["noise"] - batch["actions"])


def wall_batch(step: int, batch: int = 2, text: int = 3) -> dict[str, torch.Tensor]:
    """An image of 4 x 4 patches a sample (merged to 2 x 2 tokens), as Qwen2.5-VL's processor
    flattens them: (patches, channels x 2 frames x patch x patch)."""
    gen = torch.Generator().manual_seed(700 + step)
    patches = 3 * 2 * QWEN_PATCH * QWEN_PATCH
    return {
        "pixels": torch.randn(batch * 16, patches, generator=gen),
        "grid": torch.tensor([[1, 4, 4]] * batch),
        "tokens": torch.randint(0, VOCAB, (batch, text), generator=gen),
        "state": torch.randn(batch, STATE, generator=gen),
        "actions": torch.randn(batch, HORIZON, ACTION, generator=gen),
        "noise": torch.randn(batch, HORIZON, ACTION, generator=gen),
        "time": torch.rand(batch, generator=gen) * 0.999 + 0.001,
    }


def pi0_batch(step: int, batch: int = 2, text: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return {
        "images": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen),
        "tokens": torch.randint(0, VOCAB, (batch, text), generator=gen),
        "state": torch.randn(batch, STATE, generator=gen),
        "actions": torch.randn(batch, HORIZON, ACTION, generator=gen),
        "noise": torch.randn(batch, HORIZON, ACTION, generator=gen),
        "time": torch.rand(batch, generator=gen) * 0.999 + 0.001,
    }
