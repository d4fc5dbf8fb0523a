"""Newton-Schulz orthogonalization: pure math on local tensors, no communication.

Muon replaces a matrix's momentum M by an approximation of its polar factor U V^T (M = U S V^T),
computed with odd matrix polynomials X <- a X + b (X X^T) X + c (X X^T)^2 X after a Frobenius
normalisation that puts every singular value in [0, 1].
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

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
    """bf16 where matmuls are fast in it (CUDA), fp32 elsewhere (bf16 is ~40x slower on CPUs)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def newton_schulz(
    matrices: Tensor, coefficients: Sequence[Coefficients], eps: float, dtype: torch.dtype
) -> Tensor:
    """Orthogonalize a batch of matrices (B, m, n), or one matrix (m, n), in ``dtype``.

    Tall matrices are transposed so the Gram matrix is the smaller side; each matrix is divided
    by max(its Frobenius norm, eps). Returns a new tensor of the input's shape in ``dtype``.
    """
    x = matrices.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp_min(eps)
    squeeze = x.ndim == 2
    if squeeze:
        x = x.unsqueeze(0)
    for a, b, c in coefficients:
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if squeeze:
        x = x.squeeze(0)
    return x.mT if tall else x


def newton_schulz_flops(rows: int, cols: int, ns_steps: int) -> int:
    """Multiply-add flops of ``newton_schulz`` on one rows x cols matrix."""
    s, l = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * s * s * l + 2 * s * s * s)


def orthogonalize_all(
    matrices: dict[int, Tensor],
    settings: Callable[[int], tuple[tuple[Coefficients, ...], float]],
    dtype: torch.dtype,
) -> dict[int, Tensor]:
    """Orthogonalize every matrix, one batched ``newton_schulz`` per (shape, coefficients, eps);
    ``settings(j)`` gives matrix j's per-iteration coefficients and eps."""
    batches: dict[tuple, list[int]] = defaultdict(list)
    for j, matrix in matrices.items():
        batches[(tuple(matrix.shape), *settings(j))].append(j)
    results: dict[int, Tensor] = {}
    for (_, coefficients, eps), indices in batches.items():
        out = newton_schulz(torch.stack([matrices[j] for j in indices]), coefficients, eps, dtype)
        results.update(zip(indices, out.unbind(0)))
    return results
