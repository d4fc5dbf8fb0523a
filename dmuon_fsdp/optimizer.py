"""DMuonFSDP: Muon for FSDP2-sharded models, with each matrix orthogonalized once, by its owner."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim import optimizer as optimizer_module

from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.run import StepStats
from dmuon_fsdp._step.runtime import Runtime
from dmuon_fsdp._step.state import MAIN, check_state_dict, initial_state, restore_loaded, restore_state
from dmuon_fsdp._step.swaps import follow, follow_fully_shard
from dmuon_fsdp.config import GROUP_OPTIONS, OPTIMIZER_WIDE, Option, Options, check_lr
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS
from dmuon_fsdp.routing import Routing, check_new_groups, refuse_other_names, split_group


class DMuonFSDP(Optimizer):
    """Distributed Muon for FSDP2, HSDP, FSDP + TP and replicated (DDP) parameters, and plain
    tensors in one process; AdamW for the parameters routed to it. Each matrix is
    orthogonalized once in the job, by an owner rank (``plan`` shows which).

    The arguments follow ``torch.optim.Muon``'s, positionally in its order; DMuonFSDP's own are
    keyword-only (the README's argument table says more on each). Within a group, parameters
    with ndim >= 2 use Muon and the others AdamW unless the group sets ``use_muon``; a group
    that mixes both is split in two. ``dmuon_fsdp.param_groups(model)`` also sends embeddings
    and the output head to AdamW. The optimizer-wide options are attributes (``overlap``,
    ``time_phases``, ``nonfinite`` and ``check_grads`` settable between steps). After a step,
    ``last_step_stats`` says what this rank did (``StepStats``).

    Args:
        params (iterable): parameters, named parameters, or dicts defining param groups
        lr (float, optional): Muon's learning rate, before ``adjust_lr_fn`` (default: 0.02)
        weight_decay (float, optional): decoupled, ``p *= 1 - lr * weight_decay`` (default: 0.0)
        momentum (float, optional): ``buf.lerp_(grad, 1 - momentum)`` (default: 0.95)
        nesterov (bool, optional): orthogonalize ``grad.lerp(buf, momentum)`` (default: True)
        ns_coefficients (tuple or str, optional): an (a, b, c) triple, a list of per-iteration
            triples, ``"muon"`` or ``"polar_express"`` (default: (3.4445, -4.775, 2.0315))
        eps (float, optional): NS normalisation, divide by max(Frobenius norm, eps) (default: 1e-07)
        ns_steps (int, optional): Newton-Schulz iterations (default: 5)
        adjust_lr_fn (str, optional): None or ``"original"``, lr * sqrt(max(1, rows / cols));
            ``"match_rms_adamw"``, lr * 0.2 * sqrt(max(rows, cols)) (default: None)
        ns_algorithm (str, optional): ``"standard"``; ``"gram"`` (iterated on X X^T, with
            restarts); ``"auto"``, per shape the form with fewer flops (default: "standard")
        ns_dtype (torch.dtype, optional): NS matmul dtype; None: bf16 on CUDA, fp32 elsewhere (default: None)
        comm_dtype (torch.dtype, optional): all-to-all dtype; None is ``ns_dtype`` (default: None)
        adamw_lr (float, optional): learning rate of the parameters routed to AdamW (default: 0.001)
        adamw_betas (tuple, optional): their betas (default: (0.9, 0.95))
        adamw_eps (float, optional): their eps (default: 1e-08)
        adamw_weight_decay (float, optional): their decoupled weight decay (default: 0.0)
        bucket_bytes (int, optional): the most bytes one rank holds of its owned matrices, or sends
            or receives in one exchange, per bucket (default: 134217728)
        ns_flops_per_byte (float, optional): NS flops a rank runs while its link moves a byte; the
            planner shapes buckets into a pipeline by it (0: by ``bucket_bytes`` alone) (default: 10000.0)
        overlap (bool, optional): launch bucket k+1's exchange before bucket k's NS (default: True)
        time_phases (bool, optional): time each phase into ``last_step_stats`` (default: False)
        nonfinite (str, optional): inf or NaN in any rank's gradient: ``"raise"``
            (``NonFiniteGradientError``), ``"skip"`` the step, or ``"ignore"`` (default: "raise")
        check_grads (bool, optional): check each step that every rank steps the same parameters
            with the same options (``GradientMismatchError`` instead of a hang) (default: True)
        overlap_backward (bool, optional): start the first bucket in FSDP2's gradient hooks (default: False)
        overlap_forward (bool, optional): leave the relays across replicas (HSDP, DDP) to the next
            forward, each finished before the module using its parameters runs; read parameters
            otherwise only after ``finish_step()`` (default: False)
        flatten (bool, optional): a >2-D weight is one matrix; False: ``dim0`` matrices (default: True)
        split_sizes (list of int, optional): orthogonalize these row blocks on their own (default: None)
        num_heads (int, optional): orthogonalize ``num_heads`` equal row blocks apart (default: None)
        route (nn.Module or Routing, optional): route and name flat groups as ``param_groups(model)``,
            or as a ``dmuon_fsdp.Routing(model, head=..., stacked=..., adamw=...)`` (default: None)
        variant (str, optional): ``"muon"``, or ``"normuon"`` (rows normalized) (default: "muon")
        normuon_beta2 (float, optional): NorMuon's second-moment decay (default: 0.95)
        normuon_eps (float, optional): added to the second moment's square root (default: 1e-08)
        main_weights (bool, optional): parameters stored in bfloat16 or float16 keep a float32
            main copy in the optimizer state (``main_weight``, with float32 moments), which the
            step updates and rounds into the parameter, so that updates below the 16-bit spacing
            accumulate; False: step such parameters in their own dtype, as torch's optimizers do
            (default: True)
    """

    ns_dtype = Option(settable=False)
    comm_dtype = Option(settable=False)
    bucket_bytes = Option(settable=False)
    ns_flops_per_byte = Option(settable=False)
    overlap_backward = Option(settable=False)
    overlap_forward = Option(settable=False)
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
        ns_flops_per_byte: float = 1e4,
        overlap: bool = True,
        time_phases: bool = False,
        nonfinite: str = "raise",
        check_grads: bool = True,
        overlap_backward: bool = False,
        overlap_forward: bool = False,
        flatten: bool = True,
        split_sizes: list[int] | None = None,
        num_heads: int | None = None,
        route: nn.Module | Routing | None = None,
        variant: str = "muon",
        normuon_beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        main_weights: bool = True,
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
        if route is not None and not isinstance(route, nn.Module | Routing):
            raise TypeError(f"route= takes a model or a dmuon_fsdp.Routing; got {type(route).__name__}")
        routes = route if isinstance(route, Routing) or route is None else Routing(route)
        self._runtime, self._route = Runtime(), routes.routes if routes is not None else None
        super().__init__(params, {name: arguments[name] for name in GROUP_OPTIONS})
        self._route = None  # holding the model's tensors would keep them alive after a swap

    @property
    def plan(self) -> Plan | None:
        """The plan in use: owners, buckets, every rank's piece of each matrix (None before a step)."""
        return self._runtime.programs.plan

    @property
    def exchange_ranks(self) -> tuple[int, ...]:
        """The global ranks Muon matrices move between, in plan order (plan rank i is global rank
        ``exchange_ranks[i]``): those the Muon parameters' meshes link (every rank for plain tensors)."""
        return self._runtime.ready().site.ranks

    @property
    def exchange_rank(self) -> int:
        """This rank's index in ``plan`` (its place among ``exchange_ranks``); local, no collective."""
        return self._runtime.ready().site.rank

    def param_name(self, param: Tensor) -> str:
        """The name errors give ``param``: its qualified name when given, else its position and shape."""
        if param not in self._names:
            raise KeyError(f"a tensor of shape {tuple(param.shape)} is not a parameter of this optimizer")
        return self._names[param]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, routing its parameters to Muon or AdamW (see the class docstring); a
        rejected group (by our checks or torch's) leaves the optimizer as it was."""
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
                # (no main weight yet: ``_set_meshes`` makes it where it is held)
                self.state[p].update(initial_state(p, self.param_groups[g], main=False))
        self._set_meshes(meshes)

    def _set_meshes(self, meshes: dict[Any, str]) -> None:  # the parameters or their meshes changed
        self._muon_meshes = meshes
        self._runtime.set_meshes(meshes, self._params, self.param_groups, self._names, self._options)
        settings = self._runtime.ready()  # main weights to the ranks that now hold them
        restore_state(self.param_groups, self.state, settings.homes, settings.site.rank)

    def _keep_main_weights_on_every_holder(self, params: Sequence[Tensor]) -> None:
        """Every rank holding one of ``params`` keeps its main weight, not its owner alone
        (``QKClip`` scales them on every holder; [Note: main weights]); one whose owner held it
        starts again from the parameter, alike on every rank."""
        homes = self._runtime.ready().homes
        moved = [p for p in params if p in homes]
        self._runtime.everywhere.update(params)
        for p in moved:
            self.state[p].pop(MAIN, None)
        if moved:
            self._set_meshes(self._muon_meshes)

    def _set_options(self, options: Options) -> None:  # a settable option changed (``config.Option``)
        self._options = options
        self._runtime.set_options(options)

    def _follow_swaps(self) -> None:
        """Follow tensors a framework replaced in ``param_groups`` (``_step.swaps``): one identity pass."""
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
        """Torch's (defaults, state, param groups) and DMuonFSDP's options, names and order: a copy
        or unpickled one steps as this one would; its runtime (programs, groups, hooks) is made anew."""
        own = ("_options", "_names", "_indexed", "_state_written", "last_step_stats")
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in own}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fresh = "_runtime" not in self.__dict__  # unpickled (torch's load_state_dict calls this too)
        super().__setstate__(state)
        if fresh:
            self._params, self._runtime = [p for _, p in self._indexed], Runtime()
            self._set_meshes(check_new_groups(self.param_groups, self._names, {}, {}))

    def finish_step(self) -> None:
        """Complete the updates the last step left in flight (``overlap_forward``: the relays
        across replicas, else nothing). The next forward, a module's ``state_dict()``, this
        optimizer's ``state_dict()``, ``load_state_dict()`` and ``step()`` call it; call it before
        reading the parameters any other way (an EMA, norms to log, ``full_tensor()``)."""
        self._runtime.forward.finish()

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict (after following any parameters replaced in ``param_groups``, and
        ``finish_step()``)."""
        self.finish_step()
        self._follow_swaps()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (this optimizer's, or ``torch.optim.Muon``'s over the same matrices)
        after checking it matches parameter by parameter. Load pre-hooks run first, on the
        caller's dict, as torch documents. A parameter the dict holds no state for (never
        stepped, or frozen: torch's state-dict helpers leave those out) starts afresh."""
        self.finish_step()
        self._follow_swaps()
        state_dict = state_dict.copy()  # shallow, as torch's: a hook may rewrite the dict it is given
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        check_state_dict(state_dict, self.param_groups, self._names)
        # Options added since the state dict was saved (ns_algorithm) keep this optimizer's values.
        pairs = zip(state_dict["param_groups"], self.param_groups, strict=True)
        groups = [{**group, **saved} for saved, group in pairs]
        hooks = self._optimizer_load_state_dict_pre_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        try:  # torch's load would run the pre-hooks again, after the checks above
            super().load_state_dict({**state_dict, "param_groups": groups})
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
        saved = {  # each parameter's entries as given (torch casts them to the parameter's dtype)
            p: state_dict["state"].get(key, {})
            for old, group in zip(state_dict["param_groups"], self.param_groups, strict=True)
            for key, p in zip(old["params"], group["params"], strict=True)
        }
        settings = self._runtime.ready()
        restore_loaded(self.param_groups, self.state, saved, settings.homes, settings.site.rank)
        self._runtime.programs.state_replaced()
        self._state_written = True

    @torch.compiler.disable(recursive=True)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Momentum and AdamW on local shards, Newton-Schulz by owners, then the update
        (``dmuon_fsdp._step.runtime``). Runs eagerly under ``torch.compile`` (it is excluded
        from tracing: its collectives, host read and buffers are fixed per program)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._follow_swaps()
        if any(p.grad is None for p in self._params) and follow_fully_shard(self.param_groups, self._names):
            self._follow_swaps()  # (sharded by fully_shard after this optimizer was built)
        ran = self._runtime.step(self._params, self.param_groups, self.state, self._names, self._options)
        if self._optimizer_step_post_hooks or optimizer_module._global_optimizer_post_hooks:
            self._runtime.forward.before_post_hooks()  # (torch runs them when this returns)
        self.last_step_stats = ran.stats
        self._state_written |= ran.committed
        self._runtime.say_once(self._params)
        return loss
