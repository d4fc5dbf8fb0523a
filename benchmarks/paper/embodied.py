"""Vision-language-action models on 16 nodes, on paper: ``--report embodied``.

``--report embodied``: the whole training step of ``benchmarks.paper.e2e`` (forward + backward +
optimizer; AdamW against DMuonFSDP plain, with ``overlap_backward``, and with ``overlap_forward``
where there are replicas) for two VLAs (``--vla-models``: pi0 and WALL-OSS, their Muon matrices
and tokens per sample in ``benchmarks.paper.shapes``) on 16 nodes of 8 GPUs: DDP 128 x 1, flat
FSDP2 1 x 128 and HSDP 16 x 8 (``--meshes``), each against AdamW on the same mesh, printed beside
the step the DMuon report measured at 16 nodes (``MEASURED``; its mesh and batch are not taken
over here, so compare the overhead over AdamW, not the times). What differs from the
Llama models of ``--report e2e``:
- A model is its units in forward order (``shapes.Unit``: an FSDP unit or layer, its matrices
  grouped by the stack whose tokens they see); units differ in size and in the tokens they see.
  pi0: 27 SigLIP blocks, the projector, the time MLP, 18 joint layers (Gemma's and the action
  expert's matrices of layer i in one unit, as pi0's forward runs them together); WALL-OSS: 32
  vision blocks, the merger, the time MLP, 36 decoder layers (shared attention and both FFN
  experts in one unit). The vision tower runs first in forward, so its gradients land last.
- A unit's backward = sum over its stacks of 4 x the stack's matrix parameters in it x the
  stack's tokens per sample x ``--samples-per-rank``, at --mfu of peak; forward half of it.
  Embeddings, heads, the patch embeddings, attention scores, the conv and norm flops are left
  out (as in e2e); so are the AdamW-routed parameters (token embeddings, state and action
  projections, heads): element-wise work counts the Muon matrices only, as e2e counts the Llama
  models' (the AdamW and DMuonFSDP steps both leave out the same AdamW part). Every matrix is
  trained (lerobot freezes pi0's vision tower by default; openpi trains it).
- ``--samples-per-rank`` (default 48): one backward per step, no gradient accumulation; chosen so
  that the predicted AdamW steps (about 1.4 s for pi0, 0.9 s for WALL-OSS at MFU 0.4 on H100) lie
  near the report's 1.6 s and 1.3 s.
- Not modelled: the report's third model (Wall-WM, 3309 -> 3424 ms, +3.4%), FSDP's own
  all-gathers and reduce-scatters (folded into --mfu), DDP's bucketed all-reduce (its link load
  is the "grad sync link load" column), a frozen vision tower.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.paper.costs import print_header, print_row, resolve_gpu
from benchmarks.paper.e2e import Layer, Mesh, end_to_end, meshes_of, plan_of
from benchmarks.paper.shapes import VLA_MODELS, VLA_TOKENS

SOURCE = "DMuon report (arXiv 2606.27153), measured"

# AdamW and DMuon step ms of the DMuon report's reference implementation at 16 nodes (its "WallX"
# is WALL-OSS; its Wall-WM, 3309 -> 3424 ms, is not modelled here)
MEASURED = {"pi0": (1617.0, 1645.0), "wall-oss": (1259.0, 1285.0)}


def vla_layers(model: str, args: argparse.Namespace) -> list[Layer]:
    """``model`` of ``VLA_MODELS`` as its units in forward order, each with its seconds of
    backward: 4 x each stack's matrix parameters in it x that stack's tokens per rank, at
    --mfu of peak."""
    tokens, rate = VLA_TOKENS[model], args.tflops * 1e12 * args.mfu
    layers = []
    for unit in VLA_MODELS[model]():
        flops = sum(
            4 * r * c * tokens[stack] * args.samples_per_rank for stack, shapes in unit for r, c in shapes
        )
        layers.append(([shape for _, shapes in unit for shape in shapes], flops / rate))
    return layers


def mesh_name(mesh: Mesh) -> str:
    """DDP R x 1, FSDP2 1 x S or HSDP R x S."""
    replicas, shards = mesh
    kind = "DDP" if shards == 1 else "FSDP2" if replicas == 1 else "HSDP"
    return f"{kind} {replicas}x{shards}"


def embodied_report(args: argparse.Namespace) -> dict:
    resolve_gpu(args)
    results: dict[str, dict[str, Any]] = {}
    for model in args.vla_models:
        layers = vla_layers(model, args)
        shapes = [shape for matrices, _ in layers for shape in matrices]
        rows = []
        for mesh in meshes_of(args):
            plan = plan_of(shapes, mesh, args)
            rows.append({"setup": mesh_name(mesh), **end_to_end(layers, mesh, plan, True, args)})
        adamw, dmuon = MEASURED[model]
        results[model] = {
            "tokens_per_sample": VLA_TOKENS[model],
            "samples_per_rank": args.samples_per_rank,
            "units": len(layers),
            "matrices": len(shapes),
            "matrix_params": sum(r * c for r, c in shapes),
            "measured": {
                "source": SOURCE,
                "adamw_ms": adamw,
                "dmuon_ms": dmuon,
                "over_adamw": dmuon / adamw - 1,
            },
            "rows": rows,
        }
    print_table(results, args)
    return results


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"## Predicted VLA training step (forward + backward + optimizer), {args.gpu}: "
        f"{args.tflops:g} TFLOP/s, MFU {args.mfu:g}, NS at {args.ns_efficiency:g} of peak "
        f"({args.ns_algorithms[0]}), "
        f"{args.samples_per_rank} samples per rank; {args.gpus_per_node} GPUs a node, {args.node_gbs:g} GB/s "
        f"within, {args.link_gbs:g} GB/s between nodes, {args.latency_us:g} us a peer; {args.hbm_gbs:g} GB/s "
        f"HBM; {args.bucket_mib} MiB buckets shaped at {args.ns_flops_per_byte:g} NS flops per link byte, "
        f"{args.backward_buckets} bucket(s) started in backward with overlap_backward. Muon matrices only "
        "(AdamW-routed parameters left out of both steps)\n"
    )
    for model, result in results.items():
        print(
            f"- {model}: {result['matrices']} matrices in {result['units']} units, "
            f"{result['matrix_params'] / 1e9:.2f}B parameters"
        )
    print()
    header = [
        "model",
        "mesh",
        "tokens per sample (per stack)",
        "AdamW ms",
        "grad sync link load",
        "buckets",
        "DMuonFSDP ms",
        "vs AdamW",
        "overlap_backward ms",
        "vs AdamW",
        "+ overlap_forward ms",
        "vs AdamW",
        "exposed ms",
        "across nodes GiB: mean / least",
        "busiest NS ms",
        f"{SOURCE}, 16 nodes: AdamW -> DMuon ms",
    ]
    print_header(header, left=3)
    for model, result in results.items():
        tokens = ", ".join(f"{stack} {n}" for stack, n in result["tokens_per_sample"].items())
        measured = result["measured"]
        beside = f"{measured['adamw_ms']:.0f} -> {measured['dmuon_ms']:.0f} ({measured['over_adamw']:+.1%})"
        for r in result["rows"]:
            plain, overlap, later = r["plain_pipelined"], r["overlap"], r.get("overlap_forward")
            print_row(
                [
                    model,
                    r["setup"],
                    tokens,
                    f"{r['adamw_ms']:.1f}",
                    f"{r['grad_sync_load']:.0%}",
                    r["buckets"],
                    f"{plain['step_ms']:.1f}",
                    f"{plain['over_adamw']:+.2%}",
                    f"{overlap['step_ms']:.1f}",
                    f"{overlap['over_adamw']:+.2%}",
                    f"{later['step_ms']:.1f}" if later else "-",
                    f"{later['over_adamw']:+.2%}" if later else "-",
                    f"{overlap['exposed_ms']:.1f}",
                    f"{r['far_mean_gib']:.2f} / {r['far_least_gib']:.2f}",
                    f"{r['busiest_ns_ms']:.1f}",
                    beside,
                ]
            )
