"""The optimizer's steps, one after another: what lasts between them and which program each runs.

``ProgramCache`` keeps the plans of the step keys seen lately and their bound programs, and
says which one a step runs: bound, bound anew (``dmuon_fsdp._step.binding``), or planned first
(``dmuon_fsdp._step.planning``). ``Runtime`` holds it with the settings steps run with and the
hooks of steps begun in backward, and runs each step, acting on its verdict in one place
(``Runtime.step``): go, skip, redo, rebuild, raise. A step: its key (``flags.StepKey``) -> its
program -> the bucket loop (``run.StepRun``, or ``BackwardStart.run`` from where backward left
it) -> the verdict every rank shares. ``DMuonFSDP`` around it keeps the ``torch.optim``
contract (groups, state, state dicts).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.binding import bind
from dmuon_fsdp._step.buffers import Pool
from dmuon_fsdp._step.errors import raise_for
from dmuon_fsdp._step.flags import StepKey, Verdict, agreed, key_agreement
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.planning import Planned, Trouble, main_homes, plan_program
from dmuon_fsdp._step.program import StepProgram
from dmuon_fsdp._step.run import StepRun, StepStats
from dmuon_fsdp._step.state import MAIN, MainWeights, restore_state, stale_layouts
from dmuon_fsdp.backward import BackwardStart, overlap_refusal
from dmuon_fsdp.config import Options, Settings
from dmuon_fsdp.forward import ForwardFinish


@dataclass(frozen=True)
class Ready:
    """The program for a step, or None when every rank found, as it planned, that the step
    cannot run (the error to raise alike shares its findings when ``shared``); ``bound`` False
    when a parameter or its state changed layout since it was bound (the step then reports that
    on every rank instead of running); ``agreement``: the agreement on the step key under way,
    which the step waits for before its first exchange (``agreed``)."""

    program: StepProgram | None
    bound: bool
    agreement: comm.Handle | None = None
    shared: bool = False


PROGRAMS_KEPT = 4  # step keys whose programs are kept, least recently used dropped


AGREE_UNTIL_STEADY = 100  # steps a key must hold before keys are no longer agreed first


class ProgramCache:
    """The optimizer's step programs, for the step keys seen lately (``PROGRAMS_KEPT`` at most,
    each program with buffers of its own), and which one a step runs.

    Every rank must run the same program, or their exchanges would not match. With checks on, a
    program's first exchange carries every rank's key, so a step whose key changed runs the
    program in use once more, its flags tell that every rank changed alike (``Verdict.REBUILD``)
    and ``follow`` takes the new key's program, kept or planned, for the step's second run. Once
    a step returns to a key whose plan is kept (a branch used every other step, an MoE block
    some steps skip), each step also agrees on its key with one small ``all_reduce``
    (``key_agreement``, waited for before the step's first exchange) and runs that key's
    program at once, until the key has stayed the same for ``AGREE_UNTIL_STEADY`` steps. The
    kept plans and their order follow from the keys every rank agreed on; an error every rank
    raises (``raise_alike``) lets all of them go, so that no rank keeps what another did not.
    Without checks, each rank takes its key's program."""

    def __init__(self) -> None:
        self._plans: OrderedDict[StepKey, Planned] = OrderedDict()
        self._bound: dict[StepKey, StepProgram] = {}  # their programs, unless to be bound anew
        self._key: StepKey | None = None  # the key of the program in use
        self._asked: StepKey | None = None  # the key of the last step
        self._again = False  # the next ``get`` runs the last step again (after ``follow``)
        self._repeated = False  # the last two steps had one key
        self._agreeing = False  # keys are agreed before each step
        self._steady = 0  # steps since the key last changed
        self._pool: Pool | None = None  # the buffers every kept program is bound into

    @property
    def current(self) -> StepProgram | None:
        return self._bound.get(self._key) if self._key is not None else None

    @property
    def plan(self) -> Plan | None:
        """The plan in use (also when its program is to be bound anew)."""
        planned = self._plans.get(self._key) if self._key is not None else None
        return planned.plan if planned is not None else None

    @property
    def buffer_bytes(self) -> int:
        """The bytes of the buffers the kept programs share (``dmuon_fsdp._step.buffers``)."""
        return self._pool.nbytes if self._pool is not None else 0

    @property
    def repeated(self) -> bool:
        """Whether the last step had the key of the one before (or none came before): hooks are
        worth arming only for a program the next step is likely to run."""
        return self._repeated

    def clear(self) -> None:
        """Parameters, groups or meshes changed: plan at the next step."""
        self._plans.clear()
        self._bound.clear()
        self._key, self._agreeing, self._pool = None, False, None

    def raise_alike(
        self, groups: list[dict[str, Any]], state: Any, names: dict, settings: Settings, shared: bool
    ) -> NoReturn:
        """Let every kept program go and raise the error every rank raises alike (a collective
        when ``shared``): no rank keeps what another did not."""
        self.clear()
        raise_for(groups, state, names, settings, shared)

    def state_replaced(self) -> None:
        """The state tensors were replaced wholesale (``load_state_dict``): every program is bound
        anew when next used (its buffers and views go now, with the old tensors they hold, except
        a program armed for a step begun in backward, which goes at the next step)."""
        self._bound.clear()

    def follow(self) -> None:
        """Every rank's key changed alike to the last step's (``Verdict.REBUILD``): the step runs
        again (no agreement needed: the flags were one) with its key's program."""
        assert self._asked is not None  # a step ran: ``get`` set it
        self._use(self._asked)
        self._again = True

    def _use(self, key: StepKey) -> None:
        if key == self._key:
            self._steady += 1
            self._agreeing &= self._steady < AGREE_UNTIL_STEADY
        else:
            self._agreeing |= key in self._plans  # a return to a key seen lately
            self._key, self._steady = key, 0

    def get(
        self,
        key: StepKey,
        params: list[Tensor],
        groups: list[dict[str, Any]],
        state: Any,
        names: dict,
        settings: Settings,
    ) -> Ready:
        """The program for a step of ``key`` (see the class docstring); ``params`` are the
        parameters of ``groups`` in optimizer order."""
        again, self._again, agreement = self._again, False, None
        if not again:
            self._repeated, self._asked = self._asked in (None, key), key
        checked = settings.check_grads and key.checked and len(settings.site.ranks) > 1  # flags travel
        if checked and self._agreeing and not again:
            agreement = key_agreement(key.digest, settings.site.group.process_group, settings.device)
            # A plan to make, or steps begun in backward: agreed first; else while its NS inputs
            # are made (every rank keeps the same plans: an agreed key means the same program)
            if key not in self._plans or settings.in_backward:
                if not agreed(agreement, key.digest):
                    return Ready(None, bound=False, shared=True)
                agreement = None
            self._use(key)
        elif not checked or self._key is None:
            self._use(key)
        in_use = self._key
        assert in_use is not None  # ``_use`` set it, now or at an earlier step
        program = self.current
        if self._pool is None:
            self._pool = Pool(settings.device, release=self._bound.clear)
        if program is None or program.generation != self._pool.generation or program.moved(params, state):
            self._bound.pop(in_use, None)
            del program
            restore_state(groups, state, settings.homes, settings.site.rank)  # (cleared by hand: afresh)
            if in_use not in self._plans:
                while len(self._plans) >= PROGRAMS_KEPT:
                    self._bound.pop(self._plans.popitem(last=False)[0], None)
                made = plan_program(in_use, groups, state, names, settings)
                if isinstance(made, Trouble):
                    return Ready(None, bound=False, shared=made.shared)
                self._plans[in_use] = made
            # (a pool that grows lets every kept program go first: they bind anew when used)
            program = bind(self._plans[in_use], in_use, params, groups, state, settings, self._pool)
            if stale_layouts(params, state):  # every rank hears of it at the verdict
                return Ready(program, bound=False, agreement=agreement)  # (not kept: bound to old state)
            self._bound[in_use] = program
        self._plans.move_to_end(in_use)
        return Ready(program, bound=True, agreement=agreement)


@dataclass(frozen=True)
class Ran:
    """A step that ran: what this rank did, the verdict every rank shares (``committed``: ``GO``,
    state was written), the program it ran and the run (its relays left to the next forward)."""

    stats: StepStats
    verdict: Verdict
    program: StepProgram
    run: StepRun

    @property
    def committed(self) -> bool:
        return self.verdict is Verdict.GO


class Runtime:
    """What an optimizer's steps share: ``settings`` (resolved once per parameters, meshes and
    option change), ``programs`` (the kept programs) and ``backward`` (the hooks and the step
    begun in backward). Made anew, not copied, by ``copy.deepcopy`` and unpickling."""

    def __init__(self) -> None:
        self.programs = ProgramCache()
        self.backward = BackwardStart()
        self.mains = MainWeights()
        self.forward = ForwardFinish(self.mains)
        self.settings: Settings | None = None
        self.everywhere: set[Tensor] = set()  # parameters whose main weights every holder keeps (QKClip's)
        self._no_overlap_reason: str | None = None  # why steps do not begin in backward (said once)
        self._warned_no_grads = False  # a step without any gradient warns once
        self._idle: str | None = None  # what an option that has nothing to do says (once; "": said)

    def set_meshes(
        self,
        meshes: dict[Any, str],
        params: list[Tensor],
        groups: list[dict[str, Any]],
        names: dict,
        options: Options,
    ) -> None:
        """The parameters or their meshes changed: a new exchange site and no program kept."""
        self.programs.clear()
        self.backward.disarm()
        wanted = options.overlap_backward
        self._no_overlap_reason = overlap_refusal(groups, names) if wanted else None
        device = params[0].device if params else torch.device("cpu")
        site = comm.exchange_site(meshes, params)
        if options.overlap_forward:
            self.forward.watch([p for g in groups if g["use_muon"] for p in g["params"]])
        before = self.settings
        previous = before.homes if before is not None and before.site.ranks == site.ranks else None
        homes = main_homes(groups, names, site.ranks, self.everywhere, previous)
        in_backward = wanted and not self._no_overlap_reason
        self.settings = Settings.resolve(options, site, device, in_backward, homes)

    def set_options(self, options: Options, device: torch.device | None = None) -> None:
        """A settable option changed, or the parameters moved to ``device``: the settings anew."""
        settings = self.ready()
        device = device or settings.device
        self.settings = Settings.resolve(options, settings.site, device, settings.in_backward, settings.homes)

    def ready(self) -> Settings:
        assert self.settings is not None  # set with the first param group (torch wants one)
        return self.settings

    def step(
        self, params: list[Tensor], groups: list[dict[str, Any]], state: Any, names: dict, options: Options
    ) -> Ran:
        """One step of ``params`` (the parameters of ``groups`` in optimizer order), and what its
        verdict, the same on every rank, asks for: raise alike, run again from the final
        gradients (redo), a skip, the new key's program run once more (rebuild); then, for steps
        begun in backward, the hooks armed for the next backward."""
        if self.forward.run is not None:  # what the last step left in flight (did a forward read it early?)
            self.forward.settle()
        self.mains.take(params, state)  # what was written into parameters with main weights since
        if params and params[0].device != self.ready().device:  # moved (model.to, to_empty)
            self.set_options(options, params[0].device)
        settings = self.ready()
        grads = [p.grad for p in params]
        checked = options.check_grads or options.nonfinite != "ignore"
        key = StepKey.of(groups, grads, checked, settings.structural)
        ran = self._run(key, grads, params, groups, state, names, options)
        if ran.verdict is Verdict.REBUILD:  # every rank's gradients or options changed alike
            self.programs.follow()
            ran = self._run(key, grads, params, groups, state, names, options)
        if ran.committed:
            self.mains.note([p for p in params if MAIN in state[p]])
        if ran.committed and settings.in_forward:
            self.forward.defer(ran.run, ran.program, lambda p: names.get(p, f"a tensor {tuple(p.shape)}"))
        if ran.committed and self._idle is None:
            self._idle = _idle(options, settings, ran.program)
        if ran.verdict is not Verdict.REBUILD and settings.in_backward:
            if self.programs.repeated:  # the next backward starts this program's buckets
                self.backward.arm(ran.program, groups, options)
            else:  # gradient sets that change: steps run after backward, nothing started in vain
                self.backward.disarm()
        return ran

    def _run(
        self,
        key: StepKey,
        grads: list[Tensor | None],
        params: list[Tensor],
        groups: list[dict[str, Any]],
        state: Any,
        names: dict,
        options: Options,
    ) -> Ran:
        """The step of ``key`` with its program, once more from the final gradients if its
        verdict asks to (``REDO``); raises alike on every rank if it asks to (``RAISE``)."""
        settings = self.ready()
        ready = self.programs.get(key, params, groups, state, names, settings)
        if ready.program is None:  # every rank found trouble while planning
            self.programs.raise_alike(groups, state, names, settings, shared=ready.shared)
        program = ready.program
        local = program.local_grads(grads) if ready.bound and key == program.key else None
        if settings.in_backward:
            verdict, run = self.backward.run(program, local, groups, key, options)
        else:
            run = StepRun.of(program, options)
            verdict = run.run(local, groups, key, options, ready.agreement)
        if verdict is Verdict.REDO:  # gradients changed after backward read them: from the final ones
            run = StepRun.of(program, options)
            verdict = run.run(local, groups, key, options)
            run.stats.redone = True
        stats = run.stats
        stats.skipped = verdict is Verdict.SKIP
        stats.buffer_bytes = self.programs.buffer_bytes
        stats.settle_times()
        if verdict is Verdict.RAISE:
            self.programs.raise_alike(groups, state, names, settings, shared=program.flags is not None)
        return Ran(stats, verdict, program, run)

    def say_once(self, params: Sequence[Tensor]) -> None:
        """After a step: why steps do not begin in backward, and a step without any gradient
        (warnings at the caller of ``DMuonFSDP.step``)."""
        if self._no_overlap_reason is not None:
            warnings.warn(self._no_overlap_reason, stacklevel=6)
            self._no_overlap_reason = None
        if self._idle:
            warnings.warn(self._idle, stacklevel=6)
            self._idle = ""  # (said once)
        if params and all(p.grad is None for p in params) and not self._warned_no_grads:
            self._warned_no_grads = True
            warnings.warn(
                "DMuonFSDP.step(): no parameter has a gradient, so nothing is updated (said once): was "
                "backward run, and are these the model's parameters? (a model whose parameters were "
                "replaced after the optimizer was built, as by fully_shard or to_empty, trains nothing)",
                stacklevel=6,
            )


def _idle(options: Options, settings: Settings, program: StepProgram) -> str | None:
    """What an option asked for but idle in ``program`` says, or None: ``overlap_backward`` with
    one bucket (it carries the step's checks, so it starts at ``step()``), ``overlap_forward``
    with nothing to relay (no replicas)."""
    if settings.in_backward and program.carrier == 0:
        return (
            "DMuonFSDP(overlap_backward=True): the plan has one bucket, which carries the step's checks "
            "and so starts at step(): nothing starts in backward (with fewer matrices than ranks, or "
            "bucket_bytes as large as every rank's share, every owner's work is in that one bucket); "
            "steps are plain, with the same results (said once)"
        )
    if options.overlap_forward and not program.relays:
        return (
            "DMuonFSDP(overlap_forward=True): no Muon matrix has a copy in another replica (HSDP, DDP), "
            "so no relay across replicas is left to the next forward; steps are plain (said once)"
        )
    return None
