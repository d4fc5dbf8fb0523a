"""The torchtitan snippet of docs/integrations.md, run against torchtitan 0.3.0 on 2 CPU ranks.

The test environment installs torchtitan with the ``scale`` extra (``torchtitan==0.3.0``, and
``triton==3.9.0``, which torchtitan's model code imports and torch's CPU wheels do not bring);
without that extra this module skips.

torchtitan's own parts: the ``Trainer.Config`` of Llama 3's ``debugmodel`` from its config registry
(cut to 2 layers), its ``ParallelDims`` meshes, ``parallelize_llama`` (selective activation
checkpointing, then FSDP2 through ``apply_fsdp_to_decoder``), ``init_weights``, the optimizer
built as ``Trainer.__init__`` builds it (``config.optimizer.build(model_parts=...)``), the LR
schedulers, ``ChunkedLossWrapper`` and ``clip_grad_norm_``, stepped as ``Trainer.train_step``
steps. What differs, because torchtitan 0.3.0 (with torch 2.13.0) stops there on a CPU:

- ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` (tools/utils.py:55), so
  ``Trainer.__init__`` stops at ``device_module.set_device`` (trainer.py:301) and
  ``ParallelDims.build_mesh`` at ``init_device_mesh("cuda", ...)`` (parallel_dims.py:281), both in
  ``torch.cuda.set_device``: "AttributeError: module 'torch._C' has no attribute
  '_cuda_setDevice'". The test sets that name to ``"cpu"`` in ``torchtitan.distributed.parallel_dims``
  and runs the trainer's steps itself (its dataloader and tokenizer also read
  ``./tests/assets``, which is in torchtitan's repository, not in its wheel).
- Llama 3's attention backends: ``flex`` (the default) raises "FlexAttention does not support
  backward on CPU" (torch/nn/attention/flex_attention.py:2082, from torchtitan's
  models/common/attention.py:310); ``varlen`` runs ``aten::_flash_attention_forward``, which has
  no CPU kernel. The test swaps each layer's ``inner_attention`` to
  ``ScaledDotProductAttention.Config()``, as torchtitan's own graph_trainer tests do
  (experiments/graph_trainer/common_utils.py: causal attention, no per-document masks).
- ``parallelism.spmd_backend``: the default ``"spmd_types"`` leaves parameters plain tensors that
  torch 2.13.0's ``fully_shard`` refuses at dp_shard=2 ("When dp_mesh_dims is provided, all
  parameters must be DTensors", torch/distributed/fsdp/_fully_shard/_fsdp_param.py:346; not a
  CPU matter: torchtitan recommends a PyTorch nightly). ``"full_dtensor"`` wants DTensor inputs
  ("Got a plain Tensor under the full_dtensor mode", protocols/module.py:597). The test uses
  ``"partial_dtensor"``: FSDP2 on plain parameters, torchtitan's classic path.
- torchtitan sets FSDP2's gradient divide factor to 1 (fsdp.py:316; it divides by the token count
  itself), for which FSDP2 reduce-scatters with ``PREMUL_SUM``: "Cannot use ReduceOp.PREMUL_SUM
  with Gloo". The test sets ``set_force_sum_reduction_for_comms(True)`` on each FSDP module (as
  torchtitan's own ``enable_fsdp_symm_mem`` does): a plain sum, the same gradients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip(
    "torchtitan",
    minversion="0.3.0",
    reason="torchtitan is not installed: the scale extra brings it (pip install -e '.[dev,recipes,scale]')",
)
pytest.importorskip(
    "triton",
    reason="torchtitan 0.3.0's model code imports triton (torchtitan/distributed/minimal_async_ep/"
    "kernels.py:10), which torch's CPU wheels do not bring: the scale extra brings triton==3.9.0",
)

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from dmuon_fsdp import DMuonFSDP, param_groups
from tests.support.spawn import run_ranks

DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"
STEPS = 4
SPMD_BACKEND = "partial_dtensor"
BATCH, SEQ = 2, 64  # per rank; SEQ divisible by ChunkedLossWrapper's 8 chunks


# The snippet of docs/integrations.md, as it stands there (test_snippet_is_the_docs checks it).
class DMuonContainer(OptimizersContainer):
    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        adamw_lr: float = 3e-3
        weight_decay: float = 0.0

    def __init__(self, config, *, model_parts):
        self.model_parts = model_parts
        self.optimizers = []
        for m in model_parts:
            groups = param_groups(m, stacked="experts")
            for g in groups:  # torchtitan's names: without the activation-checkpoint wrapper
                g["params"] = [(canonical_fqn(name), p) for name, p in g["params"]]
            self.optimizers.append(
                DMuonFSDP(groups, lr=config.lr, adamw_lr=config.adamw_lr, weight_decay=config.weight_decay)
            )
        self._post_init([p for m in model_parts for p in m.parameters() if p.requires_grad])


# End of the snippet.


def _trainer_config(dump_folder: str):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.optimizer = DMuonContainer.Config(lr=0.02, adamw_lr=3e-3)  # the docs' line
    model = config.model_spec.model
    model.layers = model.layers[:2]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # see the docstring
    config.training.local_batch_size, config.training.seq_len = BATCH, SEQ
    config.training.steps = STEPS + 2  # the LR schedule ends at 0: the step after the round trip moves
    config.parallelism.spmd_backend = SPMD_BACKEND  # see the docstring
    config.dump_folder = dump_folder
    return config


def _build_model(config, parallel_dims):
    """As ``Trainer.__init__`` builds a model part without pipeline parallelism (on the CPU)."""
    from torchtitan.tools import utils
    from torchtitan.trainer import TORCH_DTYPE_MAP

    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = config.model_spec.model.build()
    model = config.model_spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=config.dump_folder,
    )
    for module in model.modules():
        if isinstance(module, FSDPModule):  # gloo has no PREMUL_SUM (see the docstring)
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)  # a ChunkedLossWrapper: as the Trainer
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return model, loss_fn


def _train_step(config, parallel_dims, model, loss_fn, optimizers, schedulers, batch) -> float:
    """``Trainer.train_step`` for one batch: no gradient accumulation, pipeline or logging."""
    from torchtitan.distributed import utils as dist_utils

    inputs, labels, positions = batch
    optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
    tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel()), parallel_dims.get_mesh("batch"))
    pred = model(inputs, positions=positions)
    loss, _ = loss_fn(pred, labels, tokens, positions=positions)
    loss.backward()
    dist_utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
    optimizers.step()
    if schedulers is not None:
        schedulers.step()
    total = loss.detach().clone()
    dist.all_reduce(total)  # each rank's loss is its token sum over all ranks' tokens
    return total.item()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _params(model) -> dict[str, torch.Tensor]:
    return {canonical_fqn(n): _local(p).detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name}"


def _copy_params(source, target) -> None:
    with torch.no_grad():
        for p, q in zip(source.parameters(), target.parameters(), strict=True):
            _local(q).copy_(_local(p))


def _titan_on_ranks(rank: int, world_size: int, dump_folder: str) -> dict:
    import torchtitan.distributed.parallel_dims as titan_parallel_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    titan_parallel_dims.device_type = "cpu"  # its fallback is "cuda" (see the docstring)
    config = _trainer_config(dump_folder)
    # As Trainer.__init__, from init_distributed on (the gloo group is run_ranks's).
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    parallel_dims.build_mesh()
    assert parallel_dims.fsdp_enabled and parallel_dims.dp_shard == world_size
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    dist_utils.set_determinism(
        parallel_dims, torch.device("cpu"), config.debug, distinct_seed_mesh_dims=["pp"]
    )
    config.model_spec.model.update_from_config(config=config)

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as data parallel
    tokens = torch.randint(0, config.model_spec.model.vocab_size, (BATCH, SEQ + 1), generator=generator)
    positions = torch.arange(SEQ).repeat(BATCH, 1)  # one document per row, as the dataloader's
    batch = (tokens[:, :-1], tokens[:, 1:], positions)

    # The docs' container, built as the Trainer builds its optimizer, and a twin model stepped by a
    # DMuonFSDP of its own: the container must step exactly as DMuonFSDP does.
    model, loss_fn = _build_model(config, parallel_dims)
    optimizers = config.optimizer.build(model_parts=[model])
    assert type(optimizers) is DMuonContainer and len(optimizers) == 1
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    hooks = []
    optimizers.register_step_pre_hook(lambda *args: hooks.append(1))  # as MoE load balancing does
    twin, twin_loss_fn = _build_model(config, parallel_dims)
    _copy_params(model, twin)
    twin_optimizer = DMuonFSDP(param_groups(twin, stacked="experts"), lr=0.02, adamw_lr=3e-3)
    twin_schedulers = config.lr_scheduler.build(
        optimizers=[twin_optimizer], training_steps=config.training.steps
    )

    start = _params(model)
    routed = {g["use_muon"]: set(g["param_names"]) for g in optimizers.optimizers[0].param_groups}
    losses = []
    for _ in range(STEPS):
        losses.append(_train_step(config, parallel_dims, model, loss_fn, optimizers, schedulers, batch))
        twin_loss = _train_step(
            config, parallel_dims, twin, twin_loss_fn, twin_optimizer, twin_schedulers, batch
        )
        assert twin_loss == losses[-1]
        _assert_same(_params(model), _params(twin), "container vs DMuonFSDP")
    trained = _params(model)
    changed = {n for n in trained if not torch.equal(trained[n], start[n])}

    # The keys torchtitan's own container gives (AdamW on every parameter, on the twin; its
    # state_dict makes the state with a step that it skips while any gradient is set).
    twin_optimizer.zero_grad(set_to_none=True)
    adamw = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
        implementation="for-loop",
    ).build(model_parts=[twin])
    titan_keys = set(adamw.state_dict())

    # torchtitan's flat, FQN-keyed state dict and its schedulers' state, loaded as its checkpointer
    # loads them into a new container (with its schedulers) on a copy of the model: the next step
    # must then be the same on both.
    flat = optimizers.state_dict()
    copy, copy_loss_fn = _build_model(config, parallel_dims)
    _copy_params(model, copy)
    copied = config.optimizer.build(model_parts=[copy])
    copied_schedulers = config.lr_scheduler.build(optimizers=copied, training_steps=config.training.steps)
    # Loaded from copies, as from a checkpoint: torch's load_state_dict keeps the very tensors it
    # is given, which here are the first container's live state.
    copied.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat.items()})
    copied_schedulers.load_state_dict(schedulers.state_dict())
    _assert_same(_params(copy), trained, "parameters after load_state_dict")
    again = copied.state_dict()
    assert again.keys() == flat.keys()
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(_local(again[key]), _local(value)), key
        else:
            assert again[key] == value, key
    lr = [g["lr"] for g in optimizers.optimizers[0].param_groups]
    assert lr == [g["lr"] for g in copied.optimizers[0].param_groups] and min(lr) > 0
    after = _train_step(config, parallel_dims, model, loss_fn, optimizers, schedulers, batch)
    copy_after = _train_step(config, parallel_dims, copy, copy_loss_fn, copied, copied_schedulers, batch)
    assert copy_after == after
    stepped = _params(model)
    _assert_same(_params(copy), stepped, "a step after the state dict's round trip")
    assert all(not torch.equal(stepped[n], trained[n]) for n in stepped)

    return {
        "losses": losses,
        "hooks": len(hooks),
        "names": set(trained),
        "changed": changed,
        "muon": routed[True],
        "adamw": routed[False],
        "state_keys": set(flat),
        "titan_keys": titan_keys,
        "wrapped": any("._checkpoint_wrapped_module." in n for n, _ in model.named_parameters()),
    }


def test_docs_container_trains_torchtitan_llama3(tmp_path):
    """The docs' ``DMuonContainer`` trains torchtitan's Llama 3 (FSDP2 over 2 CPU ranks, selective
    activation checkpointing, its LR schedule and gradient clipping) exactly as ``DMuonFSDP`` does,
    routes the embeddings, norms and head to AdamW, and its state dict (torchtitan's flat one)
    round-trips through a new container."""
    results = run_ranks(_titan_on_ranks, 2, str(tmp_path), timeout=600.0)
    first = results[0]
    for other in results[1:]:
        assert other["losses"] == first["losses"]
    losses = first["losses"]
    assert losses[-1] < losses[0] - 0.5, losses  # one fixed batch per rank: it is learned
    assert first["hooks"] == STEPS + 1  # the step after the round trip too

    names = first["names"]
    assert first["changed"] == names  # every parameter moved
    assert first["wrapped"]  # the model's own names carry the activation-checkpoint wrapper
    adamw = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"}
    adamw |= {n for n in names if n.endswith("_norm.weight")}
    assert first["adamw"] == adamw
    assert first["muon"] == names - adamw
    assert any(".wqkv." in n for n in first["muon"]) and any(".w2." in n for n in first["muon"])

    # torchtitan's keys, state.<fqn>.<state> and param_groups.<fqn>.<option>, on the same names as
    # its own container's (activation checkpointing wraps every layer: no wrapper in them).
    def fqns(keys, kind):
        return {re.fullmatch(rf"{kind}\.(.+)\.[a-z_0-9]+", k)[1] for k in keys if k.startswith(kind + ".")}

    for kind in ("state", "param_groups"):
        assert fqns(first["state_keys"], kind) == fqns(first["titan_keys"], kind) == names
    assert {f"state.{n}.momentum_buffer" for n in first["muon"]} <= first["state_keys"]
    assert {f"state.{n}.exp_avg_sq" for n in adamw} <= first["state_keys"]


def test_snippet_is_the_docs():
    """The container above is the docs' snippet, line for line."""
    text = DOCS.read_text()
    section = text[text.index("**torchtitan**") :]
    snippet = section[section.index("```python\n") + len("```python\n") :]
    snippet = snippet[: snippet.index("```")]
    docs_class = snippet[snippet.index("class DMuonContainer") :]
    docs_class = docs_class[: docs_class.index("\n\n\n")].strip()
    source = Path(__file__).read_text()
    ours = source[source.index("class DMuonContainer") : source.index("# End of the snippet.")].strip()
    assert ours == docs_class
    assert "from torchtitan.components.optimizer import OptimizersContainer" in snippet
    assert "config.optimizer = DMuonContainer.Config(lr=0.02, adamw_lr=3e-3)" in snippet
