"""DMuonFSDP: Muon for FSDP2-sharded models, with each matrix orthogonalized once, by its owner."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dmuon_fsdp import comm, compiler, grad_checks, program, swaps, validation
from dmuon_fsdp.grad_checks import NONFINITE_POLICIES, Verdict
from dmuon_fsdp.layouts import mesh_index
from dmuon_fsdp.param_groups import routing
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, default_ns_dtype
from dmuon_fsdp.planner import Plan
from dmuon_fsdp.stats import StepStats

_COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _wait(handle: comm.Handle | None) -> None:
    if handle is not None:
        handle.wait()


class DMuonFSDP(Optimizer):
    """Distributed Muon for FSDP2, HSDP, FSDP + TP and replicated (DDP) parameters, and plain
    tensors in one process; AdamW for the rest. Each matrix is orthogonalized once in the job,
    by an owner rank of the widest mesh the Muon parameters live on (see ``dmuon_fsdp.layouts``).

    Arguments follow ``torch.optim.Muon`` (lr, momentum, nesterov, weight_decay, ns_steps,
    ns_coefficients, eps, adjust_lr_fn), plus:

    - ``ns_coefficients``: one (a, b, c) triple, a list of per-iteration triples (iterations past
      its end reuse the last), or a name: ``"muon"`` or ``"polar_express"``.
    - ``ns_algorithm`` (per group): ``"standard"`` Newton-Schulz; ``"gram"``, Gram Newton-Schulz,
      the same polynomials iterated on the s x s matrix X X^T, with restarts that keep low
      precision accurate (``dmuon_fsdp.newton_schulz.gram_segments``); or ``"auto"``, per matrix
      shape the form with fewer flops (Gram for wide MLP matrices, standard for square ones).
      The planner balances owners by the flops of the form each matrix runs.
    - ``ns_dtype``: dtype of the Newton-Schulz matmuls; None = bf16 on CUDA, fp32 otherwise.
    - ``comm_dtype``: dtype of the all-to-all buffers; None = ``ns_dtype``. A float dtype of at
      least 16 bits (the step's check flags travel in it).
    - ``adamw_lr``, ``adamw_betas``, ``adamw_eps``, ``adamw_weight_decay``: the AdamW settings of
      parameters routed to AdamW.
    - ``bucket_bytes``: bound on the full-matrix bytes exchanged per bucket; ``overlap``: launch
      bucket k+1's exchange before bucket k's Newton-Schulz (False: strictly one after another).
    - ``nonfinite``: what a step does when any rank has an inf/NaN gradient: ``"raise"``
      (NonFiniteGradientError naming the parameters and ranks, on every rank), ``"skip"`` (no
      parameter or state changes, on every rank; ``last_step_stats.skipped``) or ``"ignore"``.
    - ``check_grads``: verify each step that all ranks have gradients for the same parameters
      and the same Muon group options (GradientMismatchError instead of a hang), and, when the
      plan is (re)built, that every rank built the same plan (ValueError otherwise, e.g. plain
      tensors that differ by rank; one ``all_reduce`` then). Cost per step: no collective of its
      own. Each rank's findings (with the ``nonfinite`` check's) ride in the step's first
      all-to-all (10 numbers to every peer), and one device-to-host read of their maximum over
      the ranks decides; with ``check_grads=False, nonfinite="ignore"`` there are no flags and no
      read. The non-finite check makes one pass over the local gradients on the device, with
      torch's AMP check (``GradScaler``'s kernel, at scale 1.0: it rewrites each gradient in
      place with the same values, so gradients must be writable).
    - ``route``: a model whose parameters are routed as ``dmuon_fsdp.param_groups(model)`` routes
      them (embeddings, output head and vectors to AdamW) and named by it, for code that builds
      the optimizer from its own flat groups, e.g. ``Trainer(..., optimizer_cls_and_kwargs=
      (DMuonFSDP, {"route": model, ...}))``; a group's ``use_muon`` still wins. It applies to the
      groups given here (not to ``add_param_group`` later) and keeps no reference to the model.
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

    ``ns_dtype``, ``comm_dtype``, ``bucket_bytes``, ``overlap``, ``time_phases``, ``nonfinite``
    and ``check_grads`` are optimizer-wide. State for every parameter exists from construction;
    momentum buffers and AdamW moments are placed like their parameters, AdamW's ``step`` is a
    plain tensor on the parameter's device (as for torch's fused AdamW).

    The first ``step`` compiles a step program (``dmuon_fsdp.compiler``): the plan, every buffer and
    every view a step needs. It is rebuilt when the set of parameters with gradients or a Muon
    group's structural option (ns_steps, ns_coefficients, ns_algorithm, eps, adjust_lr_fn,
    flatten, split_sizes, num_heads) changes, and rebound when a parameter's storage is replaced or
    ``load_state_dict`` replaces the state; lr, momentum, nesterov, weight_decay and AdamW's
    settings are read at every step. ``plan`` shows the plan in use.

    Tensors replaced in ``param_groups`` (HF Accelerate swapping FSDP2's sharded parameters into
    an optimizer built on the unsharded model) are followed by position at the next ``step``,
    ``state_dict`` or ``load_state_dict``: same order and shapes required; state no step or load
    has written is made anew, written state moves exactly to the new layout.
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
        ns_algorithm: str = "standard",
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
        route: nn.Module | None = None,
    ):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if comm_dtype is not None and comm_dtype not in _COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {_COMM_DTYPES} or None, got {comm_dtype}")
        self.ns_dtype, self.comm_dtype = ns_dtype, comm_dtype
        self.bucket_bytes, self.overlap = int(bucket_bytes), bool(overlap)
        self.time_phases = bool(time_phases)
        self.nonfinite, self.check_grads = nonfinite, bool(check_grads)
        self.last_step_stats: StepStats | None = None
        self._names: dict[Tensor, str] = {}
        self._muon_meshes: dict[Any, str] = {}
        self._mesh: Any = None  # the mesh Muon matrices move over (None: plain tensors)
        self._exchange: comm.ExchangeGroup | None = None  # its group, made at the first step
        self._indexed: list[tuple[int, Tensor]] = []  # (group index, parameter), optimizer order
        self._params: list[Tensor] = []  # the same parameters alone
        self._state_written = False  # a step or a load has written state (else swaps recreate it)
        self._programs = compiler.Programs()
        self._route = routing(route) if route is not None else None
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_algorithm=ns_algorithm, eps=eps,
            adjust_lr_fn=adjust_lr_fn, adamw_lr=adamw_lr, adamw_betas=adamw_betas,
            adamw_eps=adamw_eps, adamw_weight_decay=adamw_weight_decay,
            flatten=flatten, split_sizes=split_sizes, num_heads=num_heads,
        )  # fmt: skip
        super().__init__(params, defaults)
        self._route = None  # holding the model's tensors would keep them alive after a swap

    @property
    def plan(self) -> Plan | None:
        """The plan of the last step: owners, buckets and every rank's piece of every matrix
        (None before the first step)."""
        return self._programs.current.plan if self._programs.current is not None else None

    @property
    def exchange_mesh(self) -> Any:
        """The mesh Muon matrices move over: the widest their parameters live on (None: plain tensors)."""
        return self._mesh

    @property
    def exchange_rank(self) -> int:
        """This rank's index in ``plan`` (its row-major coordinate on the exchange mesh); local,
        no collective."""
        mesh = self._group_mesh()
        if mesh is not None:
            return mesh_index(mesh)
        return comm.default_rank()

    # ---- construction -------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, routing its parameters to Muon or AdamW (see the class docstring).

        Everything is validated, and torch's own checks run, before anything is registered, so a
        rejected group leaves the optimizer as it was.
        """
        new_groups, names = validation.split_group(param_group, len(self._indexed), self._names, self.defaults,
                                                   self._route)  # fmt: skip
        meshes = validation.check_new_groups(new_groups, names, self.defaults, self._muon_meshes)
        count = len(self.param_groups)
        try:  # torch's checks (e.g. names on every group or none) come last: undo on failure
            for new in new_groups:
                super().add_param_group(new)
        except Exception:
            del self.param_groups[count:]
            raise
        self._set_meshes(meshes)
        self._names.update(names)
        for g in range(count, len(self.param_groups)):
            for p in self.param_groups[g]["params"]:
                self._indexed.append((g, p))
                self._params.append(p)
                self._init_state(p, self.param_groups[g]["use_muon"])
        self._programs.current = None

    def _set_meshes(self, meshes: dict[Any, str]) -> None:
        """The Muon parameters' meshes (see ``validation.check_new_groups``); a new exchange mesh
        drops the group made for the old one."""
        if meshes != self._muon_meshes:
            self._mesh, self._exchange = validation.exchange_mesh(meshes), None
        self._muon_meshes = meshes

    def _init_state(self, p: Tensor, use_muon: bool) -> None:
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        if use_muon:
            self.state[p]["momentum_buffer"] = zeros
        else:  # step on the parameter's device, where fused AdamW reads it
            step = torch.zeros((), dtype=torch.float32, device=p.device)
            self.state[p].update(step=step, exp_avg=zeros, exp_avg_sq=torch.zeros_like(zeros))

    def _follow_swaps(self) -> None:
        """Rebind by position when tensors in ``param_groups`` were replaced (Accelerate swapping in
        FSDP2's sharded parameters): names, state, meshes and the plan follow. State that a step
        or a load has written moves exactly to the new layout; untouched state is made anew."""
        current = swaps.group_params(self.param_groups)
        if not swaps.replaced(current, self._params):
            return
        now = swaps.indexed(self.param_groups)
        swaps.check(self._indexed, now, self._names, self._state_written)
        names = {new: self._names[old] for old, new in zip(self._params, current)}
        meshes = validation.check_new_groups(self.param_groups, names, self.defaults, {})
        states = [self.state.pop(old) for old in self._params]
        for (g, old), new, state in zip(self._indexed, current, states):
            if new is old:
                self.state[new] = state
            elif self._state_written:
                self.state[new] = {key: value.to(new.device) if key == "step" else swaps.placed_like(value, new)
                                   for key, value in state.items()}  # fmt: skip
            else:
                self._init_state(new, self.param_groups[g]["use_muon"])
        self._names = names
        self._indexed, self._params = now, current
        self._set_meshes(meshes)
        self._programs.current = None

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict (after following any parameters replaced in ``param_groups``)."""
        self._follow_swaps()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict after checking it matches this optimizer parameter by parameter."""
        self._follow_swaps()
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
        # Options added since the state dict was saved (ns_algorithm) keep this optimizer's values.
        groups = [{**group, **saved} for saved, group in zip(saved_groups, self.param_groups)]
        super().load_state_dict({**state_dict, "param_groups": groups})
        for _, p in self._indexed:
            state = self.state[p]
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        self._programs.stale = True
        self._state_written = True

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Momentum and AdamW on local shards, Newton-Schulz by owners, then the update."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_swaps()
        if self._run() is Verdict.REBUILD:  # every rank's gradients or options changed alike
            self._programs.current = None
            self._run()
        return loss

    def _run(self) -> Verdict:
        """One step of the current program: momentum -> send -> checks -> NS -> return -> apply."""
        groups = self.param_groups
        grads = [p.grad for p in self._params]
        key = compiler.step_key(groups, grads, self.check_grads or self.nonfinite != "ignore")
        prog, usable = self._programs.for_step(key, self._params, self.state, self._sources, self._explain,
                                               self.check_grads)  # fmt: skip
        stats = self.last_step_stats = StepStats(self._device(), timed=self.time_phases, **prog.counts)
        local = prog.local_grads(grads) if usable and key == prog.key else None
        with stats.phase("momentum"):
            if local is not None:
                prog.momentum(local, groups)  # into send buffers and local stacks; state untouched
            indicator = grad_checks.report(prog, key, local, self.nonfinite)
        gathers = {0: self._launch(prog.buckets[0].gather)}
        if self.overlap and len(prog.buckets) > 1:
            gathers[1] = self._launch(prog.buckets[1].gather)
        shared = prog.flags is not None  # every rank's findings arrive with the first exchange
        with stats.phase("wait"):
            receive = gathers[0].wait() if shared else None
        verdict = grad_checks.verdict(prog, receive, local, indicator, self.nonfinite, self.check_grads)
        if verdict is not Verdict.GO:
            for handle in gathers.values():
                _wait(handle)
            if verdict is Verdict.EXPLAIN:
                self._explain(shared)
            self.last_step_stats = StepStats(stats.device, timed=stats.timed, skipped=verdict is Verdict.SKIP)
            return verdict
        self._state_written = True
        with stats.phase("momentum"):
            prog.commit(local, groups)
        with stats.phase("adamw"):
            prog.adamw_step(local, groups)
        returns = []
        for k, bucket in enumerate(prog.buckets):
            ahead = k + 1 if self.overlap else k  # with overlap, bucket k+1 travels during NS of k
            if ahead < len(prog.buckets) and ahead not in gathers:
                gathers[ahead] = self._launch(prog.buckets[ahead].gather)
            with stats.phase("wait"):
                _wait(gathers.pop(k))
            with stats.phase("pack"):
                bucket.assemble.run()
            with stats.phase("newton_schulz"):
                for batch in bucket.batches:
                    batch.orthogonalize()
            with stats.phase("pack"):
                bucket.results.run()
            returns.append(self._launch(bucket.scatter))
            if not self.overlap:
                with stats.phase("wait"):
                    _wait(returns.pop())
                with stats.phase("apply"):
                    program.apply(bucket.updates, groups)
        if self.overlap:
            with stats.phase("wait"):
                for handle in returns:
                    _wait(handle)
            with stats.phase("apply"):
                program.apply(prog.all_updates, groups)
        return Verdict.GO

    def _sources(self) -> compiler.Sources:
        device = self._device()
        return compiler.Sources(
            self._indexed, self._names, self.param_groups, self.state, self._mesh, self._exchange_group(),
            self.bucket_bytes, self._ns_dtype(device), self._comm_dtype(device), device, self.check_grads,
        )  # fmt: skip

    def _explain(self, shared: bool) -> None:
        """Raise the error every rank agrees on (a second collective when ``shared``)."""
        group = self._exchange_group().group if shared else None
        grad_checks.explain(self._params, self._names, group, self.nonfinite, compiler.relayouted(self._params, self.state))
        raise ValueError(
            "ranks disagree on the Muon param groups' options ("
            + ", ".join(compiler.STRUCTURAL)
            + "): every rank must pass the same"
        )

    def _launch(self, exchange: program.Exchange | None) -> comm.Handle | None:
        if exchange is None:
            return None
        group = self._exchange_group().group
        return comm.launch(exchange.send, exchange.receive, exchange.send_counts, exchange.receive_counts, group)

    def _group_mesh(self) -> Any:
        """The mesh exchanges and checks run over: the exchange mesh, or without Muon parameters
        the first DTensor's mesh (None: plain tensors, the default group)."""
        if self._muon_meshes:
            return self._mesh
        return next((p.device_mesh for p in self._params if isinstance(p, DTensor)), None)

    def _exchange_group(self) -> comm.ExchangeGroup:
        if self._exchange is None:
            self._exchange = comm.exchange_group(self._group_mesh())
        return self._exchange

    def _device(self) -> torch.device:
        return self._indexed[0][1].device if self._indexed else torch.device("cpu")

    def _ns_dtype(self, device: torch.device) -> torch.dtype:
        return self.ns_dtype or default_ns_dtype(device)

    def _comm_dtype(self, device: torch.device) -> torch.dtype:
        return self.comm_dtype or self._ns_dtype(device)
