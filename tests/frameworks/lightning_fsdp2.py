"""Lightning's ModelParallelStrategy (FSDP2) on 2 CPU ranks, Fabric and Trainer: DMuonFSDP on the
sharded model, 4 steps with a checkpoint at step 2, then a fresh model resumes from it. Run under
torchrun; rank 0 writes the results to argv[1]."""

from __future__ import annotations

import lightning as L
import torch
from common import batch, finish, out_path, snapshot, tiny_llama, train
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from dmuon_fsdp import DMuonFSDP, param_groups


def shard(model, mesh):
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fabric_run(fabric, checkpoint: str, seed: int, resume: bool):
    model = fabric.setup(tiny_llama(seed))  # sharded by the strategy's parallelize_fn
    opt = fabric.setup_optimizers(DMuonFSDP(param_groups(model), ns_dtype=torch.float32))
    state = {"model": model, "optimizer": opt}
    if resume:
        fabric.load(checkpoint, state)
    losses = []
    if not resume:
        losses = train(model, opt, range(2), fabric.global_rank, fabric.backward)
        fabric.save(checkpoint, state)
    losses += train(model, opt, range(2, 4), fabric.global_rank, fabric.backward)
    return losses, snapshot(model, opt)


class LitLlama(L.LightningModule):
    def __init__(self, seed: int):
        super().__init__()
        self.seed, self.model, self.losses = seed, None, []

    def configure_model(self):
        if self.model is None:
            self.model = shard(tiny_llama(self.seed), self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return DMuonFSDP(param_groups(self.model), ns_dtype=torch.float32)

    def training_step(self, ids, _):
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss


def trainer_run(checkpoint_dir: str, seed: int, resume_from: str | None):
    module = LitLlama(seed)
    # One batch per epoch, a checkpoint at each epoch's end: Lightning resumes a plain DataLoader
    # from its first batch (here the same one), whatever it counts as the batch index.
    every = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=checkpoint_dir, save_top_k=-1, save_on_train_epoch_end=True
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=4,
        callbacks=[every],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    data = DataLoader(list(batch(0, rank)), batch_size=4)
    trainer.fit(module, data, ckpt_path=resume_from)
    return module.losses, snapshot(module.model, trainer.optimizers[0])


def main():
    fabric = L.Fabric(
        accelerator="cpu",
        devices=2,
        strategy=FabricModelParallel(
            parallelize_fn=lambda model, mesh: shard(model, mesh["data_parallel"]),
            data_parallel_size=2,
            tensor_parallel_size=1,
        ),
    )
    fabric.launch()
    path = out_path()
    result = {
        "fabric": fabric_run(fabric, f"{path}.fabric", 0, False),
        "fabric-resumed": fabric_run(fabric, f"{path}.fabric", 1, True),
    }
    result["trainer"] = trainer_run(f"{path}.trainer", 0, None)
    result["trainer-resumed"] = trainer_run(f"{path}.trainer2", 1, f"{path}.trainer/epoch=1-step=2.ckpt")
    finish(result, path)


if __name__ == "__main__":
    main()
