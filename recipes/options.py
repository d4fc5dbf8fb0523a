"""The recipe's command line: every flag with its default, and the checks that need no files.

Errors are ``UsageError``s: the recipe prints them as one ``error: ...`` line (rank 0 only) and
every rank exits with status 2, before any model is built or any file is written.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dmuon_fsdp.config import NS_ALGORITHMS, VARIANTS
from recipes.model import PRESETS

NS_DTYPES = ("bfloat16", "float16", "float32")  # --ns-dtype: names of torch dtypes

DEFAULT_LR = {"dmuon": 0.01, "torch-muon": 0.01, "adamw": 3e-3}  # from scripts/lr_sweep.sh
DEFAULT_WARMUP = 20  # steps, or the run's --steps where fewer


class UsageError(Exception):
    """Bad input the user can fix: a flag, a file, a run directory or a checkpoint."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default unless it is None or False (those helps say what applies)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help or ""
        return f"{action.help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + message on every rank
        raise UsageError(message)


def build_parser(description: str) -> argparse.ArgumentParser:
    p = Parser(description=description, formatter_class=HelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS), help="model size")
    model.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    model.add_argument(
        "--tie-embeddings",
        action="store_true",
        default=None,
        help="share the input embedding with the output head (default: the preset's choice)",
    )
    model.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="vocabulary of a --data token file (default: the preset's)",
    )
    model.add_argument(
        "--ffn-dim",
        type=int,
        default=None,
        help="override the preset's MLP width (each block's SwiGLU hidden size)",
    )
    model.add_argument("--compile", action="store_true", help="torch.compile each block")

    data = p.add_argument_group("data (default: the Python standard library's source, byte level)")
    data.add_argument(
        "--data", default=None, help="nanoGPT-style uint16 token file (val.bin beside it, else its last 5%%)"
    )
    data.add_argument(
        "--text", default=None, help="plain text file, byte-level tokens (its last 5%% validates)"
    )
    data.add_argument(
        "--cache-dir", default="runs/cache", help="where the standard library's tokens are cached"
    )

    opt = p.add_argument_group("optimization")
    opt.add_argument(
        "--optimizer",
        default="dmuon",
        choices=sorted(DEFAULT_LR),
        help="dmuon: DMuonFSDP; torch-muon: torch.optim.Muon on the FSDP2 parameters; adamw",
    )
    opt.add_argument("--steps", type=int, default=400, help="optimizer steps of the whole run")
    opt.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak lr; the Muon lr for dmuon/torch-muon (default: 0.01 for Muon, 3e-3 for adamw)",
    )
    opt.add_argument(
        "--adamw-lr", type=float, default=3e-3, help="AdamW lr of embeddings, head and vectors in Muon runs"
    )
    opt.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    opt.add_argument(
        "--ns-algorithm",
        default=None,
        choices=NS_ALGORITHMS,
        help="DMuonFSDP's Newton-Schulz form: standard, gram, or auto (Gram where it needs fewer "
        "flops: the MLP matrices) (default: standard)",
    )
    opt.add_argument(
        "--ns-dtype",
        default=None,
        choices=NS_DTYPES,
        help="DMuonFSDP's Newton-Schulz matmul dtype (default: DMuonFSDP's, bfloat16 on CUDA and "
        "float32 elsewhere)",
    )
    opt.add_argument(
        "--variant",
        default=None,
        choices=tuple(VARIANTS),
        help="DMuonFSDP's update: muon, or normuon (each row of the orthogonalized update normalized by "
        "its running second moment, NorMuon) (default: muon)",
    )
    opt.add_argument(
        "--adjust-lr-fn",
        default=None,
        choices=("original", "match_rms_adamw"),
        help="DMuonFSDP's per-matrix lr scale: original (sqrt(max(1, rows / cols))) or match_rms_adamw "
        "(0.2 sqrt(max(rows, cols)): updates of AdamW's RMS, so an AdamW lr carries over) "
        "(default: none)",
    )
    opt.add_argument(
        "--overlap-backward",
        action="store_true",
        help="DMuonFSDP starts its first bucket's exchange to the owners during backward, once its "
        "gradients land (same results)",
    )
    opt.add_argument(
        "--overlap-forward",
        action="store_true",
        help="DMuonFSDP leaves the copies of results to other replicas (HSDP, --replicas > 1) to the "
        "next forward, each finished before FSDP2 gathers its layer (same results; for several nodes)",
    )
    opt.add_argument(
        "--bucket-mib",
        type=float,
        default=None,
        help="DMuonFSDP's bucket_bytes in MiB: the most one rank holds or moves per bucket "
        "(default: DMuonFSDP's, 128)",
    )
    add_schedule_flags(opt)
    opt.add_argument(
        "--qk-clip",
        type=float,
        default=None,
        metavar="TAU",
        help="QK-clip (MuonClip) after each optimizer step: shrink the q/k rows of heads whose "
        "largest pre-softmax logit passed TAU (logs max logits too)",
    )
    opt.add_argument(
        "--qk-clip-alpha",
        type=float,
        default=None,
        help="the q side's share of the QK-clip factor (default: 0.5)",
    )
    opt.add_argument(
        "--max-logits",
        action="store_true",
        help="log each layer's largest pre-softmax logit (metrics max_logit, max_logit_per_layer)",
    )

    run = add_run_flags(p)
    run.add_argument("--val-batches", type=int, default=4, help="validation batches per evaluation")
    run.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOP/s of one device for MFU (default: known GPUs; none on CPU)",
    )
    system = add_system_flags(p)
    system.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="HSDP: replicate over this many groups, shard within each (world size / replicas)",
    )
    return p


