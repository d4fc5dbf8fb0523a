"""Steps finished in the next forward (``DMuonFSDP(..., overlap_forward=True)``): the relays across
replicas a step leaves in flight, each *landed* (waited for and applied) where a rank first
needs its rows.

Under HSDP across nodes each rank receives, by relay from its twins in the other replicas, about
(R - 1) / R of every piece it holds ([Note: the relay] in ``dmuon_fsdp._step.relay``): most of
the step's traffic over the slow links between nodes, which the next forward leaves idle (its
all-gathers stay inside each replica). With ``overlap_forward`` the planner cuts the relays in
parameter order, and ``step()`` runs everything else as a plain step does, launches every relay
and returns.

[Note: finished in forward] Every rank launches every relay at the same point, the end of
``step()``, in one order, on the side group (``comm.side_group``), each with buffers of its own
([Note: slots] in ``dmuon_fsdp._step.buffers``). Whatever a rank does next is its own: it waits
for a relay wherever it needs it, alone, and no other rank has anything to do for it then (a
save on one replica, ``finish_step()`` on one rank, a forward some ranks skip). A relay lands
the first time one of these needs its rows on this rank:

- FSDP2's all-gather of a unit holding its parameters: ``FSDPParamGroup.unshard`` is wrapped,
  which a forward, an explicit ``unshard()``, prefetching, pipelining schedules, grouped units
  (``fully_shard([norm, output])``) and ``register_fsdp_forward_method`` all go through; the
  units are found in FSDP2's registry of its modules whenever the parameters change, before
  any forward, and the wrapper runs inside FSDP2's own hook, outside any compiled graph;
- the forward of any other module that uses its parameters (DDP, plain or tensor-parallel
  ones): the deepest module seen running eagerly in the forwards after the parameters changed
  that holds the parameter (so ``nn.MultiheadAttention`` for its ``out_proj``, whose own
  forward never runs, a module for its ``nn.ParameterList``), or a module compiled on its own
  (``module.compile()``, the module ``torch.compile`` wraps), whose own hooks run eagerly while
  its inside is traced; modules are looked for in the first forward after the parameters change
  (a hook on every module's forward, removed at the next step);
- ``state_dict()`` or ``load_state_dict()`` of a module holding its parameters
  (``model.state_dict()``, DCP's helpers and saves see the step whole; a load overwrites it);
- the optimizer's ``state_dict()``, ``load_state_dict()``, next ``step()``, the step's
  post-hooks (``register_step_post_hook``: they see the step whole), and ``finish_step()``,
  which anything else reading the parameters between a step and the next forward must call
  first (an EMA, logged norms, ``full_tensor()``).

What is written into a parameter after the step and before its relay lands (a ``copy_``, an EMA
swapped in; a module's ``load_state_dict`` lands every relay first) is kept: its version
counters (the parameter's and its local shard's) tell, and the relay's rows for it are dropped,
not added (said once; writes through ``.data`` bypass the counters). A relay holding a
parameter no module was found for lands at the end of ``step()``, and a forward that read a
parameter before its relay landed (its gradient changed while the relay was in flight) is said,
and the modules are found anew: each said once, naming the parameters.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dmuon_fsdp._step.state import MainWeights, local_shard

if TYPE_CHECKING:
    from dmuon_fsdp._step.program import StepProgram
    from dmuon_fsdp._step.run import StepRun


@dataclass(frozen=True)
class Claim:
    """The module found to use a parameter (not in an FSDP2 unit): its relays land before that
    module's forward. ``size``: the parameters the module holds, itself and below (the deepest
    module holding a parameter holds the fewest)."""

    param: weakref.ref[Tensor]
    module: weakref.ref[nn.Module]
    size: int


@dataclass(frozen=True)
class Targets:
    """What a program's relays write on this rank, found once per program: each entry's parameter
    and local shard (a write through a DTensor moves only the parameter's version counter, a write
    to the local tensor, ours included, only the shard's) and, for the entries whose shards share
    a storage with others, those others (a write to one moves their counters too)."""

    tensors: dict[int, tuple[Tensor, Tensor]]
    sharing: dict[int, tuple[int, ...]]

    @classmethod
    def of(cls, program: StepProgram) -> Targets:
        entries = sorted({e for relay in program.relays for e in relay.entries})
        tensors = {e: (program.entries[e].param, local_shard(program.entries[e].param)) for e in entries}
        by_storage: dict[int, list[int]] = {}
        for e, (_, local) in tensors.items():
            by_storage.setdefault(local.untyped_storage().data_ptr(), []).append(e)
        sharing = {e: tuple(group) for group in by_storage.values() if len(group) > 1 for e in group}
        return cls(tensors, sharing)

    def versions(self, e: int) -> tuple[int, int]:
        param, local = self.tensors[e]
        return param._version, local._version


class ForwardFinish:
    """The relays a step left in flight (``defer``), where each lands, and the hooks that land them."""

    def __init__(self, mains: MainWeights) -> None:
        self.run: StepRun | None = None  # the step whose relays are in flight
        self._mains = mains  # (a landing writes parameters with main weights)
        self._program: StepProgram | None = None
        self._pending: set[int] = set()  # its relays not landed
        self._targets: Targets | None = None
        self._targets_of: weakref.ref[StepProgram] | None = None  # the program they are of
        self._versions: dict[int, tuple[int, int]] = {}  # entry -> version counters after our last write
        self._written: set[int] = set()  # entries written by someone else since the step
        self._grads: dict[int, tuple[Any, int]] = {}  # entry -> its gradient (weakly) and version then
        self._names: Callable[[Tensor], str] = str
        # The Muon parameters, by id (a WeakSet would compare tensors by value)
        self._params: dict[int, weakref.ref[Tensor]] = {}
        self._in_units: set[int] = set()  # those an FSDP2 unit all-gathers
        self._claims: dict[int, Claim] = {}  # the others: the module found for each
        self._uses: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules seen running eagerly
        self._units: weakref.WeakSet[Any] = weakref.WeakSet()  # FSDP2 param groups wrapped
        self._stated: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules with state-dict hooks
        self._hooks: list[Any] = []
        self._finder: Any = None
        self._fresh = False  # the finder was armed since the last step: no forward could find anything yet
        self._said: set[str] = set()
        weakref.finalize(self, _remove, self._hooks)

    # Where relays land: found

    def watch(self, params: list[Tensor]) -> None:
        """The Muon parameters are ``params`` (new, or replaced): find the FSDP2 units that
        all-gather them now, and the modules that use the others in the forwards to come."""
        self._params = {id(p): weakref.ref(p) for p in params}
        self._claims = {i: c for i, c in self._claims.items() if self._params.get(i, _dead)() is c.param()}
        self._in_units = self._wrap_units()
        if self._unfound():
            self._seen = weakref.WeakSet()  # every module is looked at anew
            self._arm()

    def _unfound(self) -> list[Tensor]:
        """The Muon parameters in no FSDP2 unit and claimed by no module."""
        out = []
        for i, ref in self._params.items():
            p = ref()
            if p is not None and i not in self._in_units and i not in self._claims:
                out.append(p)
        return out

    def _wrap_units(self) -> set[int]:
        """Wrap the ``unshard`` of every FSDP2 unit holding Muon parameters (once per unit), hook
        the state dicts of the modules holding them; returns those parameters' ids."""
        found: set[int] = set()
        me = weakref.ref(self)
        for unit in _fsdp_units():
            mine = [fp for fp in unit.fsdp_params if id(fp.sharded_param) in self._params]
            if not mine:
                continue
            found.update(id(fp.sharded_param) for fp in mine)
            if unit not in self._units:
                self._units.add(unit)
                _wrap_unshard(unit, me)
            for fp in mine:
                self._hook_state_dicts(fp._module_info.module)
        return found

    def _arm(self) -> None:
        self._fresh = True
        if self._finder is None:
            self._finder = nn.modules.module.register_module_forward_pre_hook(_traced_away(weakref.ref(self)))
            self._hooks.append(self._finder)

    def _disarm(self) -> None:
        if self._finder is not None:
            self._finder.remove()
            self._finder = None

    def find(self, module: nn.Module) -> None:
        """``module``'s forward runs eagerly (the finder's hook): claim for it the parameters it
        holds, itself and below, that no deeper module claimed, and for each module below it
        compiled on its own, those that one holds; finish what they need now."""
        if module in self._seen:
            return
        self._seen.add(module)
        claimed = self._claim(module, _outside_traces)
        for top in _compiled_tops(module):
            claimed |= self._claim(top, _eager)
        if claimed and self.run is not None:
            self._land(self._relays(claimed))

    def _claim(self, module: nn.Module, hook: Callable[[weakref.ref], Callable[..., None]]) -> set[int]:
        """Claim for ``module`` the wanted parameters it holds (those a deeper module claimed
        stay with it), hooking it with ``hook`` and the state dicts of their holders; returns the
        ids claimed."""
        held = [(holder, p) for holder in module.modules() for p in holder.parameters(recurse=False)]
        size = len(held)
        claimed: set[int] = set()
        for holder, p in held:
            i = id(p)
            if self._params.get(i, _dead)() is not p or i in self._in_units:
                continue
            self._hook_state_dicts(holder)
            current = self._claims.get(i)
            owner = current.module() if current is not None else None
            if owner is not None and current is not None and current.size < size:
                continue  # (a deeper module claimed it)
            if owner is not None:
                self._uses.get(owner, set()).discard(i)
            self._claims[i] = Claim(weakref.ref(p), weakref.ref(module), size)
            claimed.add(i)
        if claimed:
            if module not in self._uses:
                self._uses[module] = set()
                self._hooks.append(module.register_forward_pre_hook(hook(weakref.ref(self)), prepend=True))
            self._uses[module] |= claimed
        return claimed

    def _hook_state_dicts(self, module: nn.Module) -> None:
        """Land every relay before ``module``'s state dict is read or loaded (once per module)."""
        if module in self._stated:
            return
        self._stated.add(module)
        me = weakref.ref(self)
        self._hooks.append(module.register_state_dict_pre_hook(lambda *_: _call(me, "finish")))
        self._hooks.append(module.register_load_state_dict_pre_hook(lambda *_: _call(me, "finish")))

    # What is in flight

    def defer(self, run: StepRun, program: StepProgram, names: Callable[[Tensor], str]) -> None:
        """``run`` launched its relays (``StepRun.end_relays``): note what each writes, land
        now those of parameters no module was found for (said once), and stop looking for
        modules once a forward was seen."""
        self.finish()
        self.run, self._program, self._names = run, program, names
        self._pending = {relay.index for relay in program.relays}
        self._written.clear()
        if self._targets_of is None or self._targets_of() is not program:
            self._targets, self._targets_of = Targets.of(program), weakref.ref(program)
        targets = self._targets
        assert targets is not None  # (made above)
        self._versions = {e: targets.versions(e) for e in targets.tensors}
        if self._finder is not None and len(self._seen):  # a forward ran since the parameters changed
            self._disarm()
        unfound = {id(p) for p in self._unfound()}
        orphans = [p for p in program.relays_of if id(p) in unfound]
        fresh, self._fresh = self._fresh, False
        if orphans and not fresh:  # (a step right after the finder was armed had no forward to find them)
            self._say(
                "orphans",
                f"{self._list(orphans)}: no module whose forward uses them was seen running eagerly since "
                "they became the optimizer's (a step before any forward, or a model compiled whole with "
                "model.compile(), whose own hooks are traced), so their relays land at the end of step() "
                "(the overlap is kept for the others)",
            )
        if orphans:
            self._land(self._relays(id(p) for p in orphans))
        self._grads = {}
        for relay in program.relays:  # a forward reading these before their relay lands is seen at step()
            for e in relay.entries:
                param = program.entries[e].param
                if id(param) not in self._in_units:  # (FSDP2 gathers a unit only through the wrapper)
                    grad = param.grad
                    self._grads[e] = (weakref.ref(grad) if grad is not None else None, _version(grad))
        self._done()

    def settle(self) -> None:
        """Before a step: say if the forward since the last one read a parameter before its
        relay landed (its gradient changed while the relay was in flight: found anew), then land
        every relay left."""
        program = self._program
        if self.run is not None and program is not None:
            read = []
            for g in sorted(self._pending):
                for e in program.relays[g].entries:
                    if e not in self._grads:
                        continue
                    param = program.entries[e].param
                    ref, version = self._grads[e]
                    before = ref() if ref is not None else None
                    grad = param.grad
                    if grad is not None and (grad is not before or _version(grad) != version):
                        read.append(param)
            if read:
                self._say(
                    "stale",
                    f"{self._list(read)}: read by the forward since the last step before their relays "
                    "landed (their modules ran where their hooks could not: compiled after they were found, "
                    "or another module read them first), so that step differs from the plain one; their "
                    "modules are found anew in the next forward",
                )
                for p in read:
                    self._claims.pop(id(p), None)
                self._seen = weakref.WeakSet()
                self._arm()
        self.finish()

    # Where relays land: the hooks

    def before(self, module: nn.Module) -> None:
        """A module's forward is about to run: land the relays of the parameters claimed for it."""
        if self.run is not None:
            self._land(self._relays(self._uses.get(module, ())))

    def before_unshard(self, unit: Any, async_op: bool) -> None:
        """FSDP2 is about to all-gather ``unit``: land the relays of its parameters, and on an
        accelerator order its all-gather streams after them."""
        if self.run is None:
            return
        relays = self._relays(id(fp.sharded_param) for fp in unit.fsdp_params)
        if relays:
            self._land(relays)
            _order_all_gathers(unit, async_op)

    def before_post_hooks(self) -> None:
        """The step's post-hooks are about to run: they see the step whole (said once)."""
        if self.run is not None:
            self._say(
                "post-hooks",
                "a step post-hook is registered (register_step_post_hook), so step() lands every relay "
                "before it runs, for it to see the step whole, and leaves nothing to the next forward",
            )
            self.finish()

    @torch.no_grad()
    def finish(self) -> None:
        """Land every relay left in flight."""
        if self.run is not None:
            self._land(sorted(self._pending))
        self.run, self._program = None, None

    def _relays(self, ids: Iterable[int]) -> set[int]:
        """The relays in flight bringing this rank rows of the parameters ``ids``."""
        program = self._program
        if program is None:
            return set()
        out: set[int] = set()
        for i in ids:
            p = self._params.get(i, _dead)()
            if p is not None:
                out.update(program.relays_of.get(p, ()))
        return out & self._pending

    @torch.no_grad()
    def _land(self, relays: Iterable[int]) -> None:
        """Land ``relays`` in order: what was written since the step keeps its value."""
        run, program, targets = self.run, self._program, self._targets
        if run is None or program is None or targets is None:
            return
        for g in sorted(set(relays) & self._pending):
            entries = program.relays[g].entries
            for e in entries:
                if e not in self._written and targets.versions(e) != self._versions[e]:
                    self._written.add(e)
            dropped = frozenset(self._written.intersection(entries))
            if dropped:
                self._say(
                    "written",
                    f"{self._list(program.entries[e].param for e in dropped)}: written after step() and "
                    "before the rows their twins relay landed (a load_state_dict, copy_, an EMA swapped in), "
                    "so those rows are dropped and what was written stays; anything that read them in "
                    "between saw them without those rows (call opt.finish_step() before reading parameters "
                    "outside a forward)",
                )
            run.land(g, dropped)
            self._mains.note([program.entries[e].param for e in entries if e not in dropped])
            self._pending.discard(g)
            for e in entries:  # (our own writes moved their counters, and those of shards sharing storage)
                for moved in targets.sharing.get(e, (e,)):
                    if moved not in self._written:
                        self._versions[moved] = targets.versions(moved)
        self._done()

    def _done(self) -> None:
        if self.run is not None and not self._pending:
            self.run, self._program = None, None  # (a program dropped by the optimizer goes now)

    def _list(self, params: Iterable[Tensor]) -> str:
        named = sorted({self._names(p) for p in params})
        return ", ".join(named[:4]) + (f" and {len(named) - 4} more" if len(named) > 4 else "")

    def _say(self, what: str, message: str) -> None:
        """Warn once per kind of message."""
        if what not in self._said:
            self._said.add(what)
            warnings.warn(f"DMuonFSDP(overlap_forward=True): {message} (said once)", stacklevel=4)


def _dead() -> None:
    return None


def _version(t: Tensor | None) -> int:
    return t._version if t is not None else -1


@torch.compiler.disable(recursive=True)  # (reached only outside traced code: see the hooks)
@torch.no_grad()
def _call(owner: weakref.ref, name: str, *args: Any) -> None:
    finish = owner()
    if finish is not None:
        getattr(finish, name)(*args)


def _traced_away(me: weakref.ref) -> Callable[..., None]:
    """The finder's hook, on every module's forward: ``find`` where the forward runs eagerly,
    nothing where it is traced (inside a compiled module; its own hooks are traced too)."""

    def find_module(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            _call(me, "find", module)

    return find_module


def _outside_traces(me: weakref.ref) -> Callable[..., None]:
    """The forward pre-hook of a module seen running eagerly: ``before``, and nothing where it is
    traced (compiled after it was found: its relays land late, which ``settle`` sees)."""

    def land_relays(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            finish = me()
            if finish is not None and finish.run is not None:  # (relays in flight: else nothing to do)
                _call(me, "before", module)

    return land_relays


def _eager(me: weakref.ref) -> Callable[..., None]:
    """The forward pre-hook of a module compiled on its own: run eagerly (its own hooks are not
    traced when it is called; only its inside is)."""
    return torch.compiler.disable(lambda module, args: _call(me, "before", module), recursive=True)


def _compiled_tops(module: nn.Module) -> list[nn.Module]:
    """The modules below ``module`` that are compiled on their own (``m.compile()``; the module
    that ``torch.compile``'s wrapper holds), outside any other such: their own hooks run
    eagerly, their inside is traced."""
    out: list[nn.Module] = []
    stack = list(module.children())
    wrapper = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
    while stack:
        child = stack.pop()
        if child._compiled_call_impl is not None or (wrapper and child is module._orig_mod):
            out.append(child)
        else:
            stack.extend(child.children())
    return out


def _fsdp_units() -> list[Any]:
    """Every FSDP2 parameter group (``FSDPParamGroup``) in this process, from FSDP2's registry of
    the modules it manages (internal: checked here, where it is used; without it, FSDP2 modules
    are found in their forwards as any other module)."""
    try:
        from torch.distributed import _composable_state
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

        refs = list(_composable_state._module_state_mapping.values())
    except (ImportError, AttributeError):
        warnings.warn(
            f"DMuonFSDP(overlap_forward=True): this torch's ({torch.__version__}) FSDP2 keeps no registry of "
            "its modules where torch 2.13 does, so its units are found in their forwards, as other modules "
            "are: an all-gather outside a forward (an explicit unshard()) may read rows still in flight",
            stacklevel=2,
        )
        return []
    states = {id(s): s for ref in refs if (s := ref()) is not None}  # (grouped modules share one)
    units: list[Any] = []
    for state in states.values():
        if isinstance(state, FSDPState):
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # (torch before per-parameter meshes: one group)
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            units.extend(groups)
    return units


def _wrap_unshard(unit: Any, me: weakref.ref) -> None:
    """Make ``unit.unshard`` land the relays of its parameters first (an instance attribute
    over FSDP2's method: every caller, FSDP2's hooks included, looks it up on the unit)."""
    unshard = unit.unshard

    def land_then_unshard(async_op: bool = False) -> Any:
        finish = me()
        if finish is not None and finish.run is not None:  # (relays in flight: else nothing to do)
            _call(me, "before_unshard", unit, async_op)
        return unshard(async_op)

    unit.unshard = land_then_unshard


def _order_all_gathers(unit: Any, async_op: bool) -> None:
    """On an accelerator, make the streams FSDP2 all-gathers ``unit`` on wait for the updates
    just applied on the current stream (FSDP2 orders them after it once per forward, at its
    root, before these)."""
    device = getattr(unit, "device", torch.device("cpu"))
    if device.type == "cpu":
        return
    current = torch.get_device_module(device).current_stream(device)
    context = getattr(unit, "comm_ctx", None)  # (FSDP2's, internal: checked here, where it is used)
    state = getattr(unit, "_training_state", None)
    try:
        streams = context.get_all_gather_streams(async_op, state) if context is not None else None
    except AttributeError:  # its streams not made yet
        streams = None
    if streams is None:
        warnings.warn(
            f"DMuonFSDP(overlap_forward=True): this torch's ({torch.__version__}) FSDP2 has no all-gather "
            "streams where torch 2.13 keeps them; each unit's relays land with the host waiting for the "
            "device instead (correct, slower)",
            stacklevel=2,
        )
        current.synchronize()
        return
    for stream in set(streams):
        if stream != current:
            stream.wait_stream(current)


def _remove(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()
