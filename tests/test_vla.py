"""Vision-language-action policies at tiny sizes (``tests.support.vla``): pi0's layout
(transformers' PaliGemma and Gemma, joint attention calling each stack's modules directly) and
WALL-OSS's (Qwen2.5-VL, an action expert FFN beside each decoder layer), routed as Muon's authors
route theirs, trained under DDP, FSDP2 and HSDP: each Muon matrix against the float64 reference
Muon on full matrices, as the LLM layouts are. Parameters without gradients (pi0: the language
model's last output projection, MLP and final norm, only its keys and values feed the expert;
WALL-OSS: the last layer's MLP and the LM head) are skipped as torch skips them; a frozen vision
tower stays as it was; activation checkpointing (torch's wrapper, on vision blocks and action
experts) changes nothing."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import param_groups
from tests.support.layout_runs import against_reference, check
from tests.support.training import full
from tests.support.vla import Pi0, WallOSS, pi0_batch, wall_batch


def routed(model: Pi0 | WallOSS):
    """pi0: its patch embedding and input projections to AdamW, the action head as a head;
    WALL-OSS alike (its Conv3d patch embedding), the LM head found by ``param_groups``."""
    if isinstance(model, Pi0):
        patches = model.vlm.model.vision_tower.embeddings.patch_embedding
    else:
        patches = model.vlm.model.visual.patch_embed
    return param_groups(
        model,
        head=[model.vlm.lm_head, model.action_out_proj],
        adamw=[patches, model.action_in_proj, model.state_proj],
    )


def shard_pi0(model: Pi0, mesh) -> None:
    """FSDP2 where pi0's forward calls modules directly: a unit per vision block (their forward
    runs), and per joint layer one grouped unit of the modules that do run in both stacks (norms,
    projections, MLPs: the decoder layers' and attention modules' own forward never does), the
    rest in the root."""
    for block in model.vlm.model.vision_tower.encoder.layers:
        fully_shard(block, mesh=mesh)
    for vl, ex in model.joint_layers():
        running = [
            m
            for layer in (vl, ex)
            for m in (
                layer.input_layernorm,
                *(getattr(layer.self_attn, f"{x}_proj") for x in "qkvo"),
                layer.post_attention_layernorm,
                layer.mlp,
            )
        ]
        fully_shard(running, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_wall(model: WallOSS, mesh) -> None:
    """FSDP2 for WALL-OSS: a unit per vision block, and per decoder layer one grouped unit of
    what runs (its norms, attention and MLP, and the action expert beside it), the rest in the
    root."""
    for block in model.vlm.model.visual.blocks:
        fully_shard(block, mesh=mesh)
    for layer, expert in zip(model.vlm.model.language_model.layers, model.experts, strict=True):
        running = [layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp, expert]
        fully_shard(running, mesh=mesh)
    fully_shard(model, mesh=mesh)


def wall_run(rank, world_size, layout, frozen, options):
    model = WallOSS()
    tower = model.vlm.model.visual
    # activation checkpointing as torch applies it (before fully_shard): vision blocks, experts
    checkpointed = {*tower.blocks, *(e["mlp"] for e in model.experts)}
    apply_activation_checkpointing(model, check_fn=lambda m: m in checkpointed)
    return train_vla(model, tower, wall_batch, shard_wall, rank, world_size, layout, frozen, options)


def pi0_run(rank, world_size, layout, frozen, options):
    model = Pi0()
    return train_vla(
        model, model.vlm.model.vision_tower, pi0_batch, shard_pi0, rank, world_size, layout, frozen, options
    )


def pi0_bf16_run(rank, world_size, options):
    """pi0 in lerobot's mix: bfloat16 but for the patch and position embeddings and the norms
    (``to_bfloat16_for_selected_params``), the forward under autocast; DDP (each main weight
    held by its matrix's owner alone)."""
    model = Pi0()
    for stack in (model.vlm, model.expert):
        stack.to(torch.bfloat16)
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in ("patch_embedding", "position_embedding") or "norm" in last:
            module.float()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)

    def loss(step):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ddp(pi0_batch(10 * step + rank)).float()

    errors, counts = against_reference(model, routed(model), loss, **options)
    return errors, counts, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_vla(model, tower, batch, shard, rank, world_size, layout, frozen, options):
    if frozen:
        tower.requires_grad_(False)
    before = [p.detach().clone() for p in tower.parameters()]
    loss = model
    if layout == "ddp":  # (parameters without gradients: DDP must look for them)
        loss = DistributedDataParallel(model, find_unused_parameters=True)
    elif layout == "fsdp":
        shard(model, init_device_mesh("cpu", (world_size,)))
    elif layout == "hsdp":
        shard(model, init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard")))
    errors, counts = against_reference(
        model, routed(model), lambda step: loss(batch(10 * step + rank)), **options
    )
    unchanged = all(torch.equal(full(p).detach(), b) for p, b in zip(tower.parameters(), before, strict=True))
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    return errors, counts, unchanged, no_grad


# parameters nothing reads: pi0's last language-model MLP (and o_proj, norm), WALL-OSS's last
# decoder MLP and its LM head
UNREAD = {
    "pi0": ["vlm.model.language_model.layers.1.mlp.up_proj.weight"],
    "wall-oss": ["vlm.model.language_model.layers.1.mlp.up_proj.weight", "vlm.lm_head.weight"],
}


@pytest.mark.parametrize(
    "model,layout,world_size,frozen,options",
    [
        ("pi0", "ddp", 2, False, {}),
        ("pi0", "fsdp", 3, True, {}),
        ("pi0", "hsdp", 4, False, {"overlap_forward": True}),
        ("wall-oss", "ddp", 2, True, {}),
        ("wall-oss", "fsdp", 3, False, {}),
        ("wall-oss", "hsdp", 4, True, {"overlap_forward": True}),
    ],
)
def test_a_vla_trains_as_the_float64_reference(model, layout, world_size, frozen, options):
    from tests.support.spawn import run_ranks

    run = {"pi0": pi0_run, "wall-oss": wall_run}[model]
    results = run_ranks(run, world_size, layout, frozen, options, timeout=300)
    check([(errors, counts) for errors, counts, _, _ in results], min_owners=world_size)
    for _, _, unchanged, no_grad in results:
        assert unchanged == frozen  # a frozen tower stays; a trained one moves
        assert set(UNREAD[model]) <= set(no_grad)


@pytest.mark.parametrize("options", [{}, {"overlap_backward": True, "overlap_forward": True}])
def test_pi0_in_lerobots_bf16_mix_keeps_float32_main_weights_that_follow_the_reference(options):
    """Its bfloat16 Muon matrices' float32 main weights follow the float64 reference fed the
    same gradients as closely as float32 weights do; the replicas stay bitwise equal: also
    with the step begun in backward (the owners' new main weights made before the verdict) and
    its relays left to the next forward."""
    from tests.support.spawn import run_ranks

    results = run_ranks(pi0_bf16_run, 2, options, timeout=300)
    check([(errors, counts) for errors, counts, _ in results], min_owners=2)
    params = [p for _, _, p in results]
    dtypes = {p.dtype for p in params[0].values()}
    assert dtypes == {torch.bfloat16, torch.float32}
    for name, p in params[0].items():
        assert torch.equal(p, params[1][name]), name
