"""Every knob of DMuonFSDP in one place: the optimizer-wide options (``Options``, checked when
made, and ``Option``, the attribute that exposes one), the vocabularies options take (comm
dtypes, lr adjustments, NS algorithms, non-finite policies, the registry of row variants), which
group options shape a step program (``STRUCTURAL``) or are read at every step (``HYPER``), and
the per-step ``Settings`` the optimizer resolves from them once and keeps until an option, the
parameters or their meshes change; and the checks of every group option (``check_groups``:
an error names its group and what is wrong)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from dmuon_fsdp.newton_schulz import NS_ALGORITHMS, default_ns_dtype, resolve_coefficients
from dmuon_fsdp.normuon import NORMUON

if TYPE_CHECKING:
    from dmuon_fsdp._step import comm
    from dmuon_fsdp.variants import RowVariant

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def row_settings(group: dict[str, Any]) -> tuple[RowVariant | None, tuple[Any, ...]]:
    """A param group's row variant and the settings its math reads from the group's options
    (None and none for plain Muon and AdamW groups)."""
    variant = row_variant(group)
    return variant, variant.settings(group) if variant is not None else ()


@dataclass(frozen=True)
class Options:
    """DMuonFSDP's optimizer-wide options, checked when made (see the README's argument table)."""

    ns_dtype: torch.dtype | None = None
    comm_dtype: torch.dtype | None = None
    bucket_bytes: int = 128 * 2**20
    ns_flops_per_byte: float = 1e4
    overlap: bool = True
    time_phases: bool = False
    nonfinite: str = "raise"
    check_grads: bool = True
    overlap_backward: bool = False
    overlap_forward: bool = False

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
        rate = self.ns_flops_per_byte
        if (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not (math.isfinite(rate) and rate >= 0)
        ):
            raise ValueError(f"ns_flops_per_byte must be a finite number >= 0, got {rate!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        for name in ("overlap", "time_phases", "check_grads", "overlap_backward", "overlap_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")


OPTIMIZER_WIDE = tuple(f.name for f in dataclasses.fields(Options))

# The options every param group holds (defaults from the constructor's arguments; a group sets
# its own, an AdamW group's ``adamw_*`` as ``lr``, ``betas``, ``eps``, ``weight_decay``).
GROUP_OPTIONS = (
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "ns_steps",
    "ns_coefficients",
    "ns_algorithm",
    "eps",
    "adjust_lr_fn",
    "adamw_lr",
    "adamw_betas",
    "adamw_eps",
    "adamw_weight_decay",
    "flatten",
    "split_sizes",
    "num_heads",
    "variant",
    "normuon_beta2",
    "normuon_eps",
    "main_weights",
)


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
    ns_flops_per_byte: float  # the planner's link-to-flops ratio (``planner.ramp``)
    check_grads: bool
    nonfinite: str
    in_backward: bool  # steps start in backward (``dmuon_fsdp.backward``): its plan, groups, carrier
    in_forward: bool  # relays are finished in the next forward (``dmuon_fsdp.forward``): its plan
    structural: tuple[str, ...]  # ``structural_options()`` (variants are registered before optimizers)
    # each main weight held by one rank, by parameter ([Note: main weights], ``planning.main_homes``)
    homes: Mapping[Tensor, int] = dataclasses.field(default_factory=dict, compare=False)

    @classmethod
    def resolve(
        cls,
        options: Options,
        site: comm.ExchangeSite,
        device: torch.device,
        in_backward: bool,
        homes: Mapping[Tensor, int] | None = None,
    ) -> Settings:
        """``options`` for parameters on ``device`` (dtypes left None take the device's default)."""
        ns_dtype = options.ns_dtype or default_ns_dtype(device)
        comm_dtype = options.comm_dtype or ns_dtype
        checks = (options.check_grads, options.nonfinite)
        return cls(
            site,
            device,
            ns_dtype,
            comm_dtype,
            options.bucket_bytes,
            float(options.ns_flops_per_byte),
            *checks,
            in_backward,
            options.overlap_forward,
            structural_options(),
            homes or {},
        )

    @property
    def exchange_group(self) -> comm.ExchangeGroup:
        """The group the exchanges run on: the side group when some run outside ``step()``
        (begun in backward, or relays waited for in the next forward)."""
        return self.site.side if self.in_backward or self.in_forward else self.site.group


def check_lr(lr: Any) -> None:
    """An lr that is a tensor must hold one element (torch's rule)."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(lr.shape)}")


def _non_negative(group: dict[str, Any], *keys: str) -> None:
    check_lr(group["lr"])
    for key in keys:
        value = float(group[key])
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{key} must be a finite number >= 0, got {group[key]!r}")


def _check_main_weights(group: dict[str, Any]) -> None:
    if not isinstance(group["main_weights"], bool):
        raise ValueError(f"main_weights must be True or False, got {group['main_weights']!r}")


def check_muon_group(group: dict[str, Any]) -> None:
    _check_main_weights(group)
    _non_negative(group, "lr", "weight_decay", "eps")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {group['momentum']}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        fn = group["adjust_lr_fn"]
        raise ValueError(
            f"Adjust learning rate function {fn} is not supported (adjust_lr_fn: one of {ADJUST_LR_FNS})"
        )
    resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    if group["ns_algorithm"] not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {NS_ALGORITHMS}, got {group['ns_algorithm']!r}")
    split_sizes, num_heads = group["split_sizes"], group["num_heads"]
    if split_sizes is not None and num_heads is not None:
        raise ValueError("set at most one of split_sizes and num_heads")
    if split_sizes is not None and not (
        len(split_sizes) > 0
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in split_sizes)
    ):
        raise ValueError(f"split_sizes must be a non-empty list of positive integers, got {split_sizes!r}")
    if num_heads is not None and not (
        isinstance(num_heads, int) and not isinstance(num_heads, bool) and num_heads > 0
    ):
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not isinstance(group["flatten"], bool):
        raise ValueError(f"flatten must be True or False, got {group['flatten']!r}")
    if group["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {group['variant']!r}")
    for variant in VARIANTS.values():  # every variant's options are in every Muon group
        if variant is not None:
            variant.check(group)


def check_groups(groups: list[dict[str, Any]], first_index: int = 0) -> None:
    """Check the options of param groups (numbered from ``first_index``); an error names its group."""
    for index, group in enumerate(groups, start=first_index):
        try:
            (check_muon_group if group["use_muon"] else check_adamw_group)(group)
        except ValueError as e:
            raise ValueError(f"param group {index}: {e}") from None


def check_adamw_group(group: dict[str, Any]) -> None:
    _check_main_weights(group)
    _non_negative(group, "lr", "weight_decay", "eps")
    betas = group["betas"]
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamW betas must be two numbers in [0, 1), got {betas}")
