"""A pi0-shaped vision-language-action policy (``tests.support.vla.Pi0``: transformers' PaliGemma
and Gemma at tiny sizes, joint attention calling each stack's modules directly), routed as Muon's
authors route theirs, trained under DDP, FSDP2 and HSDP: each Muon matrix against the float64
reference Muon on full matrices, as the LLM layouts are. Parameters without gradients (the
language model's last output projection, MLP and final norm: only its keys and values feed the
expert) are skipped as torch skips them; a frozen vision tower stays as it was."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon_fsdp import param_groups
from tests.support.layout_runs import against_reference, check
from tests.support.training import full
from tests.support.vla import Pi0, pi0_batch


def routed(model: Pi0):
    vision = model.vlm.model.vision_tower
    return param_groups(
        model,
        head=[model.action_out_proj],
        adamw=[vision.embeddings.patch_embedding, model.action_in_proj, model.state_proj],
    )


def shard(model: Pi0, mesh) -> None:
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


def pi0_run(rank, world_size, layout, frozen, options):
    model = Pi0()
    tower = model.vlm.model.vision_tower
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
        model, routed(model), lambda step: loss(pi0_batch(10 * step + rank)), **options
    )
    unchanged = all(torch.equal(full(p).detach(), b) for p, b in zip(tower.parameters(), before, strict=True))
    no_grad = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    return errors, counts, unchanged, no_grad


@pytest.mark.parametrize(
    "layout,world_size,frozen,options",
    [
        ("ddp", 2, False, {}),
        ("fsdp", 3, True, {}),
        ("hsdp", 4, False, {"overlap_forward": True}),
    ],
)
def test_pi0_trains_as_the_float64_reference(layout, world_size, frozen, options):
    from tests.support.spawn import run_ranks

    results = run_ranks(pi0_run, world_size, layout, frozen, options, timeout=300)
    check([(errors, counts) for errors, counts, _, _ in results], min_owners=world_size)
    for _, _, unchanged, no_grad in results:
        assert unchanged == frozen  # a frozen tower stays; a trained one moves
        assert "vlm.model.language_model.layers.1.mlp.up_proj.weight" in no_grad
