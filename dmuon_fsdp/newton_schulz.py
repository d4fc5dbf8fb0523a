"""Newton-Schulz orthogonalization: pure math on local tensors, no communication.

Muon replaces a matrix's momentum M by an approximation of its polar factor U V^T (M = U S V^T),
computed with odd matrix polynomials X <- a X + b (X X^T) X + c (X X^T)^2 X after a Frobenius
normalisation that puts every singular value in [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Coefficients = tuple[float, float, float]

MUON_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)

# Degree-5 Polar Express polynomials (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932), before
# their safety factor.
_POLAR_EXPRESS_RAW: tuple[Coefficients, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)


def _scaled(coefficients: Coefficients, factor: float) -> Coefficients:
    """The coefficients of p(x / factor) for p(x) = a x + b x^3 + c x^5."""
    a, b, c = coefficients
    return (a / factor, b / factor**3, c / factor**5)


def _polar_express(safety: float = 1.01) -> tuple[Coefficients, ...]:
    # The paper shrinks every polynomial but the last by `safety` and also divides the input by
    # `safety` times its Frobenius norm; that second division is folded into the first polynomial
    # so the plain Frobenius normalisation used here runs the paper's iteration.
    shrunk = [_scaled(c, safety) for c in _POLAR_EXPRESS_RAW[:-1]] + [_POLAR_EXPRESS_RAW[-1]]
    shrunk[0] = _scaled(shrunk[0], safety)
    return tuple(shrunk)


POLAR_EXPRESS: tuple[Coefficients, ...] = _polar_express()
"""Per-iteration Polar Express coefficients; pass as ``ns_coefficients=POLAR_EXPRESS`` (or the
string ``"polar_express"``). Iterations past the eighth reuse the last triple."""

NAMED_COEFFICIENTS: dict[str, Coefficients | tuple[Coefficients, ...]] = {
    "muon": MUON_COEFFICIENTS,
    "polar_express": POLAR_EXPRESS,
}


def resolve_coefficients(
    ns_coefficients: str | Sequence[float] | Sequence[Sequence[float]], ns_steps: int
) -> tuple[Coefficients, ...]:
    """Expand ``ns_coefficients`` into one (a, b, c) triple per iteration.

    Accepts a name from ``NAMED_COEFFICIENTS``, one triple used for all ``ns_steps`` iterations,
    or a list of per-iteration triples: iteration i uses triple i, and iterations past the end
    of the list reuse its last triple.
    """
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be a positive integer, got {ns_steps!r}")
    if isinstance(ns_coefficients, str):
        if ns_coefficients not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"unknown ns_coefficients {ns_coefficients!r}; known: {sorted(NAMED_COEFFICIENTS)}"
            )
        ns_coefficients = NAMED_COEFFICIENTS[ns_coefficients]
    items = list(ns_coefficients)
    if len(items) == 3 and all(_is_real(x) for x in items):
        triples = [tuple(float(x) for x in items)]
    elif items and all(_is_triple(t) for t in items):
        triples = [tuple(float(x) for x in t) for t in items]
    else:
        raise ValueError(
            "ns_coefficients must be a name, an (a, b, c) triple of finite numbers or a non-empty "
            f"list of such triples, got {ns_coefficients!r}"
        )
    if not all(math.isfinite(x) for t in triples for x in t):
        raise ValueError(f"ns_coefficients must be finite, got {ns_coefficients!r}")
    return tuple(triples[min(i, len(triples) - 1)] for i in range(ns_steps))  # type: ignore[misc]


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_triple(t: object) -> bool:
    return isinstance(t, Sequence) and len(t) == 3 and all(_is_real(x) for x in t)


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere. CPU matmul speed in bf16 depends on the CPU: with
    AVX512-BF16 or AMX it can beat fp32 (212 vs 90 GFLOP/s measured on one such core), without
    them it is many times slower; measure before passing ``ns_dtype=torch.bfloat16`` on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class Workspace:
    """Scratch for ``orthogonalize_`` on a (B, s, l) stack: the other iterate ``y`` and the s x s
    products. Several stacks may share one (views of the same buffers) when they never run at
    the same time."""

    y: Tensor
    gram: Tensor
    poly: Tensor

    @classmethod
    def for_stack(cls, stack: Tensor, flat: tuple[Tensor, Tensor, Tensor] | None = None) -> Workspace:
        """Views of ``flat`` (three 1-D buffers, large enough) or new tensors, shaped for ``stack``."""
        b, s, l = stack.shape
        shapes = ((b, s, l), (b, s, s), (b, s, s))
        if flat is None:
            return cls(*(stack.new_empty(shape) for shape in shapes))
        return cls(*(buf[: math.prod(shape)].view(shape) for buf, shape in zip(flat, shapes)))


def orthogonalize_(x: Tensor, coefficients: Sequence[Coefficients], eps: float, work: Workspace) -> Tensor:
    """Newton-Schulz in place on a stack ``x`` of shape (B, s, l), s <= l, in its own dtype.

    Each matrix is divided by max(its Frobenius norm, eps), then each (a, b, c) runs
    X <- a X + (b A + c A^2) X with A = X X^T. Iterates alternate between ``x`` and ``work.y``
    (the normalisation writes to ``y`` when the iteration count is odd) so that the result
    lands in ``x``; nothing is allocated but the norms.
    """
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min_(eps)
    here, there = (x, x.mT), (work.y, work.y.mT)
    if len(coefficients) % 2:
        torch.div(x, norm, out=work.y)
        here, there = there, here
    else:
        x.div_(norm)
    for a, b, c in coefficients:
        src, src_t = here
        torch.bmm(src, src_t, out=work.gram)
        torch.baddbmm(work.gram, work.gram, work.gram, beta=b, alpha=c, out=work.poly)
        torch.baddbmm(src, work.poly, src, beta=a, out=there[0])
        here, there = there, here
    return x


def newton_schulz(
    matrices: Tensor, coefficients: Sequence[Coefficients], eps: float, dtype: torch.dtype
) -> Tensor:
    """Orthogonalize a batch of matrices (B, m, n), or one matrix (m, n), in ``dtype``.

    Tall matrices are transposed so the Gram matrix is the smaller side; each matrix is divided
    by max(its Frobenius norm, eps). Returns a new tensor of the input's shape in ``dtype``.
    """
    x = matrices.unsqueeze(0) if matrices.ndim == 2 else matrices
    tall = x.shape[-2] > x.shape[-1]
    stack = (x.mT if tall else x).to(dtype, copy=True).contiguous()
    orthogonalize_(stack, coefficients, eps, Workspace.for_stack(stack))
    out = stack.mT if tall else stack
    return out.squeeze(0) if matrices.ndim == 2 else out


def newton_schulz_flops(rows: int, cols: int, ns_steps: int) -> int:
    """Multiply-add flops of ``newton_schulz`` on one rows x cols matrix."""
    s, l = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * s * s * l + 2 * s * s * s)
