"""Summarise pretraining runs: a Markdown table and a figure of their loss curves.

    python -m recipes.report ROOT       -> ROOT/summary.md, ROOT/loss.png

A run is a directory holding config.json and metrics.jsonl, as recipes.pretrain writes them; runs
are found at any depth under ROOT, and ROOT may itself be one. Each run is a table row; a run
without summary.json (still training, or stopped) is described by its metrics and marked
unfinished. The figure shows train loss (running mean) against step and against wall-clock time,
and validation loss. Exits with status 1 when ROOT holds no run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import textwrap
from pathlib import Path

if not __package__:  # run by path (python recipes/x.py, torchrun recipes/x.py): the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.metrics import step_times
from recipes.run_dir import replace_file

SUMMARY_KEYS = ("lr", "steps", "final_val_loss", "median_step_ms", "optimizer_share", "peak_memory_mb")


def read_records(path: Path) -> list[dict]:
    # A run still training may have written half a line: only newline-terminated lines count.
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def from_metrics(records: list[dict], config: dict) -> dict:
    """What summary.json would say, from the metrics of an unfinished run."""
    times = step_times([r["fwd_bwd_ms"] for r in records], [r["opt_ms"] for r in records]) if records else {}
    val = [r["val_loss"] for r in records if "val_loss" in r]
    done = records[-1]["step"] if records else 0
    return {
        "lr": config["args"]["lr"],
        "steps": f"{done}/{config['args']['steps']} (unfinished)",
        "final_val_loss": val[-1] if val else None,
        "median_step_ms": times.get("median_step_ms"),
        "optimizer_share": times.get("optimizer_share"),
        "peak_memory_mb": [max(r["peak_memory_mb"] for r in records)] if records else [],
    }


def load_run(run_dir: Path, root: Path) -> dict:
    config = json.loads((run_dir / "config.json").read_text())
    records = read_records(run_dir / "metrics.jsonl")
    run = {
        "name": run_dir.relative_to(root).as_posix() if run_dir != root else root.resolve().name,
        "preset": config["args"]["preset"],
        "optimizer": config["args"]["optimizer"]
        + (f"-{variant}" if (variant := config["args"].get("variant")) not in (None, "muon") else ""),
        "qk_clip": config["args"].get("qk_clip"),
        "world_size": config["world_size"],
        "data": config["data"],
        "loss_unit": config["loss_unit"],
        "tokens_per_step": config["tokens_per_step"],
        "records": records,
    }
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        run.update({key: summary[key] for key in SUMMARY_KEYS})
    else:
        run.update(from_metrics(records, config))
    return run


def find_runs(root: Path) -> list[dict]:
    dirs = sorted(p.parent for p in root.rglob("metrics.jsonl") if (p.parent / "config.json").is_file())
    return [load_run(d, root) for d in dirs]


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(runs: list[dict]) -> str:
    rows = [
        "| run | optimizer | lr | ranks | steps | final val loss | median step (ms) | optimizer share "
        "| peak memory per rank (MiB) | data | loss unit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in runs:
        memory = ", ".join(f"{m:.0f}" for m in r["peak_memory_mb"]) or "-"
        cells = [
            r["name"],
            r["optimizer"],
            f"{r['lr']:g}",
            r["world_size"],
            r["steps"],
            fmt(r["final_val_loss"], ".4f"),
            fmt(r["median_step_ms"], ".1f"),
            fmt(r["optimizer_share"], ".1%"),
            memory,
            r["data"],
            r["loss_unit"],
        ]
        rows.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def distinct(runs: list[dict], key: str) -> str:
    return ", ".join(dict.fromkeys(str(r[key]) for r in runs))


def labels(runs: list[dict]) -> list[str]:
    """'optimizer lr=...', plus the run's path where two runs would share a label."""
    base = [
        f"{r['optimizer']} lr={r['lr']:g}" + (f" qk-clip={r['qk_clip']:g}" if r["qk_clip"] else "")
        for r in runs
    ]
    return [f"{b} ({r['name']})" if base.count(b) > 1 else b for b, r in zip(base, runs, strict=True)]


def title(runs: list[dict]) -> str:
    parts = [
        f"preset {distinct(runs, 'preset')}",
        f"{distinct(runs, 'world_size')} ranks",
        f"data: {distinct(runs, 'data')}",
        f"{distinct(runs, 'tokens_per_step')} tokens per step",
    ]
    return textwrap.fill("; ".join(parts), 150)


def running_mean(values: list[float], window: int) -> list[float]:
    sums = list(itertools.accumulate(values, initial=0.0))
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(values))]


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ylabel = f"loss ({distinct(runs, 'loss_unit')})"
    logits = any("max_logit" in rec for r in runs for rec in r["records"])
    fig, axes = plt.subplots(1, 4 if logits else 3, figsize=(21 if logits else 16, 5))
    step_ax, val_ax, time_ax = axes[:3]
    for i, (r, label) in enumerate(zip(runs, labels(runs), strict=True)):
        records = r["records"]
        smooth = running_mean([rec["train_loss"] for rec in records], max(1, len(records) // 50))
        step_ax.plot([rec["step"] for rec in records], smooth, color=f"C{i}", label=label)
        time_ax.plot([rec["time_s"] / 60 for rec in records], smooth, color=f"C{i}", label=label)
        val = [(rec["step"], rec["val_loss"]) for rec in records if "val_loss" in rec]
        if val:
            val_ax.plot(*zip(*val, strict=True), marker="o", color=f"C{i}", label=label)
        seen = [(rec["step"], rec["max_logit"]) for rec in records if "max_logit" in rec]
        if seen:
            axes[3].plot(*zip(*seen, strict=True), color=f"C{i}", label=label)
            if r["qk_clip"]:
                axes[3].axhline(r["qk_clip"], color=f"C{i}", linestyle=":", linewidth=1)
    if logits:
        axes[3].set(
            title="largest pre-softmax logit (any layer, head)", xlabel="step", ylabel="q . k / sqrt(d)"
        )
        axes[3].grid(alpha=0.3)
    step_ax.set(title="train loss (running mean)", xlabel="step", ylabel=ylabel, yscale="log")
    val_ax.set(title="validation loss", xlabel="step", ylabel=ylabel)
    time_ax.set(
        title="train loss (running mean) against time",
        xlabel="training time (min)",
        ylabel=ylabel,
        yscale="log",
    )
    for ax in (step_ax, val_ax, time_ax):
        ax.grid(alpha=0.3, which="both")
        ax.yaxis.set_major_formatter("{x:g}")
    for ax in (step_ax, time_ax):  # a loss axis spans about one decade: label the minor ticks too
        ax.yaxis.set_minor_formatter("{x:g}")
    step_ax.legend(fontsize="small")
    fig.suptitle(title(runs))
    fig.tight_layout()
    tmp = path.with_name(f"{path.name}.tmp.png")  # the whole figure or the old one, never half
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("root", type=Path, help="a run directory, or a folder with runs at any depth")
    root = parser.parse_args(argv).root
    runs = find_runs(root)
    if not runs:
        print(
            f"error: no runs (directories with config.json and metrics.jsonl) under {root}", file=sys.stderr
        )
        return 1
    text = table(runs)
    replace_file(root / "summary.md", text + "\n")
    plot(runs, root / "loss.png")
    print(text)
    print(f"\nwrote {root / 'summary.md'} and {root / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
