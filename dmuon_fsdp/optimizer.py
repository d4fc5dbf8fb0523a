"""DMuonFSDP: Muon for FSDP2-sharded models, with each matrix orthogonalized once, by its owner."""

from __future__ import annotations

import inspect
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.cache import ProgramCache
from dmuon_fsdp._step.flags import StepKey, Verdict
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.run import StepRun, StepStats
from dmuon_fsdp._step.state import check_state_dict, initial_state, restore_state
from dmuon_fsdp._step.swaps import follow, follow_fully_shard
from dmuon_fsdp.backward import BackwardStart, overlap_refusal
from dmuon_fsdp.config import GROUP_OPTIONS, OPTIMIZER_WIDE, Option, Options, Settings, check_lr
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS
from dmuon_fsdp.routing import check_new_groups, refuse_other_names, routing, split_group


class DMuonFSDP(Optimizer):
    """Distributed Muon for FSDP2, HSDP, FSDP + TP and replicated (DDP) parameters, and plain
    tensors in one process; AdamW for the parameters routed to it. Each matrix is
    orthogonalized once in the job, by an owner rank (``plan`` shows which).

    The arguments follow ``torch.optim.Muon``'s, positionally in its order; DMuonFSDP's own
    are keyword-only (below; the README's argument table says the same, with more on each).
    Within a group, parameters with ndim >= 2 use Muon and the others AdamW unless the group sets
    ``use_muon``; a group that mixes both is split in two.
    ``dmuon_fsdp.param_groups(model)`` also sends embeddings and the output head to AdamW.

    The optimizer-wide options are attributes: ``overlap``, ``time_phases``, ``nonfinite`` and
    ``check_grads`` may be set between steps (checked as at construction); ``ns_dtype``,
    ``comm_dtype``, ``bucket_bytes`` and ``overlap_backward`` shape the step program and are
    fixed. After a step, ``last_step_stats`` says what this rank did (``StepStats``).

    ``overlap_backward=True`` makes each bucket's NS inputs and starts its exchange to the owners
    from FSDP2's gradient hooks during backward (``dmuon_fsdp.backward``), with the same results.

    Args:
        params (iterable): parameters, named parameters, or dicts defining param groups (as
            ``param_groups(model)`` returns).
        lr (float, optional): Muon's learning rate, before ``adjust_lr_fn`` (default: 0.02)
        weight_decay (float, optional): decoupled, ``p *= 1 - lr * weight_decay`` with the
            unadjusted lr (default: 0.0)
        momentum (float, optional): ``buf.lerp_(grad, 1 - momentum)`` (default: 0.95)
        nesterov (bool, optional): orthogonalize ``grad.lerp(buf, momentum)`` instead of ``buf``
            (default: True)
        ns_coefficients (tuple or str, optional): one (a, b, c) triple, a list of per-iteration
            triples (later iterations reuse the last), ``"muon"`` or ``"polar_express"``
            (default: (3.4445, -4.775, 2.0315))
        eps (float, optional): NS normalisation, divide by max(Frobenius norm, eps) (default: 1e-07)
        ns_steps (int, optional): Newton-Schulz iterations (default: 5)
        adjust_lr_fn (str, optional): None or ``"original"``, lr * sqrt(max(1, rows / cols));
            ``"match_rms_adamw"``, lr * 0.2 * sqrt(max(rows, cols)); the global shape's (default: None)
        ns_algorithm (str, optional): ``"standard"``; ``"gram"``, the same polynomials iterated
            on the s x s matrix X X^T with restarts; ``"auto"``, per shape the form with fewer
            flops (default: "standard")
        ns_dtype (torch.dtype, optional): NS matmul dtype; None is bf16 on CUDA, fp32 elsewhere
            (default: None)
        comm_dtype (torch.dtype, optional): all-to-all dtype (fp16, bf16, fp32 or fp64); None is
            ``ns_dtype`` (default: None)
        adamw_lr (float, optional): learning rate of the parameters routed to AdamW, as
            ``torch.optim.AdamW``'s; small models often want more (default: 0.001)
        adamw_betas (tuple, optional): their betas (default: (0.9, 0.95))
        adamw_eps (float, optional): their eps (default: 1e-08)
        adamw_weight_decay (float, optional): their decoupled weight decay (default: 0.0)
        bucket_bytes (int, optional): the most bytes one rank holds of its owned matrices, or sends
            or receives in one exchange, per bucket; a larger matrix makes a bucket of its own
            (default: 134217728)
        overlap (bool, optional): launch bucket k+1's exchange before bucket k's NS (default: True)
        time_phases (bool, optional): time each phase into ``last_step_stats`` (syncs the
            device; for benchmarks) (default: False)
        nonfinite (str, optional): inf or NaN in any rank's gradient: ``"raise"``
            (``NonFiniteGradientError`` on every rank), ``"skip"`` (the step, on every rank) or
            ``"ignore"`` (default: "raise")
        check_grads (bool, optional): check each step that every rank steps the same parameters
            with the same Muon options (``GradientMismatchError`` instead of a hang), and that
            every rank built the same plan (default: True)
        overlap_backward (bool, optional): start the first buckets' exchanges to their owners
            from FSDP2's gradient hooks during backward; the same results (default: False)
        flatten (bool, optional): True, a >2-D weight is one ``(dim0, -1)`` matrix; False, a
            stack of ``dim0`` matrices ``(dim1, -1)`` (MoE experts) (default: True)
        split_sizes (list of int, optional): orthogonalize these row blocks of each matrix on
            their own (fused QKV) (default: None)
        num_heads (int, optional): orthogonalize each matrix as ``num_heads`` equal row blocks
            (default: None)
        route (nn.Module, optional): route and name flat groups' parameters as
            ``param_groups(model)`` would; a group's ``use_muon`` still wins (default: None)
        variant (str, optional): ``"muon"``, or ``"normuon"``: each row of the orthogonalized
            update divided by its running second moment (default: "muon")
        normuon_beta2 (float, optional): NorMuon's second-moment decay (default: 0.95)
        normuon_eps (float, optional): added to the second moment's square root (default: 1e-08)
    """

    ns_dtype = Option(settable=False)
    comm_dtype = Option(settable=False)
    bucket_bytes = Option(settable=False)
    overlap_backward = Option(settable=False)
    overlap = Option()
    time_phases = Option()
    nonfinite = Option()
    check_grads = Option()

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = MUON_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        ns_algorithm: str = "standard",
        ns_dtype: torch.dtype | None = None,
        comm_dtype: torch.dtype | None = None,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        bucket_bytes: int = 128 * 2**20,
        overlap: bool = True,
        time_phases: bool = False,
        nonfinite: str = "raise",
        check_grads: bool = True,
        overlap_backward: bool = False,
        flatten: bool = True,
        split_sizes: list[int] | None = None,
        num_heads: int | None = None,
        route: nn.Module | None = None,
        variant: str = "muon",
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        **other: Any,
    ):
        arguments = dict(locals())  # (first: nothing else is a local yet)
        # Other optimizers' names (AdamW's betas, fused, ...) get the name to use, not a bare TypeError.
        refuse_other_names(other, list(inspect.signature(DMuonFSDP.__init__).parameters))
        check_lr(lr)  # before torch looks at params, as torch's own optimizers do
        self._options = Options(**{name: arguments[name] for name in OPTIMIZER_WIDE})
        self.last_step_stats: StepStats | None = None
        self._names: dict[Tensor, str] = {}
        self._muon_meshes: dict[Any, str] = {}  # each Muon parameter's mesh -> one parameter's name
        self._indexed: list[tuple[int, Tensor]] = []  # (group index, parameter), optimizer order
        self._params: list[Tensor] = []  # the same parameters alone
        self._state_written = False  # a step or a load has written state (else swaps make it anew)
        self._start_runtime()
        self._route = routing(route) if route is not None else None
        defaults = {name: arguments[name] for name in GROUP_OPTIONS}
        super().__init__(params, defaults)
        self._route = None  # holding the model's tensors would keep them alive after a swap

    @property
    def plan(self) -> Plan | None:
        """The plan in use: owners, buckets and every rank's piece of every matrix (None before
        the first step)."""
        return self._programs.plan

    @property
    def exchange_ranks(self) -> tuple[int, ...]:
        """The global ranks Muon matrices move between, in plan order (plan rank i is global rank
        ``exchange_ranks[i]``): every rank linked by the meshes the Muon parameters live on
        (several views of one job's ranks may mix, as torchtitan's dense and expert meshes),
        or every rank of the job for plain tensors."""
        return self._settings.site.ranks

    @property
    def exchange_rank(self) -> int:
        """This rank's index in ``plan`` (its place among ``exchange_ranks``); local, no collective."""
        return self._settings.site.rank

    def param_name(self, param: Tensor) -> str:
        """The name errors give ``param``: its qualified name when one was given (named groups,
        ``param_groups``, ``route``), else its position and shape."""
        if param not in self._names:
            raise KeyError(f"a tensor of shape {tuple(param.shape)} is not a parameter of this optimizer")
        return self._names[param]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, routing its parameters to Muon or AdamW (see the class docstring).

        Everything is validated, and torch's own checks run, before anything is registered, so a
        rejected group leaves the optimizer as it was."""
        new_groups, names = split_group(
            param_group, len(self._indexed), self._names, self.defaults, self._route, len(self.param_groups)
        )
        meshes = check_new_groups(new_groups, names, self.defaults, self._muon_meshes, len(self.param_groups))
        count = len(self.param_groups)
        try:  # torch's checks (e.g. names on every group or none) come last: undo on failure
            for new in new_groups:
                super().add_param_group(new)
        except Exception:
            del self.param_groups[count:]
            raise
        self._names.update(names)
        for g in range(count, len(self.param_groups)):
            for p in self.param_groups[g]["params"]:
                self._indexed.append((g, p))
                self._params.append(p)
                self.state[p].update(initial_state(p, self.param_groups[g]))
        self._set_meshes(meshes)

    def _start_runtime(self) -> None:
        """What is made anew rather than kept by a copy: the programs, the hooks, what was said."""
        self._programs, self._backward, self._route = ProgramCache(), BackwardStart(), None
        self._warned_no_grads = False  # a step without any gradient warns once
        self._no_overlap_reason: str | None = None  # why steps do not begin in backward (said once)

    def _set_meshes(self, meshes: dict[Any, str]) -> None:
        """The parameters or their meshes changed: a new exchange site and a new program."""
        self._muon_meshes = meshes
        self._programs.clear()
        self._backward.disarm()
        wanted = self._options.overlap_backward
        self._no_overlap_reason = overlap_refusal(self.param_groups, self._names) if wanted else None
        self._configure(comm.exchange_site(meshes, self._params), wanted and not self._no_overlap_reason)

    def _set_options(self, options: Options) -> None:
        """A settable option changed (``config.Option``)."""
        self._options = options
        self._configure(self._settings.site, self._settings.in_backward)

    def _configure(self, site: comm.ExchangeSite, in_backward: bool) -> None:
        """The settings steps run with: the options resolved for the parameters' device."""
        device = self._params[0].device if self._params else torch.device("cpu")
        self._settings = Settings.resolve(self._options, site, device, in_backward)

    def _follow_swaps(self) -> None:
        """Follow tensors a framework replaced in ``param_groups`` (see ``dmuon_fsdp._step.swaps``);
        asked before every step, so the common answer (none was) costs one pass of identity checks."""
        known, groups = iter(self._params), self.param_groups
        if sum(len(g["params"]) for g in groups) == len(self._params) and all(
            p is next(known) for g in groups for p in g["params"]
        ):
            return
        followed = follow(groups, self._indexed, self._names, self.state, self._state_written)
        self._indexed, self._names = followed.indexed, followed.names
        self._params = [p for _, p in followed.indexed]
        self._set_meshes(followed.meshes)

    def __getstate__(self) -> dict[str, Any]:
        """Torch's (defaults, state, param groups) and DMuonFSDP's options, names and order:
        ``copy.deepcopy`` and pickling (``torch.save(opt)``) give an optimizer that steps as this
        one would. The step program, the meshes and the process group are made anew."""
        own = ("_options", "_names", "_indexed", "_state_written", "last_step_stats")
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in own}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = "_programs" not in self.__dict__  # unpickled (torch's load_state_dict calls this too)
        super().__setstate__(state)
        if fresh:
            self._params = [p for _, p in self._indexed]
            self._start_runtime()
            self._set_meshes(check_new_groups(self.param_groups, self._names, {}, {}))

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict (after following any parameters replaced in ``param_groups``)."""
        self._follow_swaps()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (this optimizer's, or ``torch.optim.Muon``'s over the same matrices)
        after checking it matches parameter by parameter. Load pre-hooks run first, on the
        caller's dict, as torch documents. A parameter the dict holds no state for (never
        stepped, or frozen: torch's state-dict helpers leave those out) starts afresh."""
        self._follow_swaps()
        state_dict = state_dict.copy()  # shallow, as torch's: a hook may rewrite the dict it is given
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        check_state_dict(state_dict, self.param_groups, self._names)
        # Options added since the state dict was saved (ns_algorithm) keep this optimizer's values.
        groups = [
            {**group, **saved}
            for saved, group in zip(state_dict["param_groups"], self.param_groups, strict=True)
        ]
        hooks, self._optimizer_load_state_dict_pre_hooks = (
            self._optimizer_load_state_dict_pre_hooks,
            OrderedDict(),
        )
        try:  # torch's load would run the pre-hooks again, after the checks above
            super().load_state_dict({**state_dict, "param_groups": groups})
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        restore_state(self.param_groups, self.state)
        for p in self._params:
            state = self.state[p]
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
        self._programs.state_replaced()
        self._state_written = True

    @torch.compiler.disable(recursive=True)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Momentum and AdamW on local shards, Newton-Schulz by owners, then the update. Runs
        eagerly under ``torch.compile`` (it is excluded from tracing: its collectives, host read
        and buffers are fixed per program, nothing a graph would gain)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_swaps()
        self._run()
        self._say_once()
        return loss

    def _run(self, rebuilt: bool = False) -> None:
        """One step with the program for this step's key (see ``dmuon_fsdp._step.run``), then what
        its verdict, the same on every rank, asks for."""
        if self._params and self._params[0].device != self._settings.device:  # moved (model.to, to_empty)
            self._configure(self._settings.site, self._settings.in_backward)
        groups, options, settings = self.param_groups, self._options, self._settings
        grads = [p.grad for p in self._params]
        checked = options.check_grads or options.nonfinite != "ignore"
        key = StepKey.of(groups, grads, checked, settings.structural)
        if not all(key.has_grad) and follow_fully_shard(groups, self._names):  # (they get no gradient)
            self._follow_swaps()
            return self._run(rebuilt)
        ready = self._programs.get(key, self._params, groups, self.state, self._names, settings)
        if ready.program is None:  # every rank found trouble while planning
            self._programs.raise_alike(groups, self.state, self._names, settings, shared=ready.shared)
        program = ready.program
        local = program.local_grads(grads) if ready.bound and key == program.key else None
        if settings.in_backward:
            verdict, stats = self._backward.run(program, local, groups, key, options)
        else:
            run = StepRun.of(program, options)
            verdict, stats = run.run(local, groups, key, options, ready.agreement), run.stats
        if verdict is Verdict.REDO:  # gradients changed after backward read them: from the final ones
            run = StepRun.of(program, options)
            verdict, stats = run.run(local, groups, key, options), run.stats
            stats.redone = True
        stats.skipped = verdict is Verdict.SKIP
        stats.buffer_bytes = self._programs.buffer_bytes
        stats.settle_times()
        self.last_step_stats = stats
        if verdict is Verdict.RAISE:
            self._programs.raise_alike(
                groups, self.state, self._names, settings, shared=program.flags is not None
            )
        if verdict is Verdict.REBUILD:  # every rank's gradients or options changed alike
            if not rebuilt:
                self._programs.follow()
                self._run(rebuilt=True)
            return None
        self._state_written |= verdict is Verdict.GO
        if settings.in_backward:
            if self._programs.repeated:  # the next backward starts this program's buckets
                self._backward.arm(program, groups, options)
            else:  # gradient sets that change: steps run after backward, nothing started in vain
                self._backward.disarm()
        return None

    def _say_once(self) -> None:
        """After a step: why steps do not begin in backward, and a step without any gradient."""
        if self._no_overlap_reason is not None:
            warnings.warn(self._no_overlap_reason, stacklevel=3)
            self._no_overlap_reason = None
        if self._params and all(p.grad is None for p in self._params) and not self._warned_no_grads:
            self._warned_no_grads = True
            warnings.warn(
                "DMuonFSDP.step(): no parameter has a gradient, so nothing is updated (said once): was "
                "backward run, and are these the model's parameters? (a model whose parameters were "
                "replaced after the optimizer was built, as by fully_shard or to_empty, trains nothing)",
                stacklevel=3,
            )
