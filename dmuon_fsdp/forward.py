"""Steps finished in the next forward (``DMuonFSDP(..., overlap_forward=True)``): the relays across
replicas a step leaves in flight, each completed before a module that uses its parameters runs.

Under HSDP across nodes each rank receives, by relay from its twins in the other replicas, about
(R - 1) / R of every piece it holds ([Note: the relay] in ``dmuon_fsdp._step.relay``): most of
the step's traffic over the slow links between nodes, which the next forward leaves idle (its
all-gathers stay inside each replica). With ``overlap_forward`` the planner cuts the relays in
parameter order instead of after each bucket, and ``step()`` runs everything else as a plain step
does, keeps the parts this rank relays, launches the first relays and returns. The rest is
finished here: a forward pre-hook on each module that uses Muon parameters (an FSDP2 module
all-gathers its own; any other module reads its direct ones), run before FSDP2's, waits for and
applies every relay through the last one holding those parameters (and the modules FSDP2
prefetches with it), launching the next ones as the slots free. Every rank launches the relays
in one order, from the hook of the same module, as backward's hooks do.

[Note: finished in forward] What ``step()`` guarantees on return: every AdamW parameter and
Muon state updated, weight decay applied, and each Muon parameter's rows from its owner's
replica's results updated on every rank; the rows its twins relay are in flight. They are
completed by the next forward of the module that uses them, by ``state_dict()`` of such a module
(a hook on it: ``model.state_dict()``, torch's and DCP's state-dict helpers), by the optimizer's
``state_dict()``, ``load_state_dict()`` and next ``step()``, and by ``finish_step()``, which
anything else reading the parameters in between must call first (an EMA, norms logged,
``full_tensor()``, QK-clip, which calls it). The modules are found in the forwards after the
optimizer is built (a hook on every module's forward until each Muon parameter's module is
found); a relay holding a parameter no module was found for is finished at the end of ``step()``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:
    from dmuon_fsdp._step.program import StepProgram
    from dmuon_fsdp._step.run import StepRun


class ForwardFinish:
    """The relays a step left in flight (``defer``), the modules found to use the Muon parameters
    (``watch``), and their hooks."""

    def __init__(self) -> None:
        self.run: StepRun | None = None  # the step whose relays are in flight
        self._last: dict[Tensor, int] = {}  # each parameter's last relay in the program deferred
        # Muon parameters without a module found yet, by id (a WeakSet compares tensors by value)
        self._wanted: dict[int, weakref.ref[Tensor]] = {}
        self._uses: weakref.WeakKeyDictionary[nn.Module, tuple[Tensor, ...]] = weakref.WeakKeyDictionary()
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._hooks: list[Any] = []
        self._finder: Any = None
        weakref.finalize(self, _remove, self._hooks)

    def watch(self, params: list[Tensor]) -> None:
        """Find, in the forwards to come, the modules that use ``params`` (the Muon parameters),
        and hook them (modules found before keep their hooks)."""
        found = self._found()
        self._wanted = {id(p): weakref.ref(p) for p in params if id(p) not in found}
        if self._wanted and self._finder is None:
            me = weakref.ref(self)
            self._finder = nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: _call(me, "find", module)
            )
            self._hooks.append(self._finder)

    def find(self, module: nn.Module) -> None:
        """A module's forward is about to run (the finder's hook): hook it if it uses Muon
        parameters not found yet, and finish what it needs."""
        if module in self._seen:
            return
        self._seen.add(module)
        used = tuple(p for p in _gathered(module) if self._wanted.get(id(p), _dead)() is p)
        if used:
            for p in used:
                del self._wanted[id(p)]
            self._uses[module] = used
            me = weakref.ref(self)
            self._hooks.append(
                module.register_forward_pre_hook(lambda m, args: _call(me, "before", m), prepend=True)
            )
            self._hooks.append(module.register_state_dict_pre_hook(lambda *_: _call(me, "finish")))
            self.before(module)
        if not self._wanted and self._finder is not None:
            self._finder.remove()
            self._finder = None

    def defer(self, run: StepRun, program: StepProgram) -> None:
        """``run``'s relays are left to the next forward: launch the first ones; finish now the
        relays of parameters no module was found for."""
        self.finish()
        self.run, self._last = run, program.relay_last
        found = self._found()
        orphans = [g for p, g in self._last.items() if id(p) not in found]
        run.finish_relays(max(orphans, default=-1) + 1)
        self._done()

    def before(self, module: nn.Module) -> None:
        """A hooked module's forward (or FSDP2's all-gather of it) is about to run: finish every
        relay through the last one holding its parameters, or those of the modules FSDP2
        prefetches with it."""
        run = self.run
        if run is None:
            return
        used = [p for m in _with_prefetched(module) for p in self._uses.get(m, ())]
        stop = max((self._last.get(p, -1) for p in used), default=-1) + 1
        if stop > run.relays_applied:
            run.finish_relays(stop)
            _order_all_gathers(module)
        self._done()

    @torch.no_grad()
    def finish(self) -> None:
        """Finish every relay left in flight."""
        if self.run is not None:
            self.run.finish_relays(len(self.run.program.relays))
        self.run = None

    def _found(self) -> set[int]:
        """The Muon parameters, by id, whose modules are found (and hooked)."""
        return {id(p) for params in self._uses.values() for p in params}

    def _done(self) -> None:
        if self.run is not None and not self.run.relays_left:
            self.run = None


def _dead() -> None:
    return None


@torch.compiler.disable(recursive=True)  # a compiled forward calls the hooks eagerly
@torch.no_grad()
def _call(owner: weakref.ref, name: str, *args: Any) -> None:
    finish = owner()
    if finish is not None:
        getattr(finish, name)(*args)


def _gathered(module: nn.Module) -> list[Tensor]:
    """The parameters a module's forward reads: an FSDP2 module all-gathers its own and those of
    submodules no other FSDP2 module manages; any other module reads its direct ones and those of
    its parameter containers (``nn.ParameterList``, ``nn.ParameterDict``: they have no forward)."""
    if not isinstance(module, FSDPModule):
        held = [
            module,
            *(c for c in module.children() if isinstance(c, (nn.ParameterList, nn.ParameterDict))),
        ]
        return [p for m in held for p in m.parameters(recurse=False)]
    inner = [sub for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)]
    nested = {id(p) for sub in inner for p in sub.parameters()}
    return [p for p in module.parameters() if id(p) not in nested]


def _with_prefetched(module: nn.Module) -> list[nn.Module]:
    """``module`` and the modules FSDP2 all-gathers in its pre-forward besides (its explicit
    forward prefetch, ``set_modules_to_forward_prefetch``)."""
    state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
    prefetched = getattr(state, "_states_to_forward_prefetch", None) or []
    return [module, *(m for s in prefetched for m in getattr(s, "_modules", ()))]


def _order_all_gathers(module: nn.Module) -> None:
    """On an accelerator, make FSDP2's all-gather streams wait for the updates just applied on the
    current stream: FSDP2 orders them after the current stream once per forward, at its root."""
    if not isinstance(module, FSDPModule):
        return
    state = module._get_fsdp_state()
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cpu":
        return
    current = torch.get_device_module(device).current_stream(device)
    context = getattr(state, "_comm_ctx", None)  # (FSDP2's, internal: checked here, where it is used)
    streams = [getattr(context, name, None) for name in ("all_gather_copy_in_stream", "all_gather_stream")]
    if any(stream is None for stream in streams):
        warnings.warn(
            f"DMuonFSDP(overlap_forward=True): this torch's ({torch.__version__}) FSDP2 has no all-gather "
            "streams where torch 2.13 keeps them; each module's relays are finished with the host "
            "waiting for the device instead (correct, slower)",
            stacklevel=2,
        )
        current.synchronize()
        return
    for stream in streams:
        if stream is not None:  # (every one: checked above)
            stream.wait_stream(current)


def _remove(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()
