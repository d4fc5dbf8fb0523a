"""Shared pieces of the framework scripts: a tiny Llama from a config (no downloads), its data,
and a snapshot of parameters and optimizer state as full tensors."""

from __future__ import annotations

import sys

import torch
from torch.distributed.tensor import DTensor

from recipes.stop import let_threads_run


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def batch(step: int, rank: int, size: int = 4, length: int = 16) -> torch.Tensor:
    """Token ids of one rank's batch at ``step``: the same on every run."""
    return torch.randint(0, 96, (size, length), generator=torch.Generator().manual_seed(1000 * step + rank))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and state tensor as a full tensor, by parameter name (a collective)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        out.update({f"{name}:{key}": full(v) for key, v in opt.state[p].items()})
    return out


def out_path() -> str:
    return sys.argv[1]


def train(model, opt, steps, rank: int, backward) -> list[float]:
    """Causal-LM steps on ``batch(step, rank)``; ``backward`` is the framework's
    (``accelerator.backward``)."""
    losses = []
    for step in steps:
        ids = batch(step, rank)
        loss = model(input_ids=ids, labels=ids).loss
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def finish(result, path: str) -> None:
    """Rank 0 saves ``result``; every rank destroys the process group and exits normally (the
    test checks the exit status).

    The gathers of ``snapshot`` (DTensor's, as the frameworks' own collectives) leave their
    tensors to gloo's worker threads, which drop them when they next run; a drop after
    interpreter finalization began aborts the process ("terminate called without an active
    exception"; DMuonFSDP's own collectives wait for it, see ``dmuon_fsdp._step.comm.settle``). On 2
    busy cores a job that exits right after such gathers aborted in 8 of 58 runs. A fixed pause
    (0.2 s before) is a guess that a busier machine outlasts, so every rank waits until the
    workers have had their turn (``let_threads_run``).
    """
    import torch.distributed as dist

    if dist.get_rank() == 0:
        torch.save(result, path)
    dist.barrier()
    let_threads_run()
    dist.destroy_process_group()