def add_schedule_flags(opt: argparse._ArgumentGroup) -> None:
    """The lr schedule, clipping and seed: every recipe's."""
    opt.add_argument(
        "--warmup", type=int, default=None, help="linear warm-up steps (default: 20, or --steps if fewer)"
    )
    opt.add_argument("--decay", default="cosine", choices=["cosine", "linear"], help="lr decay after warm-up")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr as a fraction of the peak")
    opt.add_argument(
        "--clip", type=float, default=1.0, help="clip the gradient norm to this (0: off; the norm is logged)"
    )
    opt.add_argument("--seed", type=int, default=0, help="seeds the model and the batches")


def add_run_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The run directory, checkpoints and logging: every recipe's (the group, for a recipe's own)."""
    run = p.add_argument_group("run directory, checkpoints and logging")
    run.add_argument(
        "--run-dir",
        default=None,
        help="where config, metrics and checkpoints go (default: the run "
        "--resume names, else runs/<preset>-<optimizer>)",
    )
    run.add_argument("--overwrite", action="store_true", help="delete an earlier run in --run-dir first")
    run.add_argument(
        "--resume",
        default=None,
        help="continue from a run directory (its newest complete checkpoint), a checkpoint "
        "step directory, or 'auto' (--run-dir's newest, or a fresh start)",
    )
    run.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (0: never, see --save-final)"
    )
    run.add_argument(
        "--save-final",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="checkpoint after the last step (--no-save-final: not)",
    )
    run.add_argument(
        "--save-on-stop",
        type=int,
        default=1,
        metavar="N",
        help="on SIGTERM or SIGINT, checkpoint after the step in progress unless the newest checkpoint "
        "is fewer than N steps old (0: never), then exit with status 3",
    )
    run.add_argument(
        "--keep-last", type=int, default=0, help="keep only the newest K complete checkpoints (0: all)"
    )
    run.add_argument("--val-every", type=int, default=50, help="validation every N steps (and at the end)")
    run.add_argument(
        "--tensorboard", action="store_true", help="also log to <run-dir>/tensorboard (needs tensorboard)"
    )
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    run.add_argument(
        "--log-every",
        type=int,
        default=10,
        help="a log line every N steps (and at each validation) when output is not a terminal or "
        "with --no-progress",
    )
    return run


def add_system_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Device and threads: every recipe's (the group, for a recipe's own)."""
    system = p.add_argument_group("system")
    system.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA when present"
    )
    system.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank on CPU (default: cores / local ranks)",
    )
    return system


# Settings of one launch, not of the run: a resume takes them from its own command line only.
PER_LAUNCH = ("resume", "overwrite", "run_dir", "no_progress", "device", "threads")


def parse_args(
    argv: list[str] | None,
    description: str,
    parser_of: Callable[[str], argparse.ArgumentParser] = build_parser,
    default_lr: dict[str, float] = DEFAULT_LR,
    run_name: str = "{preset}-{optimizer}",
) -> argparse.Namespace:
    """A recipe's flags (``parser_of``'s; pretraining's by default); ``args.given`` names those
    on the command line (a resume keeps the saved run's value of every other one:
    ``continue_run``). Without --run-dir a run goes to runs/``run_name``."""
    parser = parser_of(description)
    args = parser.parse_args(argv)
    unset = object()  # argparse sets defaults only where the namespace has no value yet
    again = vars(parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(args), unset))))
    args.given = frozenset(key for key, value in again.items() if value is not unset)
    if args.lr is None:
        args.lr = default_lr[args.optimizer]
    if args.warmup is None:
        args.warmup = min(DEFAULT_WARMUP, args.steps)
    args.run_dir = args.run_dir or _resumed_run_dir(args.resume) or "runs/" + run_name.format(**vars(args))
    return args


def run_settings(args: argparse.Namespace) -> dict:
    """The flags as config.json keeps them (``given`` is the launch's, not the run's)."""
    return {k: v for k, v in vars(args).items() if k != "given"}


def continue_run(args: argparse.Namespace, saved: dict) -> None:
    """A resume continues the run it resumes: every flag not given again takes the value the
    run saved in config.json (flags the run predates keep their defaults)."""
    for key, value in saved.items():
        if key not in args.given and key not in PER_LAUNCH and hasattr(args, key):
            setattr(args, key, value)


