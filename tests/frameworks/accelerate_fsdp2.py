"""HF Accelerate with FSDP2 on 2 CPU ranks: DMuonFSDP built before ``prepare(model, opt)`` (its
parameters swapped for the sharded ones) and after, then ``save_state`` / ``load_state`` into a
fresh model and optimizer; and built before with ``overlap_backward=True``. Run under torchrun;
rank 0 writes the results to argv[1]."""

from __future__ import annotations

import functools

import common
import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from common import finish, out_path, snapshot, tiny_llama
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from dmuon_fsdp import DMuonFSDP, param_groups

# Accelerate turns "transformer_based_wrap" into a policy on the layer classes it finds by name in the
# model it prepares. A model sharded by hand has none by that name (``fully_shard`` makes each layer
# an ``FSDPLlamaDecoderLayer``: "Could not find the transformer layer class LlamaDecoderLayer"), so
# the run that shards by hand gives the policy resolved, on the class itself.
BY_NAME = "transformer_based_wrap"
BY_CLASS = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})


def accelerator(auto_wrap_policy=BY_NAME) -> Accelerator:
    """An Accelerator whose FSDP2 plugin is this run's own, whatever ran before in this process.

    Accelerate's state is one per process: an ``Accelerator`` made after the first keeps the first
    one's plugin, the plugin resolved on the first model prepared, so the plugin is put in here.
    On a CPU, Accelerate keeps FSDP for accelerators (``MULTI_CPU``): FSDP is put back by hand."""
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy=auto_wrap_policy,
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    )
    acc = Accelerator(fsdp_plugin=plugin, cpu=True)
    assert acc.distributed_type in (DistributedType.MULTI_CPU, DistributedType.FSDP), acc.distributed_type
    acc.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin
    return acc


def train(acc, model, opt, steps) -> list[float]:
    return common.train(model, opt, steps, acc.process_index, acc.backward)


def run(built: str, checkpoint: str, **options):
    model = tiny_llama()
    if built == "before":  # as Accelerate's docs do it: the optimizer on the unsharded model
        acc = accelerator()
        opt = DMuonFSDP(param_groups(model), ns_dtype=torch.float32, **options)
        model, opt = acc.prepare(model, opt)
    else:  # sharded by hand as Accelerate would (Accelerate leaves an FSDP module as it is)
        acc = accelerator(BY_CLASS)
        mesh = init_device_mesh("cpu", (acc.num_processes,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = DMuonFSDP(param_groups(model), ns_dtype=torch.float32)
        model, opt = acc.prepare(model, opt)
    losses = train(acc, model, opt, range(2))
    acc.save_state(checkpoint)
    losses += train(acc, model, opt, range(2, 4))
    started = opt.optimizer.last_step_stats.started_in_backward
    plan = opt.optimizer.plan  # made for the sharded parameters: every rank holds a part of a matrix
    sharded = any(0 < m.pieces[plan.world_size - 1].numel < m.numel for m in plan.matrices)
    return losses, snapshot(model, opt), sharded, started


def resume(checkpoint: str):
    acc = accelerator()
    model = tiny_llama(seed=1)  # different weights: all must come from the checkpoint
    opt = DMuonFSDP(param_groups(model), ns_dtype=torch.float32)
    model, opt = acc.prepare(model, opt)
    acc.load_state(checkpoint)
    return train(acc, model, opt, range(2, 4)), snapshot(model, opt)


def main():
    results = {}
    # "after" first: it must not lean on what an earlier prepare left in Accelerate's state
    for built in ("after", "before"):
        results[built] = run(built, f"{out_path()}.{built}")
        results[f"{built}-resumed"] = resume(f"{out_path()}.{built}")
    results["overlapped"] = run(
        "before", f"{out_path()}.overlapped", overlap_backward=True, bucket_bytes=2**14
    )
    finish(results, out_path())


if __name__ == "__main__":
    main()
