"""Newton-Schulz forms on real momentum matrices: error against float64 standard Newton-Schulz.

Reads every momentum buffer of a recipe checkpoint (written at any world size; read here in one
process) and prints, per coefficient set, NS dtype and matrix shape, the largest relative error
over the matrices of that shape of the standard form and of the Gram form (its default restarts,
``newton_schulz.gram_segments``), and their ratio. With --search N it ranks every restart
placement of N iterations (2^(N-1) of them) by the worst ratio over shapes, in --dtype: the
evidence behind ``gram_segments``.

    torchrun --standalone --nproc-per-node 2 -m recipes.pretrain --preset cpu-demo --optimizer dmuon \\
        --run-dir runs/ns-momentum --save-every 100 --overwrite
    python -m benchmarks.ns_accuracy runs/ns-momentum/checkpoints/step_0000100
    python -m benchmarks.ns_accuracy runs/ns-momentum/checkpoints/step_0000100 --search 5 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from dmuon_fsdp.newton_schulz import (
    NAMED_COEFFICIENTS,
    Workspace,
    gram_segments,
    orthogonalize_,
    resolve_coefficients,
    segments_flops,
    standard_segments,
)


def momentum_by_shape(checkpoint: Path) -> dict[tuple[int, int], list[torch.Tensor]]:
    """The checkpoint's 2-D momentum buffers (float64), grouped by shape."""
    if not (checkpoint / ".metadata").is_file():
        raise SystemExit(f"error: {checkpoint} is not a complete checkpoint (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(checkpoint, Path(tmp) / "state.pt")
        state = torch.load(Path(tmp) / "state.pt", weights_only=False)
    found = defaultdict(list)
    for optimizer in state["optimizers"]:
        for entry in optimizer["state"].values():
            buffer = entry.get("momentum_buffer") if isinstance(entry, dict) else None
            if buffer is not None and buffer.ndim == 2:
                found[tuple(buffer.shape)].append(buffer.double())
    if not found:
        raise SystemExit(f"error: {checkpoint} holds no 2-D momentum buffers (a DMuonFSDP or Muon run's?)")
    return dict(found)


def orthogonalized(m: torch.Tensor, triples, dtype: torch.dtype, segments) -> torch.Tensor:
    """``m`` through Newton-Schulz run as ``segments`` in ``dtype`` (wide side last, as the optimizer)."""
    x = (m.mT if m.shape[0] > m.shape[1] else m).to(dtype, copy=True).contiguous().unsqueeze(0)
    orthogonalize_(x, triples, 1e-7, Workspace.for_stack(x, segments), segments)
    return x[0].double()


def errors(
    matrices: list[torch.Tensor], triples, dtype: torch.dtype, forms: list[tuple[int, ...]]
) -> list[float]:
    """Per form, the largest relative error over ``matrices`` against float64 standard NS."""
    worst = [0.0] * len(forms)
    for m in matrices:
        expected = orthogonalized(m, triples, torch.float64, standard_segments(len(triples)))
        for i, segments in enumerate(forms):
            got = orthogonalized(m, triples, dtype, segments)
            worst[i] = max(worst[i], ((got - expected).norm() / expected.norm()).item())
    return worst


def table(shapes: dict, args: argparse.Namespace) -> list[dict]:
    rows = []
    print(
        "| coefficients | NS dtype | shape | matrices | standard error | Gram segments | Gram error | Gram "
        "/ standard |"
    )
    print("|---|---|---|---:|---:|---|---:|---:|")
    for name in args.coefficients:
        triples = resolve_coefficients(name, args.ns_steps)
        for dtype in args.dtypes:
            segments = gram_segments(triples, dtype)
            for shape, matrices in shapes.items():
                standard, gram = errors(
                    matrices, triples, dtype, [standard_segments(args.ns_steps), segments]
                )
                rows.append(
                    {
                        "coefficients": name,
                        "dtype": str(dtype),
                        "shape": shape,
                        "matrices": len(matrices),
                        "standard": standard,
                        "segments": segments,
                        "gram": gram,
                    }
                )
                print(
                    f"| {name} | {str(dtype)[6:]} | {shape[0]} x {shape[1]} | {len(matrices)} | "
                    f"{standard:.2e} | "
                    f"{segments} | {gram:.2e} | {gram / standard:.2f} |",
                    flush=True,
                )
    return rows


def search(shapes: dict, args: argparse.Namespace) -> list[dict]:
    """Every grouping of ``args.search`` iterations into segments, ranked by the worst ratio."""
    n, dtype = args.search, args.dtypes[0]
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
            standard, *grams = errors(matrices, triples, dtype, [standard_segments(n), *forms])
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
    parser.add_argument("checkpoint", type=Path, help="a recipe checkpoint directory (checkpoints/step_N)")
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
    args.dtypes = [getattr(torch, d) for d in args.dtypes]
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = momentum_by_shape(args.checkpoint)
    print(f"## Newton-Schulz error against float64, momentum of {args.checkpoint}\n")
    result = (
        {"checkpoint": str(args.checkpoint), "search": search(shapes, args)}
        if args.search
        else {"checkpoint": str(args.checkpoint), "table": table(shapes, args)}
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
