"""Newton-Schulz forms on real momentum matrices: error against float64 standard Newton-Schulz.

Reads every momentum buffer of one or more recipe checkpoints (written at any world size; read
here in one process) and prints, per checkpoint (labelled by --stages, e.g. early and late),
coefficient set, NS dtype and matrix shape, the relative Frobenius error against float64
standard NS, worst and median over the matrices of that shape, of three forms: the standard
one; the Gram form (its default restarts, ``newton_schulz.gram_segments``); and the form
``ns_algorithm="auto"`` runs for that shape (``newton_schulz.ns_segments``: Gram where it
needs fewer flops, the wide and tall matrices; standard on square ones), with the ratios of the
worst (and of the median) errors to the standard form's. The last lines give, per stage,
coefficient set and dtype, the largest auto / standard ratio over the shapes; the JSON also
holds every matrix's errors. With --search N it ranks every restart placement of N
iterations (2^(N-1) of them) by the worst ratio over shapes (and checkpoints), in the first
--dtypes: the evidence behind ``gram_segments``.

    torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --optimizer dmuon \\
        --run-dir runs/ns-momentum --save-every 100 --overwrite
    python -m benchmarks.ns_accuracy runs/ns-momentum/checkpoints/step_0000100
    python -m benchmarks.ns_accuracy runs/ns-momentum/checkpoints/step_0000100 --search 5 --dtypes bfloat16

Llama-3-like MLP matrices (3.5:1: 448 x 128) come from the same recipe with ``--ffn-dim 448``
(``--ns-dtype bfloat16`` trains with the CUDA default's NS dtype on a CPU); an early and a late
checkpoint side by side:

    torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --ffn-dim 448 \\
        --optimizer dmuon --run-dir runs/ns-momentum-mlp35 --save-every 100 --overwrite
    python -m benchmarks.ns_accuracy runs/ns-momentum-mlp35/checkpoints/step_0000{100,400} \\
        --stages early late --coefficients muon
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon_fsdp.newton_schulz import (
    NAMED_COEFFICIENTS,
    Coefficients,
    Workspace,
    gram_segments,
    ns_segments,
    orthogonalize_,
    resolve_coefficients,
    segments_flops,
    standard_segments,
)

Shape = tuple[int, int]
Segments = tuple[int, ...]


def momentum_by_shape(checkpoint: Path) -> dict[Shape, list[torch.Tensor]]:
    """The checkpoint's 2-D momentum buffers (float64), grouped by shape."""
    if not (checkpoint / ".metadata").is_file():
        raise SystemExit(f"error: {checkpoint} is not a complete checkpoint (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    found: dict[Shape, list[torch.Tensor]] = defaultdict(list)
    for optimizer in state["optimizers"]:
        for entry in optimizer["state"].values():
            buffer = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if buffer is not None and buffer.ndim == 2:
                found[(buffer.shape[0], buffer.shape[1])].append(buffer.double())
    if not found:
        raise SystemExit(f"error: {checkpoint} holds no 2-D momentum buffers (a DMuonFSDP or Muon run's?)")
    return dict(found)


def stage_label(checkpoint: Path) -> str:
    """A checkpoint's default label: ``step N`` for the recipe's ``step_000000N``, else its name."""
    match = re.fullmatch(r"step_0*(\d+)", checkpoint.name)
    return f"step {match.group(1)}" if match else checkpoint.name


def orthogonalized(
    m: torch.Tensor, triples: Sequence[Coefficients], dtype: torch.dtype, segments: Segments
) -> torch.Tensor:
    """``m`` through Newton-Schulz run as ``segments`` in ``dtype`` (wide side last, as the optimizer)."""
    x = (m.mT if m.shape[0] > m.shape[1] else m).to(dtype, copy=True).contiguous().unsqueeze(0)
    orthogonalize_(x, triples, 1e-7, Workspace.for_stack(x, segments), segments)
    return x[0].double()


def errors(
    matrices: list[torch.Tensor], triples: Sequence[Coefficients], dtype: torch.dtype, forms: list[Segments]
) -> list[list[float]]:
    """Per form, the relative Frobenius error of each of ``matrices`` against float64 standard NS
    (a form listed twice is computed once)."""
    per_form: dict[Segments, list[float]] = {segments: [] for segments in forms}
    for m in matrices:
        expected = orthogonalized(m, triples, torch.float64, standard_segments(len(triples)))
        for segments, found in per_form.items():
            got = orthogonalized(m, triples, dtype, segments)
            found.append(((got - expected).norm() / expected.norm()).item())
    return [per_form[segments] for segments in forms]


def table(checkpoints: dict[str, dict[Shape, list[torch.Tensor]]], args: argparse.Namespace) -> list[dict]:
    """Standard, Gram and auto errors per stage, coefficients, dtype and shape; prints a table."""
    rows = []
    print(
        "| stage | coefficients | NS dtype | shape | matrices | standard error | Gram segments | Gram error "
        "| Gram / standard | auto segments | auto error | auto / standard | standard median | auto median "
        "| median auto / standard |"
    )
    print("|---|---|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for stage, shapes in checkpoints.items():
        for name in args.coefficients:
            triples = resolve_coefficients(name, args.ns_steps)
            for dtype in args.dtypes:
                segments = gram_segments(triples, dtype)
                for shape, matrices in shapes.items():
                    auto = ns_segments("auto", triples, dtype, *shape)
                    per_matrix = errors(
                        matrices, triples, dtype, [standard_segments(args.ns_steps), segments, auto]
                    )
                    standard, gram, auto_error = (max(e) for e in per_matrix)
                    medians = [statistics.median(e) for e in per_matrix]
                    row = {
                        "stage": stage,
                        "checkpoint": args.paths[stage],
                        "coefficients": name,
                        "dtype": str(dtype),
                        "shape": shape,
                        "matrices": len(matrices),
                        "standard": standard,
                        "segments": segments,
                        "gram": gram,
                        "auto_segments": auto,
                        "auto": auto_error,
                        "standard_median": medians[0],
                        "gram_median": medians[1],
                        "auto_median": medians[2],
                        "per_matrix": dict(zip(("standard", "gram", "auto"), per_matrix, strict=True)),
                    }
                    rows.append(row)
                    print(
                        f"| {stage} | {name} | {str(dtype)[6:]} | {shape[0]} x {shape[1]} | {len(matrices)} "
                        f"| {standard:.2e} | {segments} | {gram:.2e} | {gram / standard:.2f} | "
                        f"{'standard' if auto == standard_segments(args.ns_steps) else auto} | "
                        f"{auto_error:.2e} | {auto_error / standard:.2f} | {medians[0]:.2e} | "
                        f"{medians[2]:.2e} | {medians[2] / medians[0]:.2f} |",
                        flush=True,
                    )
    print_worst_auto(rows)
    return rows


def print_worst_auto(rows: list[dict]) -> None:
    """Per stage, coefficients and dtype, the largest auto / standard ratio over the shapes of
    ``rows``: of the worst errors, and of the median errors."""
    worst: dict[tuple[str, str, str], list[tuple[float, Shape]]] = {}
    for r in rows:
        ratios = [
            (r["auto"] / r["standard"], r["shape"]),
            (r["auto_median"] / r["standard_median"], r["shape"]),
        ]
        key = (r["stage"], r["coefficients"], r["dtype"])
        worst[key] = [max(pair) for pair in zip(worst.get(key, ratios), ratios, strict=True)]
    print(
        "\n| stage | coefficients | NS dtype | largest auto / standard (worst errors) | at shape "
        "| largest auto / standard (median errors) | at shape |"
    )
    print("|---|---|---|---:|---|---:|---|")
    for (stage, name, dtype), ((ratio, shape), (median, at)) in worst.items():
        print(
            f"| {stage} | {name} | {dtype[6:]} | {ratio:.2f} | {shape[0]} x {shape[1]} | {median:.2f} "
            f"| {at[0]} x {at[1]} |"
        )


def search(checkpoints: dict[str, dict[Shape, list[torch.Tensor]]], args: argparse.Namespace) -> list[dict]:
    """Every grouping of ``args.search`` iterations into segments, ranked by the worst ratio over
    the shapes of every checkpoint."""
    n, dtype = args.search, args.dtypes[0]
    shapes = {
        (shape if len(checkpoints) == 1 else f"{stage}: {shape}"): matrices
        for stage, by_shape in checkpoints.items()
        for shape, matrices in by_shape.items()
    }
    forms = [
        tuple(b - a for a, b in itertools.pairwise((0, *cuts, n)))
        for k in range(n)
        for cuts in itertools.combinations(range(1, n), k)
    ]
    rows = []
    for name in args.coefficients:
        triples = resolve_coefficients(name, n)
        ratios = defaultdict(list)
        for matrices in shapes.values():
            per_matrix = errors(matrices, triples, dtype, [standard_segments(n), *forms])
            standard, *grams = (max(e) for e in per_matrix)
            for segments, gram in zip(forms, grams, strict=True):
                ratios[segments].append(gram / standard)
        default = gram_segments(triples, dtype)
        ranked = sorted(forms, key=lambda f: max(ratios[f]))
        print(
            f"\n## {name}, {n} iterations, {dtype}: worst Gram / standard error over shapes "
            f"{list(shapes)}; flops relative to standard at l = 2.75 s (an MLP matrix)\n"
        )
        print("| rank | segments | worst ratio | per shape | flops / standard | |")
        print("|---:|---|---:|---|---:|---|")
        for place, segments in enumerate(ranked, 1):
            rows.append(
                {"coefficients": name, "segments": segments, "ratios": ratios[segments], "rank": place}
            )
            if place > args.top and segments != default:
                continue
            cost = segments_flops(4, 11, segments) / segments_flops(4, 11, standard_segments(n))
            per_shape = " ".join(f"{r:.2f}" for r in ratios[segments])
            print(
                f"| {place} | {segments} | {max(ratios[segments]):.2f} | {per_shape} | {cost:.2f} | "
                f"{'default' if segments == default else ''} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoints",
        type=Path,
        nargs="+",
        metavar="checkpoint",
        help="recipe checkpoint directories (checkpoints/step_N), e.g. an early and a late one",
    )
    parser.add_argument(
        "--stages",
        nargs="+",
        default=None,
        help="a label per checkpoint, e.g. early late (default: step N from the directory name)",
    )
    parser.add_argument(
        "--coefficients", nargs="+", default=list(NAMED_COEFFICIENTS), choices=list(NAMED_COEFFICIENTS)
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=["bfloat16", "float16", "float32"],
        help="NS dtypes (--search uses the first)",
    )
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument(
        "--search", type=int, default=0, metavar="N", help="rank every restart placement of N iterations"
    )
    parser.add_argument(
        "--top", type=int, default=8, help="rows of --search printed (and the default's; the JSON has all)"
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("runs/bench/ns_accuracy.json"))
    args = parser.parse_args()
    stages = args.stages or [stage_label(c) for c in args.checkpoints]
    if len(stages) != len(args.checkpoints) or len(set(stages)) != len(stages):
        parser.error(f"--stages takes one distinct label per checkpoint ({len(args.checkpoints)} given)")
    args.paths = {stage: str(c) for stage, c in zip(stages, args.checkpoints, strict=True)}
    args.dtypes = [getattr(torch, d) for d in args.dtypes]
    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoints = {stage: momentum_by_shape(c) for stage, c in zip(stages, args.checkpoints, strict=True)}
    named = ", ".join(f"{stage} ({path})" for stage, path in args.paths.items())
    print(f"## Newton-Schulz error against float64, momentum of {named}\n")
    result: dict = {
        "checkpoint": str(args.checkpoints[0]),
        "checkpoints": [{"stage": stage, "path": path} for stage, path in args.paths.items()],
    }
    if args.search:
        result["search"] = search(checkpoints, args)
    else:
        result["table"] = table(checkpoints, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
