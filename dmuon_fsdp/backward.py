"""A step begun in backward: each bucket's exchange to its owners starts as its gradients land.

FSDP2 calls every ``register_post_accumulate_grad_hook`` hook of a sharded parameter right after
its reduce-scattered (under HSDP also all-reduced) gradient is assigned (torch 2.13,
``foreach_reduce``). With ``DMuonFSDP(..., overlap_backward=True)`` the plan's buckets follow the
order gradients arrive (the parameters' reverse order) and ``BackwardStart`` hooks every Muon
parameter of the program, from the step after the one that built it. Once the gradients of
every parameter with a matrix in a bucket have landed (the same hook on every rank: the plan
says which, whatever this rank holds of them), and every earlier bucket started, the bucket
*starts*: this rank's NS inputs for it are made (the momentum buffers are only read) and its
exchange to the owners is launched, on a side stream on accelerators, which the end of backward
waits for. A hook never waits for anything.

Only the buckets before the carrier of the check flags start so (the carrier is the first
bucket of the loop after them: its exchange carries the flags, made from the final gradients;
``carrier`` in ``dmuon_fsdp._step.schedule``): they hold the slots of ``dmuon_fsdp._step.buffers``, which the
later buckets take over at ``step`` once those are through. ``run`` (at ``step``) runs the same
bucket loop as a plain step (``dmuon_fsdp._step.run``, [Note: the bucket loop]), which finds them
launched. The exchanges run in the same order on every rank, whenever a rank's hooks or its
``step`` launch them, on a process group of their own over the whole job, never among FSDP2's
collectives; over part of the job (a pipeline stage) on the stage mesh's own group, where a
hook launches each at the same point of FSDP2's sequence of collectives on every rank (FSDP2
calls the hooks right after issuing the reduction that made the gradient):
``comm.side_group``, [Note: groups] in ``dmuon_fsdp._step.comm``. Newton-Schulz stays at
``step``, where every rank runs its share of all buckets at once: docs/design.md ("Steps begun
in backward") gives the measurements behind that.

Gradients that changed after their bucket started (``clip_grad_norm_``, ``GradScaler.unscale_``,
a pipelining schedule's ``scale_grads``, a second backward accumulating into them) are seen at
``step`` from a hook firing again, the gradients' identity and version counters, or their norms;
the flags then ask for ``Verdict.REDO`` and every rank runs the step again from the final
gradients, as a plain step (warned once). ``clip_grad_norm_`` here clips as torch's does but
leaves the gradients untouched when the clip coefficient is 1, so only the steps that do clip
are redone.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon_fsdp._step import comm
from dmuon_fsdp._step.flags import StepKey, Verdict
from dmuon_fsdp._step.program import StepProgram
from dmuon_fsdp._step.run import StepRun
from dmuon_fsdp._step.state import MuonStep, local_shard, muon_steps

if TYPE_CHECKING:
    from dmuon_fsdp.config import Options


@dataclass
class Progress:
    """How far one step got before ``step``: its ``run`` (what was launched) and, for the hooks,
    ``missing[k]``: gradients bucket k needs that have not landed; ``used``: each gradient a
    started bucket read here, with its version counter then, and ``norms`` their norms (in that
    order); ``steps``: the groups' per-step options the NS inputs were made with (read at the
    first bucket started); ``halted``: a gradient unfit for the program landed (the step
    explains it), so nothing more starts."""

    run: StepRun
    missing: list[int]
    grads: list[Tensor | None]
    used: dict[int, tuple[Tensor, int]] = field(default_factory=dict)
    norms: list[Tensor] = field(default_factory=list)
    steps: list[MuonStep | None] | None = None
    stale: bool = False  # a gradient landed again after a started bucket read it
    halted: bool = False
    joining: bool = False  # the end of backward waits for the side stream

    @classmethod
    def of(cls, program: StepProgram, options: Options) -> Progress:
        missing = [len(bucket.needs) for bucket in program.buckets]
        return cls(StepRun.of(program, options), missing, [None] * len(program.entries))

    @property
    def program(self) -> StepProgram:
        return self.run.program

    def replaced(self, local: list[Tensor], groups: Sequence[dict[str, Any]]) -> bool:
        """Whether what a started bucket read is seen on the host to differ from the step's
        final gradients and options: a gradient landed again, was replaced or written in place
        (its version counter), or momentum or nesterov changed."""
        if self.run.launched == 0:
            return False
        if self.stale or self.steps is None or _inputs(self.steps) != _input_options(groups):
            return True
        return any(local[i] is not g or g._version != version for i, (g, version) in self.used.items())

    def rewritten(self, local: list[Tensor]) -> Tensor | None:
        """A (1,) indicator on the device: 1 when a gradient a started bucket read has another
        norm now, bit for bit (so that a NaN equals itself). In-place writes through DTensor's
        foreach ops (``clip_grad_norm_`` on FSDP2 gradients) leave version counters as they were."""
        if not self.used:
            return None
        norms = torch._foreach_norm([local[i] for i in self.used], dtype=torch.float32)
        then, now = torch.stack(self.norms).view(torch.int32), torch.stack(norms).view(torch.int32)
        return (then != now).any().reshape(1).float()


def _input_options(groups: Sequence[dict[str, Any]]) -> tuple:
    """What the NS inputs depend on besides the gradients and buffers."""
    return tuple((float(g["momentum"]), bool(g["nesterov"])) for g in groups if g["use_muon"])


def _inputs(steps: Sequence[MuonStep | None]) -> tuple:
    """``_input_options`` of the groups ``steps`` were read from."""
    return tuple((s.momentum, s.nesterov) for s in steps if s is not None)


class _SideStream:
    """Where hooks work on an accelerator (nothing on CPU): a stream that starts after the one
    the hook runs on (FSDP2's reduce stream); ``join`` orders the caller's stream after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = torch.get_device_module(device) if device.type != "cpu" else None
        self.stream = self.module.Stream(device) if self.module is not None else None

    @contextmanager
    def on(self) -> Iterator[None]:
        if self.module is None:
            yield
            return
        assert self.stream is not None  # made with the module
        self.stream.wait_stream(self.module.current_stream(self.device))
        with self.module.stream(self.stream):
            yield

    def join(self) -> None:
        if self.module is not None:
            self.module.current_stream(self.device).wait_stream(self.stream)


class BackwardStart:
    """The hooks of one program's parameters and the progress of the step under way."""

    def __init__(self) -> None:
        self._program: StepProgram | None = None
        self._hooks: list[Any] = []
        self._first_reads: list[list[int]] = []  # per bucket, the gradients no earlier one read here
        self._waiting: dict[int, list[int]] = {}  # entry -> the buckets needing its gradient
        self._groups: Sequence[dict[str, Any]] = ()
        self._side: _SideStream | None = None
        self._progress: Progress | None = None
        self._warned = False
        self._warned_silent = False  # hooks that never fire (``_silent``)
        weakref.finalize(self, _remove, self._hooks)  # an optimizer gone leaves no hooks behind

    def arm(self, program: StepProgram, groups: Sequence[dict[str, Any]], options: Options) -> None:
        """Hook ``program``'s parameters (once per program) and expect the next backward."""
        if program is not self._program:
            self.disarm()
            self._program = program
            self._side = _SideStream(program.device)
            seen: set[int] = set()
            for k, bucket in enumerate(program.buckets[: program.carrier]):  # the buckets hooks start
                self._first_reads.append([i for i in bucket.reads if i not in seen])
                seen.update(bucket.reads)
                for i in bucket.needs:
                    self._waiting.setdefault(i, []).append(k)
            me = weakref.ref(self)  # parameters must not keep the optimizer alive
            for i in self._waiting:
                param = program.entries[i].param
                if param.requires_grad:  # else its buckets start at ``step``
                    self._hooks.append(param.register_post_accumulate_grad_hook(partial(_landed, me, i)))
        self._groups = groups  # the optimizer's list (a load may replace it)
        self._progress = Progress.of(program, options)

    def disarm(self) -> None:
        """Remove the hooks; a step under way is brought to where every rank stands alike."""
        self._settle(self._progress)
        _remove(self._hooks)
        self._first_reads, self._waiting = [], {}
        self._program, self._progress = None, None

    @torch.no_grad()
    def landed(self, i: int, param: Tensor) -> None:
        """Entry ``i``'s gradient was assigned (a hook)."""
        progress = self._progress
        if progress is None or param.grad is None:
            return
        grad = local_shard(param.grad)
        if not progress.program.fits(i, grad):
            progress.halted = True  # the step explains it, on every rank
        if progress.grads[i] is not None:  # again: accumulating (or a second backward)
            progress.stale |= i in progress.used
            progress.grads[i] = grad
            return
        progress.grads[i] = grad
        for k in self._waiting[i]:
            progress.missing[k] -= 1
        self._advance(progress)

    def _advance(self, progress: Progress) -> None:
        """Start every bucket before the carrier that can start, in bucket order."""
        run = progress.run
        while (
            not progress.halted and run.launched < run.program.carrier and progress.missing[run.launched] == 0
        ):
            k, side = run.launched, self._side
            assert side is not None  # made when armed, as the progress was
            if progress.steps is None:
                progress.steps = muon_steps(self._groups, run.program.device)
            if not progress.joining and side.module is not None:
                progress.joining = True  # what follows backward waits for the side stream
                engine = torch.autograd.Variable._execution_engine
                if hasattr(engine, "queue_callback"):  # (autograd's, internal)
                    engine.queue_callback(side.join)
                else:  # a torch without it: the stream the hook runs on waits here instead
                    progress.joining = False
            read = self._first_reads[k]
            grads = []
            for i in read:
                grad = progress.grads[i]
                assert grad is not None  # bucket k reads it: it landed (``missing[k]`` is 0)
                grads.append(grad)
            # Every gradient bucket k needs has landed; its stage reads no other (those may be None).
            landed = cast("list[Tensor]", progress.grads)
            with side.on(), run.stats.label("momentum"):
                run.start(k, landed, progress.steps)
                progress.norms += torch._foreach_norm(grads, dtype=torch.float32) if grads else []
            if not progress.joining and side.module is not None:
                side.join()
            progress.used.update((i, (g, g._version)) for i, g in zip(read, grads, strict=True))

    def _settle(self, progress: Progress | None) -> None:
        """Bring a step that will not be completed to where every rank's is (whatever its hooks
        started; ``StepRun.discard``)."""
        if progress is not None:
            progress.run.discard()

    def run(
        self,
        program: StepProgram,
        local: list[Tensor] | None,
        groups: Sequence[dict[str, Any]],
        key: StepKey,
        options: Options,
    ) -> tuple[Verdict, StepRun]:
        """The step from where backward left it (see the module docstring), with this rank's
        gradients ``local`` (None when they do not fit ``program``); returns the verdict and the
        run (what this rank did: its ``stats``). A verdict of ``REDO`` (gradients changed after
        backward read them, on some rank) asks for the step again from the final gradients, as a
        plain step."""
        progress, self._progress = self._progress, None  # hooks do nothing until armed again
        rebound = False
        if progress is not None and progress.program is not program:
            if progress.program.plan is program.plan:
                # Bound anew (same plan, same exchanges) since backward: go on with the new
                # program's buffers, so that every rank launches the same exchanges, and redo
                # from the start.
                progress.run.program = program
                rebound = True
            else:
                self._settle(progress)
                progress = None
        if progress is None:
            progress = Progress.of(program, options)
        elif (
            program.carrier
            and local is not None
            and self._hooks
            and not any(g is not None for g in progress.grads)
        ):
            self._silent()
        if self._side is not None:
            self._side.join()
        run = progress.run
        run.stats.started_in_backward = run.launched
        redo = local is not None and (rebound or progress.replaced(local, groups))
        changed = progress.rewritten(local) if local is not None and not redo else None
        verdict = run.run(local, groups, key, options, redo=redo, changed=changed)
        if verdict is Verdict.REDO and not self._warned and not rebound:
            self._warned = True
            warnings.warn(
                "DMuonFSDP(overlap_backward=True): gradients changed after backward began the step "
                "(clip_grad_norm_, GradScaler.unscale_, a pipelining schedule's scale_grads, or a "
                "backward accumulating into synced gradients), so the step was redone from the final "
                "gradients; clip with dmuon_fsdp.clip_grad_norm_, build pipelining schedules with "
                "scale_grads=False (as torchtitan does; scale the loss instead), and under FSDP2 "
                "accumulate with set_requires_gradient_sync(False), to keep the overlap (warned once)",
                stacklevel=4,
            )
        return verdict, run

    def _silent(self) -> None:
        """Backward gave the step its gradients but no hook fired (once)."""
        if not self._warned_silent:
            self._warned_silent = True
            warnings.warn(
                "DMuonFSDP(overlap_backward=True): backward gave the parameters their gradients but "
                "none of their post-accumulate-grad hooks fired, so nothing started in backward: this "
                f"torch ({torch.__version__}) or this framework does not call them as FSDP2 does "
                "(torch 2.13 and later: after each reduce-scatter); steps run after backward, with the "
                "same results (said once)",
                stacklevel=5,
            )


@torch.compiler.disable(recursive=True)  # compiled autograd calls it eagerly, never traces it
def _landed(start: weakref.ref, i: int, param: Tensor) -> None:
    owner = start()
    if owner is not None:
        owner.landed(i, param)


def _remove(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()
    hooks.clear()


def overlap_refusal(groups: Sequence[dict[str, Any]], names: dict[Tensor, str]) -> str | None:
    """Why steps cannot begin in backward for these groups, or None: every Muon gradient must be
    final when its post-accumulate-grad hook fires. FSDP2 and DTensor parameters, and plain
    tensors in one process, are; plain tensors in a job of several ranks (DDP) are all-reduced
    after their hooks, so such a job steps plainly (the optimizer says so at the next step, not
    at construction: one built before ``fully_shard`` holds plain tensors until it follows)."""
    world = comm.default_world_size()
    muon = [p for group in groups if group["use_muon"] for p in group["params"]]
    plain = next((p for p in muon if not isinstance(p, DTensor)), None)
    if world > 1 and plain is not None:
        return (
            f"DMuonFSDP(overlap_backward=True): {names[plain]} is a plain tensor in a job of "
            f"{world} ranks (replicated, as under DDP), whose gradients are all-reduced after their "
            "hooks fire; the steps run after backward instead"
        )
    return None


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``, with the same result, except that gradients are not
    touched when the clip coefficient is 1 (torch multiplies them by 1.0, which changes no value
    but marks them changed). With ``overlap_backward=True`` only the steps that clip are then
    redone. Reads the coefficient on the host (one synchronization, as logging the norm does)."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if grads and not bool(max_norm / (total + 1e-6) >= 1.0):  # torch's coefficient (NaN: clips too)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
        # DTensor's foreach ops leave version counters as they were: mark the gradients changed
        torch.autograd.graph.increment_version([local_shard(g) for g in grads])
    return total
