"""Every knob of DMuonFSDP in one place: the optimizer-wide options (``Options``, checked when
made, and ``Option``, the attribute that exposes one), the vocabularies options take (comm
dtypes, lr adjustments, NS algorithms, non-finite policies, the registry of row variants), which
group options shape a step program (``STRUCTURAL``) or are read at every step (``HYPER``), and
the per-step ``Settings`` the optimizer resolves from them once and keeps until an option, the
parameters or their meshes change. Group options' own checks live with the groups
(``dmuon_fsdp.options``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dmuon_fsdp.normuon import NORMUON

if TYPE_CHECKING:
    from dmuon_fsdp import comm
    from dmuon_fsdp.variants import RowVariant

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
NS_ALGORITHMS = ("standard", "gram", "auto")
NONFINITE_POLICIES = ("raise", "skip", "ignore")

# The row variants by the name the ``variant`` option takes ([Note: row variants] in
# ``dmuon_fsdp.variants``); plain Muon is none.
VARIANTS: dict[str, RowVariant | None] = {"muon": None, NORMUON.name: NORMUON}

# Muon group options built into a step program: changing one rebuilds it (with the variants').
STRUCTURAL = (
    "ns_steps",
    "ns_coefficients",
    "ns_algorithm",
    "eps",
    "adjust_lr_fn",
    "flatten",
    "split_sizes",
    "num_heads",
    "variant",
)

# Per-step options that every rank must step with alike (read at every step, so not in the key):
# checked through the flags too, without a rebuild when they change alike (a scheduler's lr).
HYPER = {True: ("lr", "momentum", "nesterov", "weight_decay"), False: ("lr", "betas", "eps", "weight_decay")}


def structural_options() -> tuple[str, ...]:
    """``STRUCTURAL`` and every row variant's options."""
    return STRUCTURAL + tuple(option for v in VARIANTS.values() if v is not None for option in v.options)


def row_state_keys() -> frozenset[str]:
    """The state keys of every row variant's row state."""
    return frozenset(v.state_key for v in VARIANTS.values() if v is not None)


def row_variant(group: dict[str, Any]) -> RowVariant | None:
    """The row variant of a param group, or None for plain Muon and AdamW groups."""
    return VARIANTS[group["variant"]] if group["use_muon"] else None


@dataclass(frozen=True)
class Options:
    """DMuonFSDP's optimizer-wide options, checked when made (see the README's argument table)."""

    ns_dtype: torch.dtype | None = None
    comm_dtype: torch.dtype | None = None
    bucket_bytes: int = 128 * 2**20
    overlap: bool = True
    time_phases: bool = False
    nonfinite: str = "raise"
    check_grads: bool = True
    overlap_backward: bool = False

    def __post_init__(self) -> None:
        if self.ns_dtype is not None and not (
            isinstance(self.ns_dtype, torch.dtype) and self.ns_dtype.is_floating_point
        ):
            raise ValueError(f"ns_dtype must be a floating-point torch.dtype or None, got {self.ns_dtype!r}")
        if self.comm_dtype is not None and self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"comm_dtype must be one of {COMM_DTYPES} or None, got {self.comm_dtype}")
        if (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 1
        ):
            raise ValueError(f"bucket_bytes must be a positive integer, got {self.bucket_bytes!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        for name in ("overlap", "time_phases", "check_grads", "overlap_backward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


OPTIMIZER_WIDE = tuple(f.name for f in dataclasses.fields(Options))


class Option:
    """An optimizer-wide option as an attribute of the optimizer (its ``_options`` record).
    Assignment checks the value as construction does and hands the new record to the
    optimizer's ``_set_options``; ``settable=False`` options shape the step program's buffers
    and are fixed at construction."""

    def __init__(self, settable: bool = True) -> None:
        self.settable = settable

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, optimizer: Any, owner: type | None = None) -> Any:
        return self if optimizer is None else getattr(optimizer._options, self.name)

    def __set__(self, optimizer: Any, value: Any) -> None:
        if not self.settable:
            raise AttributeError(f"{self.name} is fixed at construction: build a new optimizer to change it")
        optimizer._set_options(dataclasses.replace(optimizer._options, **{self.name: value}))


@dataclass(frozen=True)
class Settings:
    """What a program is built and run with besides the parameters: the options resolved for
    this optimizer's parameters (dtypes by device) and where its exchanges run."""

    site: comm.ExchangeSite
    device: torch.device
    ns_dtype: torch.dtype
    comm_dtype: torch.dtype
    bucket_bytes: int
    check_grads: bool
    nonfinite: str
    in_backward: bool  # steps start in backward (``dmuon_fsdp.backward``): its plan, groups, carrier

    @property
    def exchange_group(self) -> comm.ExchangeGroup:
        """The group the exchanges run on."""
        return self.site.backward if self.in_backward else self.site.group
