"""DMuonFSDP: Muon for FSDP2-sharded models, with each matrix orthogonalized once, by its owner."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dmuon_fsdp import comm, elementwise, validation
from dmuon_fsdp.grad_checks import NONFINITE_POLICIES, check_gradients
from dmuon_fsdp.comm import local_shard as _local
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, default_ns_dtype, orthogonalize_all, resolve_coefficients
from dmuon_fsdp.layouts import describe_params
from dmuon_fsdp.planner import Piece, Plan, build_plan
from dmuon_fsdp.stats import StepStats

_OPTIMIZER_WIDE = ("ns_dtype", "comm_dtype", "bucket_bytes", "overlap", "time_phases", "nonfinite", "check_grads")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """The Muon step size for a rows x cols matrix, as in ``torch.optim.Muon``."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def _piece_of(local: Tensor, piece: Piece) -> Tensor:
    """This rank's piece of a matrix inside its local shard (a view: in-place ops update it)."""
    return local.view(-1, piece.cols)[piece.local_row : piece.local_row + piece.rows]


class DMuonFSDP(Optimizer):
    """Distributed Muon for FSDP2, HSDP, FSDP + TP and replicated (DDP) parameters, and plain
    tensors in one process; AdamW for the rest. Each matrix is orthogonalized once in the job,
    by an owner rank of the widest mesh the Muon parameters live on (see ``dmuon_fsdp.layouts``).

    Arguments follow ``torch.optim.Muon`` (lr, momentum, nesterov, weight_decay, ns_steps,
    ns_coefficients, eps, adjust_lr_fn), plus:

    - ``ns_coefficients``: one (a, b, c) triple, a list of per-iteration triples (iterations past
      its end reuse the last), or a name: ``"muon"`` or ``"polar_express"``.
    - ``ns_dtype``: dtype of the Newton-Schulz matmuls; None = bf16 on CUDA, fp32 otherwise.
    - ``comm_dtype``: dtype of the all-to-all buffers; None = ``ns_dtype``.
    - ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``: the AdamW settings of
      parameters routed to AdamW.
    - ``bucket_bytes``: bound on the full-matrix bytes exchanged per bucket; ``overlap``: launch
      bucket k+1's exchange before bucket k's Newton-Schulz (False: strictly one after another).
    - ``nonfinite``: what a step does when any rank has an inf/NaN gradient: ``"raise"``
      (NonFiniteGradientError naming the parameters and ranks, on every rank), ``"skip"`` (no
      parameter or state changes, on every rank; ``last_step_stats.skipped``) or ``"ignore"``.
    - ``check_grads``: verify each step that all ranks have gradients for the same parameters
      (GradientMismatchError instead of a hang), and, when the plan is (re)built, that every
      rank built the same plan (ValueError otherwise, e.g. plain tensors that differ by rank). Cost: one ``all_reduce`` of four integers per
      step, shared with the ``nonfinite`` check; with ``check_grads=False, nonfinite="ignore"``
      a step makes no collective besides the exchanges. The non-finite check also reads every
      local gradient once (a ``_foreach_norm``).
    - ``time_phases``: record wall time per phase in ``last_step_stats`` (synchronizes the device
      at phase boundaries on accelerators; for benchmarks). NS flops and bytes on the wire are
      recorded in ``last_step_stats`` either way.

    - ``flatten`` (per group): True views a >2-D weight as one (dim0, -1) matrix (conv kernels);
      False treats it as a stack of dim0 matrices (dim1, -1), e.g. MoE experts [E, m, n]. An
      expert stack sharded on its expert dim is orthogonalized where it lives, with no exchange.
    - ``split_sizes`` / ``num_heads`` (per group): orthogonalize row blocks of each matrix
      separately, e.g. ``split_sizes=[q, k, v]`` for a fused QKV weight or ``num_heads=h`` for
      per-head blocks; the same as separate parameters (lr scale and weight decay per block),
      wherever the blocks fall relative to shard boundaries.

    Routing: within a group, parameters with ndim >= 2 use Muon and the others AdamW; a group's
    ``use_muon`` (True/False) overrides that. A group that mixes both is split into a Muon group
    and an AdamW group (with lr/betas/eps/weight_decay from its ``adamw_*`` options), so
    ``param_groups`` can hold more groups than were passed and learning-rate schedulers scale
    both. In a group with ``use_muon=False`` the plain keys lr/betas/eps/weight_decay are AdamW's
    (defaulting to the ``adamw_*`` values). The plain ``model.parameters()`` form sends every 2-D
    weight, embeddings and output head included, to Muon; ``dmuon_fsdp.param_groups(model)``
    sends those to AdamW. Weights with ndim > 2 are orthogonalized as (dim0, -1) matrices and
    their lr scale uses that shape.

    ``ns_dtype``, ``comm_dtype``, ``bucket_bytes``, ``overlap`` and ``time_phases`` are
    optimizer-wide. State for
    every parameter exists from construction; momentum buffers are placed like their parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: Any = MUON_COEFFICIENTS,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        bucket_bytes: int = 128 * 2**20,
        overlap: bool = True,
        time_phases: bool = False,
        nonfinite: str = "raise",
        check_grads: bool = True,
        flatten: bool = True,
        split_sizes: list[int] | None = None,
        num_heads: int | None = None,
    ):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.ns_dtype, self.comm_dtype = ns_dtype, comm_dtype
        self.bucket_bytes, self.overlap = int(bucket_bytes), bool(overlap)
        self.time_phases = bool(time_phases)
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite, self.check_grads = nonfinite, bool(check_grads)
        self._exchange = comm.ExchangeGroup(None, 0, (0,))  # where Muon matrices move
        self._mesh: Any = None  # the mesh they move over (None: plain tensors)
        self._check_group: Any = None
        self.last_step_stats: StepStats | None = None
        self._names: dict[Tensor, str] = {}
        self._muon_meshes: dict[Any, str] = {}
        self._plan_key: tuple | None = None
        self._plan: Plan | None = None
        self._shard_exchange: comm.ShardExchange | None = None
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, eps=eps,
            adjust_lr_fn=adjust_lr_fn, adamw_lr=adamw_lr, adamw_betas=adamw_betas,
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
            flatten=flatten, split_sizes=split_sizes, num_heads=num_heads,
        )  # fmt: skip
        super().__init__(params, defaults)

    # ---- construction -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, routing its parameters to Muon or AdamW (see the class docstring).

        Everything is validated before anything is registered, so a rejected group leaves the
        optimizer as it was.
        """
        group = dict(param_group)
        for key in _OPTIMIZER_WIDE:
            if key in group:
                raise ValueError(f"{key} is optimizer-wide and cannot be set per param group")
        params = group.pop("params")
        params = [params] if isinstance(params, Tensor) else list(params)
        use_muon = group.pop("use_muon", None)
        if use_muon not in (None, True, False):
            raise ValueError(f"use_muon must be True, False or unset, got {use_muon!r}")
        index = sum(len(g["params"]) for g in self.param_groups)
        names: dict[Tensor, str] = {}
        muon, adamw = [], []
        for i, item in enumerate(params):
            name, p = item if isinstance(item, tuple) else (f"parameter {index + i}", item)
            if not isinstance(p, Tensor):
                raise TypeError(f"{name} is a {type(p).__name__}, not a tensor")
            if not isinstance(item, tuple):
                name = f"{name} (shape {tuple(p.shape)})"
            if p in self._names or p in names:
                first = self._names.get(p, names.get(p))
                raise ValueError(f"{name} is passed to the optimizer twice (first as {first})")
            route_to_muon = p.ndim >= 2 if use_muon is None else use_muon
            if route_to_muon and p.ndim < 2:
                raise ValueError(
                    f"{name} has shape {tuple(p.shape)} but its group sets use_muon=True: Muon "
                    "needs a matrix (ndim >= 2)"
                )
            if p.is_complex():
                raise ValueError(f"{name}: complex parameters are not supported")
            names[p] = name
            (muon if route_to_muon else adamw).append(item)
        new_groups = []
        if muon or not adamw:
            new_groups.append({**group, "params": muon, "use_muon": True})
        if adamw:
            adamw_group = {**group, "params": adamw, "use_muon": False}
            for key in ("lr", "betas", "eps", "weight_decay"):
                if not (use_muon is False and key in group):
                    adamw_group[key] = group.get(f"adamw_{key}", self.defaults[f"adamw_{key}"])
            new_groups.append(adamw_group)
        meshes = validation.check_new_groups(new_groups, names, self.defaults, self._muon_meshes)
        if meshes != self._muon_meshes:
            self._mesh = validation.exchange_mesh(meshes)
            self._exchange = comm.exchange_group(self._mesh)
            self._check_group = self._exchange.group
        self._muon_meshes = meshes
        self._names.update(names)
        for new in new_groups:
            super().add_param_group(new)
            self._init_state(self.param_groups[-1])

    def _init_state(self, group: dict[str, Any]) -> None:
        for p in group["params"]:
            if self._check_group is None and (isinstance(p, DTensor) or comm.default_world_size() > 1):
                self._check_group = comm.exchange_group(p.device_mesh if isinstance(p, DTensor) else None).group
            zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["use_muon"]:
                self.state[p]["momentum_buffer"] = zeros
            else:
                self.state[p].update(step=torch.tensor(0.0), exp_avg=zeros, exp_avg_sq=torch.zeros_like(zeros))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict after checking it matches this optimizer parameter by parameter."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}")
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]) or saved.get("use_muon") != group["use_muon"]:
                raise ValueError(
                    f"param group {index}: state dict has {len(saved['params'])} parameters (use_muon="
                    f"{saved.get('use_muon')}), this optimizer {len(group['params'])} (use_muon={group['use_muon']})"
                )
            for key, p in zip(saved["params"], group["params"]):
                validation.check_saved_state(self._names[p], p, self.state[p], saved_state.get(key, {}))
        super().load_state_dict(state_dict)

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Momentum and AdamW on local shards, Newton-Schulz by owners, then the update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        stats = StepStats(device, timed=self.time_phases)
        self.last_step_stats = stats
        if not check_gradients(params, self._names, self._check_group, self.nonfinite, self.check_grads,
                               self._relayouted()):  # fmt: skip
            stats.skipped = True
            return loss
        entries: list[tuple[dict[str, Any], Tensor, Tensor]] = []
        with stats.phase("elementwise"):
            for group in self.param_groups:
                with_grad = [p for p in group["params"] if p.grad is not None]
                if not with_grad:
                    continue
                grads = [_local(p.grad) for p in with_grad]
                if group["use_muon"]:
                    buffers = [_local(self.state[p]["momentum_buffer"]) for p in with_grad]
                    updates = elementwise.muon_momentum(grads, buffers, group["momentum"], group["nesterov"])
                    entries.extend((group, p, u) for p, u in zip(with_grad, updates))
                else:
                    states = [self.state[p] for p in with_grad]
                    elementwise.adamw(
                        [_local(p) for p in with_grad], grads,
                        [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states],
                        [s["step"] for s in states], lr=float(group["lr"]), betas=group["betas"],
                        eps=group["eps"], weight_decay=group["weight_decay"],
                    )  # fmt: skip
        if entries:
            self._muon_update(entries, stats)
        return loss

    def _relayouted(self) -> set[Tensor]:
        """Parameters whose local shard no longer matches their state (resharded or resized)."""
        return {
            p
            for group in self.param_groups
            for p in group["params"]
            if any(key != "step" and _local(v).shape != _local(p).shape for key, v in self.state[p].items())
        }

    def plan_for(self, entries: list[tuple[dict[str, Any], Tensor, Tensor]]) -> Plan:
        """The (cached) plan for these Muon parameters; rebuilt when their set or layout changes."""
        key = tuple(
            (id(p), p.shape, _local(p).shape, getattr(p, "placements", None), getattr(p, "device_mesh", None),
             g["ns_steps"], g["flatten"], tuple(g["split_sizes"] or ()), g["num_heads"])
            for g, p, _ in entries
        ) + (id(self._mesh),)  # fmt: skip
        if self._plan is None or key != self._plan_key:
            world = comm.default_world_size()
            layouts, param_of = describe_params([(p, self._names[p], g) for g, p, _ in entries], world, self._mesh)
            device = entries[0][1].device
            size = torch.empty((), dtype=self._comm_dtype(device)).element_size()
            plan = build_plan(layouts, len(layouts[0].pieces), self.bucket_bytes, size, param_of)
            if self.check_grads and not comm.all_agree(plan.signature(), self._exchange.group, device):
                raise ValueError(
                    f"the {plan.world_size} ranks exchanging Muon matrices built different plans: their Muon "
                    "parameters (shapes, placements or group options) differ. Plain tensors under a "
                    "process group are treated as replicated on every rank (DDP)"
                )
            self._plan, self._plan_key, self._shard_exchange = plan, key, None
        return self._plan

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        return self.ns_dtype or default_ns_dtype(device)

    def _comm_dtype(self, device: torch.device) -> torch.dtype:
        return self.comm_dtype or self._ns_dtype(device)

    def _muon_update(self, entries: list[tuple[dict[str, Any], Tensor, Tensor]], stats: StepStats) -> None:
        plan = self.plan_for(entries)
        device = entries[0][2].device
        rank = self._exchange.rank
        if self._shard_exchange is None:
            self._shard_exchange = comm.ShardExchange(plan, self._exchange, self._comm_dtype(device))
        local_pieces = {
            j: _piece_of(entries[plan.param_of[j]][2], m.pieces[rank])
            for j, m in enumerate(plan.matrices)
            if m.pieces[rank].numel
        }

        def orthogonalize(full: dict[int, Tensor]) -> dict[int, Tensor]:
            stats.ns_flops += sum(plan.matrices[j].cost for j in full)
            with stats.phase("newton_schulz"):
                return self._orthogonalize(full, entries, plan, device)

        def apply(blocks: dict[int, Tensor]) -> None:
            with stats.phase("apply"):
                self._apply(blocks, entries, plan, rank)

        self._shard_exchange.run(local_pieces, device, orthogonalize, apply, self.overlap, stats)

    def _orthogonalize(
        self, full: dict[int, Tensor], entries: list[tuple[dict[str, Any], Tensor, Tensor]], plan: Plan, device
    ) -> dict[int, Tensor]:
        """Batched Newton-Schulz over one bucket's owned matrices (called once per bucket)."""

        def settings(j: int) -> tuple:
            group = entries[plan.param_of[j]][0]
            return resolve_coefficients(group["ns_coefficients"], group["ns_steps"]), group["eps"]

        return orthogonalize_all(full, settings, self._ns_dtype(device))

    def _apply(
        self, blocks: dict[int, Tensor], entries: list[tuple[dict[str, Any], Tensor, Tensor]], plan: Plan, rank: int
    ) -> None:
        """Weight decay and the scaled update on this rank's piece of each matrix: one foreach
        multiply for the decays and one foreach add per distinct step size."""
        decayed, decays = [], []
        by_step: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
        for j, block in blocks.items():
            group, p, _ = entries[plan.param_of[j]]
            m = plan.matrices[j]
            piece = m.pieces[rank]
            lr = float(group["lr"])
            target = _piece_of(_local(p), piece)
            if group["weight_decay"]:
                decayed.append(target)
                decays.append(1.0 - lr * group["weight_decay"])
            targets, updates = by_step.setdefault(adjusted_lr(lr, group["adjust_lr_fn"], m.rows, m.cols), ([], []))
            targets.append(target)
            updates.append(block)
        if decayed:
            torch._foreach_mul_(decayed, decays)
        for step_size, (targets, updates) in by_step.items():
            torch._foreach_add_(targets, updates, alpha=-step_size)
