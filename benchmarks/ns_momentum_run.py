"""``recipes.pretrain`` with one more preset and an NS dtype flag, for Newton-Schulz accuracy checks.

Llama-3 8B's MLP matrices are 4096 x 14336 (3.5:1); the cpu-demo preset's are 128 x 352
(2.75:1), and the recipe has no flag for the MLP width. This registers ``cpu-demo-mlp35``
(cpu-demo with ``ffn_dim=448``: 128 x 448, 3.5:1; attention q/o stay 128 x 128, k/v 64 x 128)
and runs the recipe unchanged on it, every flag included, so the checkpoints hold the momentum
buffers of a real DMuonFSDP (or torch Muon) training run for ``benchmarks.ns_accuracy``:

    torchrun --standalone --nproc-per-node 2 -m benchmarks.ns_momentum_run --preset cpu-demo-mlp35 \\
        --optimizer dmuon --run-dir runs/ns-momentum-mlp35 --save-every 100 --overwrite
    python -m benchmarks.ns_accuracy runs/ns-momentum-mlp35/checkpoints/step_0000{100,400} \\
        --stages early late

``--ns-dtype bfloat16`` (taken here, not by the recipe) passes ``ns_dtype`` to DMuonFSDP: the
CUDA default, which a CPU run otherwise never uses (its default is float32). It is not recorded
in the run's config.json; name the run directory after it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from pathlib import Path

import torch

if not __package__:  # run by path: the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.model import PRESETS

MLP35 = "cpu-demo-mlp35"
PRESETS[MLP35] = replace(PRESETS["cpu-demo"], ffn_dim=448)  # before the recipe's parser reads PRESETS

from recipes import build, pretrain  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the recipe on ``argv`` less ``--ns-dtype``, with DMuonFSDP's ``ns_dtype`` set from it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ns-dtype", choices=["bfloat16", "float16", "float32"], default=None)
    known, rest = parser.parse_known_args(argv)
    if known.ns_dtype is not None:
        build.DMuonFSDP = functools.partial(build.DMuonFSDP, ns_dtype=getattr(torch, known.ns_dtype))
        print(f"DMuonFSDP ns_dtype={known.ns_dtype} (benchmarks.ns_momentum_run)", flush=True)
    return pretrain.main(rest)


if __name__ == "__main__":
    sys.exit(main())
