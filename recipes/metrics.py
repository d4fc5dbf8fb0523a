"""What the recipe logs each step: model flops, MFU, peak memory, and the metrics file itself.

metrics.jsonl is the source of truth (one JSON object per step); TensorBoard, when asked for,
gets the same numbers. The console shows a progress bar on a terminal and plain lines otherwise.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from recipes.model import ModelConfig

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, matched
# against torch.cuda.get_device_name; the first match wins, so the more specific names come first.
GPU_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights used in a matmul per token: every Linear of the blocks and the output head (the
    input embedding is a lookup; a tied one is counted once, as the head)."""
    head_dim = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * cfg.n_kv_heads * head_dim
    return cfg.n_layers * (attention + 3 * cfg.dim * cfg.ffn_dim) + cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig) -> int:
    """Training flops per token, forward and backward: 6 N for the weights plus 12 L d T for the
    attention scores and values (PaLM's count: the whole T x T matrix, though causal attention
    needs half of it)."""
    return 6 * matmul_params(cfg) + 12 * cfg.n_layers * cfg.dim * cfg.seq_len


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """One device's peak for MFU: ``override`` (--peak-tflops), else a known GPU's bf16 peak,
    else None (CPU, unknown GPU: MFU is not logged)."""
    if override is not None or device.type != "cuda":
        return override
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in GPU_PEAK_TFLOPS if key in name), None)


WARMUP_STEPS = 5  # left out of the step-time medians: the first steps include one-time work


def step_times(fwd_bwd_ms: list[float], opt_ms: list[float]) -> dict:
    """Median step, optimizer and forward+backward milliseconds past the warm-up steps, and the
    optimizer's share of the step (summary.json's numbers, also computed by report.py for runs
    that have not finished)."""
    skip = min(WARMUP_STEPS, len(fwd_bwd_ms) - 1)
    fwd_bwd, opt = fwd_bwd_ms[skip:], opt_ms[skip:]
    step = statistics.median(a + b for a, b in zip(fwd_bwd, opt, strict=True))
    return {
        "median_step_ms": step,
        "median_opt_ms": statistics.median(opt),
        "median_fwd_bwd_ms": statistics.median(fwd_bwd),
        "optimizer_share": statistics.median(opt) / step,
    }


def peak_memory_mb(device: torch.device) -> float:
    """This rank's peak: the CUDA allocator's, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MetricsLog:
    """Appends records to ``run_dir/metrics.jsonl`` and, with ``tensorboard``, writes them as
    scalars to ``run_dir/tensorboard`` (events after ``first_step`` from an earlier try are purged)."""

    def __init__(self, run_dir: Path, tensorboard: bool, first_step: int):
        self.file = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115 (held for the run; close() closes it)
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)

    def write(self, record: dict) -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as error:  # a file object's write does not name its file
            raise OSError(error.errno, error.strerror, self.file.name) from error
        if self.writer:
            for key, value in record.items():
                if key == "step" or value is None:
                    continue
                if isinstance(value, list):  # one scalar per layer: max_logit_per_layer/0, /1, ...
                    for i, item in enumerate(value):
                        self.writer.add_scalar(f"{key}/{i}", item, record["step"])
                else:
                    self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.file.close()
        if self.writer:
            self.writer.close()


# What a record's validation and throughput are called, per recipe: (key, words).
VALIDATION = (("val_loss", "val loss"), ("val_action_mse", "val action mse"))
THROUGHPUT = (("tokens_per_s", "tok/s"), ("samples_per_s", "samples/s"))


def validation(record: dict) -> str | None:
    """The record's validation, in words, or None when it was not evaluated."""
    return next((f"{words} {record[key]:.4f}" for key, words in VALIDATION if key in record), None)


def throughput(record: dict) -> str:
    return next(f"{record[key]:,.0f} {unit}" for key, unit in THROUGHPUT if key in record)


def log_line(record: dict, steps: int) -> str:
    """One step's plain log line: loss, validation when evaluated, both lrs, gradient norm,
    throughput, MFU when known, step time."""
    parts = [f"step {record['step']}/{steps}", f"loss {record['train_loss']:.4f}"]
    checked = validation(record)
    if checked:
        parts.append(checked)
    parts.append(f"lr {record['lr']:.4g}")
    if record.get("adamw_lr") is not None:
        parts.append(f"adamw lr {record['adamw_lr']:.4g}")
    parts += [f"grad norm {record['grad_norm']:.3f}", throughput(record)]
    if "mfu" in record:
        parts.append(f"mfu {record['mfu']:.1%}")
    parts.append(f"{record['fwd_bwd_ms'] + record['opt_ms']:.0f} ms (optimizer {record['opt_ms']:.1f})")
    return " | ".join(parts)


class Console:
    """Rank 0's output (the others' is silent): a progress bar on a terminal; when the output is
    not one (a file, a pipe) or with ``plain``, a ``log_line`` every ``log_every`` steps, at each
    validation and at the last step."""

    def __init__(self, active: bool, plain: bool, log_every: int, steps: int, first_step: int, name: str):
        self.active, self.log_every, self.steps = active, log_every, steps
        plain = plain or not sys.stdout.isatty()
        self.bar = (
            tqdm(total=steps, initial=first_step, desc=name, dynamic_ncols=True)
            if active and not plain
            else None
        )

    def say(self, text: str) -> None:
        if self.bar:
            self.bar.write(text)
        elif self.active:
            print(text, flush=True)

    def step(self, record: dict) -> None:
        step = record["step"]
        if self.bar:
            self.bar.set_postfix(
                loss=f"{record['train_loss']:.3f}",
                gnorm=f"{record['grad_norm']:.2f}",
                speed=throughput(record),
                fb_ms=f"{record['fwd_bwd_ms']:.0f}",
                opt_ms=f"{record['opt_ms']:.1f}",
            )
            self.bar.update(1)
            checked = validation(record)
            if checked:
                self.say(f"step {step}: {checked}")
        elif step % self.log_every == 0 or validation(record) or step == self.steps:
            self.say(log_line(record, self.steps))

    def close(self) -> None:
        if self.bar:
            self.bar.close()
