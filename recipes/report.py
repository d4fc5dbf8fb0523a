"""Summarise the runs in a directory: a Markdown table and a PNG of train/val loss curves.

    python recipes/report.py runs/demo      -> runs/demo/summary.md, runs/demo/loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_runs(root: Path) -> list[dict]:
    runs = []
    for summary_path in sorted(root.glob("*/summary.json")):
        summary = json.loads(summary_path.read_text())
        lines = (summary_path.parent / "metrics.jsonl").read_text().splitlines()
        summary["records"] = [json.loads(line) for line in lines if line.strip()]
        runs.append(summary)
    return runs


def table(runs: list[dict]) -> str:
    rows = [
        "| run | optimizer | lr | ranks | steps | final val loss | median step (ms) | optimizer share | peak memory per rank (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        val = f"{r['final_val_loss']:.4f}" if r["final_val_loss"] is not None else "-"
        memory = ", ".join(f"{m:.0f}" for m in r["peak_memory_mb"])
        rows.append(
            f"| {r['name']} | {r['optimizer']} | {r['lr']:g} | {r['world_size']} | {r['steps']} | {val} | "
            f"{r['median_step_ms']:.1f} | {r['optimizer_share']:.1%} | {memory} |"
        )
    return "\n".join(rows)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        steps = [rec["step"] for rec in r["records"]]
        losses = [rec["train_loss"] for rec in r["records"]]
        window = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
                  for i in range(len(losses))]  # fmt: skip
        train_ax.plot(steps, smooth, label=r["name"])
        val = [(rec["step"], rec["val_loss"]) for rec in r["records"] if "val_loss" in rec]
        if val:
            val_ax.plot(*zip(*val), marker="o", label=r["name"])
    train_ax.set(title="train loss (running mean)", xlabel="step", ylabel="loss")
    val_ax.set(title="validation loss", xlabel="step", ylabel="loss")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    args = parser.parse_args()
    runs = load_runs(args.root)
    if not runs:
        raise SystemExit(f"no runs with a summary.json under {args.root}")
    text = table(runs)
    (args.root / "summary.md").write_text(text + "\n")
    plot(runs, args.root / "loss.png")
    print(text)
    print(f"\nwrote {args.root / 'summary.md'} and {args.root / 'loss.png'}")


if __name__ == "__main__":
    main()
