"""Newton-Schulz orthogonalization: pure math on local tensors, no communication.

Muon replaces a matrix's momentum M by an approximation of its polar factor U V^T (M = U S V^T),
computed with odd matrix polynomials X <- a X + b (X X^T) X + c (X X^T)^2 X after a Frobenius
normalisation that puts every singular value in [0, 1].

Two forms of the same iteration, for an s x l matrix (s <= l): the standard one forms X X^T from
X at every iteration, 2 s^2 l + s^3 multiply-adds each; the Gram form (Gram Newton-Schulz) keeps
R = X X^T and the product Z of the iteration polynomials as s x s matrices and multiplies by X
once at the end, so its l-wide work is per segment of iterations rather than per iteration. It
pays for wide matrices (l / s above about 1.5 at five iterations) and gains nothing on square
ones; ``ns_segments`` picks the form and ``gram_segments`` where it restarts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

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
    single = _as_triple(items)
    parsed: list[Coefficients | None] = [single] if single is not None else [_as_triple(t) for t in items]
    triples = [t for t in parsed if t is not None]
    if not triples or len(triples) < len(parsed):
        raise ValueError(
            "ns_coefficients must be a name, an (a, b, c) triple of finite numbers or a non-empty "
            f"list of such triples, got {ns_coefficients!r}"
        )
    if not all(math.isfinite(x) for t in triples for x in t):
        raise ValueError(f"ns_coefficients must be finite, got {ns_coefficients!r}")
    return tuple(triples[min(i, len(triples) - 1)] for i in range(ns_steps))


def _is_real(x: object) -> TypeGuard[int | float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_triple(t: object) -> Coefficients | None:
    """``t`` as an (a, b, c) triple of floats; None unless it is a sequence of three real numbers."""
    if isinstance(t, Sequence) and len(t) == 3:
        a, b, c = t
        if _is_real(a) and _is_real(b) and _is_real(c):
            return (float(a), float(b), float(c))
    return None


def default_ns_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA, fp32 elsewhere. CPU matmul speed in bf16 depends on the CPU: with
    AVX512-BF16 or AMX it can beat fp32 (212 vs 90 GFLOP/s measured on one such core), without
    them it is many times slower; measure before passing ``ns_dtype=torch.bfloat16`` on a CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


NS_ALGORITHMS = ("standard", "gram", "auto")  # the forms ``ns_segments`` knows (``config`` lists it)

# Gram segments in 4-byte and wider dtypes end before an R update would grow R's rounding noise
# (negative eigenvalues of a rank-deficient X X^T, amplified by about a^2 per update) past this
# many times fp32's eps (scaled by the dtype's eps). Measured on momentum matrices of a cpu-demo
# training run (benchmarks/ns_accuracy.py): fp32 errors within 2.3e-5 of float64 at five, six and
# eight iterations, Keller and Polar Express (standard: 1.3e-5), against up to 1e-3 without
# restarts.
GRAM_NOISE_BUDGET = 420.0


def standard_segments(ns_steps: int) -> tuple[int, ...]:
    """The standard form as segments: every iteration is its own (X X^T formed from X each time)."""
    return (1,) * ns_steps


def gram_segments(coefficients: Sequence[Coefficients], dtype: torch.dtype) -> tuple[int, ...]:
    """Iterations per segment of Gram Newton-Schulz in ``dtype``: each segment starts from an
    explicit X (a restart) and multiplies by X once at its end; a segment of one iteration is
    a standard iteration.

    In 2-byte dtypes the Gram iteration amplifies R's rounding noise within a few updates, so
    only the first two and the last two iterations run as Gram pairs, the rest in standard form,
    and fewer than five iterations run all standard. Measured on the momentum matrices of a
    cpu-demo training run (benchmarks/ns_accuracy.py): of every restart placement of five
    iterations, (2, 1, 2) is the cheapest whose bf16 error stays within 1.1x of standard
    Newton-Schulz's with Keller's and Polar Express coefficients (the equally cheap (2, 2, 1)
    reaches 1.4x, no restart 100x to 10^12x); the same rule stays within 1.1x at six and eight. Wider
    dtypes restart only when ``GRAM_NOISE_BUDGET`` would be exceeded.
    """
    n = len(coefficients)
    if dtype.itemsize <= 2:
        return (2,) + (1,) * (n - 4) + (2,) if n >= 5 else standard_segments(n)
    limit = GRAM_NOISE_BUDGET / torch.finfo(dtype).eps * torch.finfo(torch.float32).eps
    segments, length, growth = [], 1, 1.0
    for a, _, _ in coefficients[:-1]:
        growth *= a * a
        if growth > limit:
            segments.append(length)
            length, growth = 1, 1.0
        else:
            length += 1
    return (*segments, length)


def segments_flops(rows: int, cols: int, segments: Sequence[int]) -> int:
    """Flops (2 per multiply-add) of Newton-Schulz on one rows x cols matrix run as ``segments``: per
    segment of k iterations two s x l products (X X^T and the final Z X) and 4k - 3 s x s ones."""
    s, l = min(rows, cols), max(rows, cols)
    return sum(4 * s * s * l + 2 * s**3 * (4 * k - 3) for k in segments)


def ns_segments(
    algorithm: str, coefficients: Sequence[Coefficients], dtype: torch.dtype, rows: int, cols: int
) -> tuple[int, ...]:
    """The segments a rows x cols matrix runs: ``"standard"``, ``"gram"``, or ``"auto"`` (the
    form with fewer flops for this shape; the standard one on a tie, e.g. square matrices)."""
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm must be one of {NS_ALGORITHMS}, got {algorithm!r}")
    standard = standard_segments(len(coefficients))
    if algorithm == "standard":
        return standard
    gram = gram_segments(coefficients, dtype)
    if algorithm == "gram" or segments_flops(rows, cols, gram) < segments_flops(rows, cols, standard):
        return gram
    return standard


@dataclass(frozen=True)
class Workspace:
    """Scratch for ``orthogonalize_`` on one (B, s, l) stack: the other iterate ``y`` and s x s
    matrices (two for the standard form, four with Gram segments), and the transposed views of
    the stack and of ``y`` (made once: a view is an op each time it is made). Several stacks'
    workspaces may share buffers (views of the same ones) when they never run at the same time."""

    y: Tensor
    squares: tuple[Tensor, ...]
    stack_t: Tensor
    y_t: Tensor

    @staticmethod
    def squares_needed(segments: Sequence[int]) -> int:
        return 4 if max(segments) > 1 else 2

    @classmethod
    def sizes(cls, shape: Sequence[int], segments: Sequence[int]) -> tuple[int, int]:
        """Elements of ``y`` and of all the s x s matrices for a (B, s, l) stack."""
        b, s, l = shape
        return b * s * l, b * s * s * cls.squares_needed(segments)

    @classmethod
    def for_stack(
        cls, stack: Tensor, segments: Sequence[int], flat: tuple[Tensor, Tensor] | None = None
    ) -> Workspace:
        """Views of ``flat`` (two 1-D buffers at least ``sizes`` long) or new tensors."""
        b, s, l = stack.shape
        y_size, squares_size = cls.sizes(stack.shape, segments)
        if flat is None:
            flat = stack.new_empty(y_size), stack.new_empty(squares_size)
        squares = flat[1][:squares_size].view(cls.squares_needed(segments), b, s, s)
        y = flat[0][:y_size].view(b, s, l)
        return cls(y, tuple(squares), stack.mT, y.mT)


def orthogonalize_(
    x: Tensor, coefficients: Sequence[Coefficients], eps: float, work: Workspace, segments: Sequence[int]
) -> Tensor:
    """Newton-Schulz in place on a stack ``x`` of shape (B, s, l), s <= l, in its own dtype.

    Each matrix is divided by max(its Frobenius norm, eps), then each (a, b, c) applies
    X <- Q X with Q = a I + b A + c A^2, A = X X^T, grouped into ``segments`` (see
    ``_segment``; ``standard_segments`` for the usual form). Iterates alternate between ``x``
    and ``work.y`` (the normalisation writes to ``y`` when the segment count is odd) so that the
    result lands in ``x``; nothing is allocated but the norms.
    """
    if sum(segments) != len(coefficients) or min(segments) < 1:
        raise ValueError(f"segments {tuple(segments)} do not split {len(coefficients)} iterations")
    if work.stack_t.data_ptr() != x.data_ptr() or work.stack_t.shape != (
        *x.shape[:-2],
        x.shape[-1],
        x.shape[-2],
    ):
        raise ValueError("the workspace was made for another stack (Workspace.for_stack)")
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min_(eps)
    here, there = (x, work.stack_t), (work.y, work.y_t)
    if len(segments) % 2:
        torch.div(x, norm, out=work.y)
        here, there = there, here
    else:
        x.div_(norm)
    start = 0
    for length in segments:
        _segment(*here, there[0], coefficients[start : start + length], work.squares)
        start += length
        here, there = there, here
    return x


def _segment(
    x: Tensor, x_t: Tensor, out: Tensor, coefficients: Sequence[Coefficients], squares: tuple[Tensor, ...]
) -> None:
    """out <- Q_k ... Q_1 x. One iteration: the standard step a X + (b A + c A^2) X. Several:
    Gram Newton-Schulz, which never forms the iterates between: with R = X X^T, each Q is a
    polynomial in R, R <- Q R Q and Z <- Q Z, and out = Z x at the end. Q's identity part is
    applied through ``beta`` rather than added to a rounded matrix, except in the first Z."""
    r, p = squares[:2]
    torch.bmm(x, x_t, out=r)
    if len(coefficients) == 1:
        a, b, c = coefficients[0]
        torch.baddbmm(r, r, r, beta=b, alpha=c, out=p)
        torch.baddbmm(x, p, x, beta=a, out=out)
        return
    z, t = squares[2:]
    for k, (a, b, c) in enumerate(coefficients):
        torch.baddbmm(r, r, r, beta=b, alpha=c, out=p)  # P = b R + c R^2, Q = a I + P
        if k < len(coefficients) - 1:
            torch.baddbmm(r, p, r, beta=a, out=t)  # T = Q R
            torch.baddbmm(t, t, p, beta=a, out=r)  # R = T Q
        if k == 0:
            z, p = p, z
            z.diagonal(dim1=-2, dim2=-1).add_(a)  # Z = Q
        else:
            torch.baddbmm(z, p, z, beta=a, out=t)  # Z <- Q Z
            z, t = t, z
    torch.bmm(z, x, out=out)


def newton_schulz(
    matrices: Tensor,
    coefficients: Sequence[Coefficients],
    eps: float,
    dtype: torch.dtype,
    algorithm: str = "standard",
) -> Tensor:
    """Orthogonalize a batch of matrices (B, m, n), or one matrix (m, n), in ``dtype``, in the
    form ``algorithm`` picks for their shape (see ``ns_segments``).

    Tall matrices are transposed so the Gram matrix is the smaller side; each matrix is divided
    by max(its Frobenius norm, eps). Returns a new tensor of the input's shape in ``dtype``.
    """
    x = matrices.unsqueeze(0) if matrices.ndim == 2 else matrices
    tall = x.shape[-2] > x.shape[-1]
    stack = (x.mT if tall else x).to(dtype, copy=True).contiguous()
    segments = ns_segments(algorithm, coefficients, dtype, *stack.shape[-2:])
    orthogonalize_(stack, coefficients, eps, Workspace.for_stack(stack, segments), segments)
    out = stack.mT if tall else stack
    return out.squeeze(0) if matrices.ndim == 2 else out
