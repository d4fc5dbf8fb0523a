"""torchao's float8 training under FSDP2, as large runs use it: ``convert_to_float8_training``
with ``enable_fsdp_float8_all_gather=True``, so FSDP2 all-gathers each weight already cast to
float8 (``WeightWithDynamicFloat8CastTensor``, which keeps the float32 weight it casts), and
torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each step, as torchtitan calls it.
DMuonFSDP steps the float32 weights exactly (float64 reference on the gradients the float8
matmuls gave) and leaves them torchao's tensors, so that the next forward still gathers float8.

Gloo has no float8 types ("Invalid scalar type"): each FSDP module's all-gather is FSDP2's own
with 1-byte buffers viewed as uint8 (``set_custom_all_gather``), which moves the same bytes and
records the dtypes it was given. Shards are even (2 and 4 ranks): torchao 0.18's float8 all-gather
cannot take FSDP2's uneven shards (its ``fsdp_pre_all_gather`` returns the short rank's rows
unpadded, so the all-gather sizes disagree before any optimizer runs; pytorch/ao issue 3982)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

from dmuon_fsdp import DMuonFSDP
from tests.support.layout_runs import OPTIONS, check
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import Reference, train

float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed: the scale extra brings it")

STEPS = 3


class BytesAllGather(DefaultAllGather):
    """FSDP2's all-gather, with float8 buffers moved as bytes (gloo has no float8)."""

    def __init__(self):
        self.dtypes: set[torch.dtype] = set()

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.dtypes.add(input_tensor.dtype)
        if input_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return super().__call__(output_tensor, input_tensor, group, async_op)


class Float8Mlp(nn.Module):
    """Two linear layers torchao converts and a norm weight that stays a plain vector (AdamW)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(32, 48, bias=False)
        self.down = nn.Linear(48, 32, bias=False)
        self.norm = nn.LayerNorm(32, bias=False)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def float8_run(rank, world_size):
    model = Float8Mlp()
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "norm")
    mesh = cpu_mesh()
    gathers = []
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
        gathers.append(BytesAllGather())
        layer.set_custom_all_gather(gathers[-1])
    fully_shard(model, mesh=mesh)
    opt = DMuonFSDP(model.parameters(), **OPTIONS)
    reference = Reference(model, opt)

    def loss(step):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        return model(x).pow(2).mean()

    history = train(
        [(model, opt)],
        STEPS,
        loss=loss,
        reference=reference,
        after_step=lambda step: float8.precompute_float8_dynamic_scale_for_fsdp(model),
    )
    kinds = {n: type(p.to_local()).__name__ for n, p in model.named_parameters()}
    muon_params = {p for group in opt.param_groups if group["use_muon"] for p in group["params"]}
    muon = sorted(n for n, p in model.named_parameters() if p in muon_params)
    return (reference.errors(), reference.counts), kinds, muon, [g.dtypes for g in gathers], history


@pytest.mark.parametrize("world_size", [2, 4])
def test_float8_weights_step_exactly_and_stay_float8_cast(world_size):
    results = run_ranks(float8_run, world_size)
    check([r[0] for r in results], min_owners=2, reuses_slots=False)
    for _, kinds, muon, dtypes, history in results:
        assert muon == ["down.weight", "up.weight"]
        assert kinds["up.weight"] == kinds["down.weight"] == "WeightWithDynamicFloat8CastTensor"
        assert kinds["norm.weight"] == "Tensor"
        assert dtypes == [{torch.float8_e4m3fn}] * 2  # each all-gather, after steps too, moved float8
        losses = [float(losses[0]) for losses, _, _ in history]
        assert losses[-1] < losses[0]