def _resumed_run_dir(resume: str | None) -> str | None:
    """The run dir ``--resume`` names (itself, or the run a checkpoints/step_N dir belongs to):
    without --run-dir a resumed run goes on there."""
    if not resume or resume == "auto":
        return None
    path = Path(resume)
    return str(path.parent.parent) if path.parent.name == "checkpoints" else str(path)


def check_run_numbers(
    args: argparse.Namespace, at_least: dict[str, tuple[int | None, int]], positive: dict[str, float | None]
) -> None:
    """Raise UsageError for flags out of range, naming the flag and its value: those every
    recipe has, and a recipe's own (``at_least``: flag -> (value, least); ``positive``)."""
    at_least = {
        "--steps": (args.steps, 1),
        "--batch-size": (args.batch_size, 1),
        "--warmup": (args.warmup, 0),
        "--val-every": (args.val_every, 1),
        "--save-every": (args.save_every, 0),
        "--keep-last": (args.keep_last, 0),
        "--save-on-stop": (args.save_on_stop, 0),
        "--log-every": (args.log_every, 1),
        "--threads": (args.threads, 1),
        **at_least,
    }
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            raise UsageError(f"{flag} must be at least {low} (got {value})")
    positive = {"--lr": args.lr, "--adamw-lr": args.adamw_lr, **positive}
    for flag, number in positive.items():
        if number is not None and not number > 0:
            raise UsageError(f"{flag} must be positive (got {number:g})")
    for flag, number in {"--weight-decay": args.weight_decay, "--clip": args.clip}.items():
        if not number >= 0:
            raise UsageError(f"{flag} must not be negative (got {number:g})")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must be between 0 and 1 (got {args.min_lr_ratio:g})")
    if "warmup" in args.given and args.warmup > args.steps:  # (the default is at most --steps)
        raise UsageError(
            f"--warmup {args.warmup} is longer than --steps {args.steps}: the lr would never reach "
            "its peak (pass a --warmup of at most --steps)"
        )
    if args.overwrite and args.resume == "auto":
        raise UsageError("--overwrite and --resume auto contradict each other: pass one")


def check_numbers(args: argparse.Namespace, world_size: int) -> None:
    """Raise UsageError for flags out of range, naming the flag and its value."""
    check_run_numbers(
        args,
        {
            "--grad-accum": (args.grad_accum, 1),
            "--replicas": (args.replicas, 1),
            "--seq-len": (args.seq_len, 1),
            "--ffn-dim": (args.ffn_dim, 1),
            "--vocab-size": (args.vocab_size, 1),
            "--val-batches": (args.val_batches, 1),
        },
        {"--qk-clip": args.qk_clip, "--peak-tflops": args.peak_tflops},
    )
    if args.qk_clip is not None and not math.isfinite(args.qk_clip):
        raise UsageError(f"--qk-clip must be finite (got {args.qk_clip:g})")
    if args.qk_clip_alpha is not None and args.qk_clip is None:
        raise UsageError("--qk-clip-alpha applies with --qk-clip only")
    if args.qk_clip_alpha is not None and not 0 <= args.qk_clip_alpha <= 1:
        raise UsageError(f"--qk-clip-alpha must be between 0 and 1 (got {args.qk_clip_alpha:g})")
    if args.batch_size % (world_size * args.grad_accum):
        raise UsageError(
            f"--batch-size {args.batch_size} must be divisible by ranks x --grad-accum "
            f"({world_size} x {args.grad_accum} = {world_size * args.grad_accum})"
        )
    if world_size % args.replicas:
        raise UsageError(f"--replicas {args.replicas} does not divide the world size {world_size}")
    if args.data and args.text:
        raise UsageError("pass at most one of --data and --text")
    for flag, given in (
        ("--ns-algorithm", args.ns_algorithm is not None),
        ("--ns-dtype", args.ns_dtype is not None),
        ("--variant", args.variant is not None),
        ("--adjust-lr-fn", args.adjust_lr_fn is not None),
        ("--overlap-backward", args.overlap_backward),
        ("--overlap-forward", args.overlap_forward),
        ("--bucket-mib", args.bucket_mib is not None),
    ):
        if given and args.optimizer != "dmuon":
            raise UsageError(f"{flag} applies to --optimizer dmuon only (got --optimizer {args.optimizer})")
    if args.bucket_mib is not None and not args.bucket_mib > 0:
        raise UsageError(f"--bucket-mib must be positive (got {args.bucket_mib:g})")


def lr_factor(args: argparse.Namespace) -> Callable[[int], float]:
    """The lr schedule as a factor of the peak lr at a 0-based step: linear warm-up, then cosine or
    linear decay to --min-lr-ratio at --steps."""

    def factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if args.decay == "cosine" else 1 - progress
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * shape

    return factor
