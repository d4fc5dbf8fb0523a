"""The transformers Trainer with FSDP2 on 2 CPU ranks: it builds DMuonFSDP before sharding from
its own decay / no-decay groups (``route=model`` routes them as ``param_groups`` would) and hands
it to Accelerate, which swaps in the sharded parameters. Trains 4 steps with a checkpoint at
step 2, then a fresh Trainer resumes from it. Run under torchrun; rank 0 writes argv[1]."""

from __future__ import annotations

import os

import torch
from common import batch, finish, out_path, snapshot, tiny_llama
from torch.distributed.tensor import DTensor
from transformers import Trainer, TrainingArguments

from dmuon_fsdp import DMuonFSDP


class CPUFSDPTrainer(Trainer):
    """CPU only: Accelerate keeps FSDP for accelerators, so the FSDP2 setting is put back by hand."""

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if state.distributed_type == DistributedType.MULTI_CPU:
            state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True


def trainer(model, output_dir: str) -> Trainer:
    data = [{"input_ids": ids, "labels": ids} for step in range(4) for ids in batch(step, 0, size=4)]
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=4,
        save_steps=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=0,
        lr_scheduler_type="constant",
        weight_decay=0.1,
        fsdp=True,
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    )
    options = {"route": model, "lr": 0.02, "adamw_lr": 3e-3, "ns_dtype": torch.float32}
    return CPUFSDPTrainer(
        model=model, args=args, train_dataset=data, optimizer_cls_and_kwargs=(DMuonFSDP, options)
    )


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def main():
    output_dir = f"{out_path()}.run"
    first = trainer(tiny_llama(), output_dir)
    first.train()
    opt = first.optimizer.optimizer  # Accelerate's wrapper around DMuonFSDP
    routing = {
        name: group["use_muon"]
        for group in opt.param_groups
        for name, p in first.model.named_parameters()
        if any(p is q for q in group["params"])
    }
    sharded = all(isinstance(p, DTensor) for p in first.model.parameters())
    result = {
        "losses": losses(first),
        "snapshot": snapshot(first.model, opt),
        "routing": routing,
        "sharded": sharded,
    }
    resumed = trainer(tiny_llama(seed=1), output_dir)
    resumed.train(resume_from_checkpoint=os.path.join(output_dir, "checkpoint-2"))
    result.update(
        resumed_losses=losses(resumed), resumed_snapshot=snapshot(resumed.model, resumed.optimizer.optimizer)
    )
    finish(result, out_path())


if __name__ == "__main__":
    main()
