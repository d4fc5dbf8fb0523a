"""Token data with no download: the Python standard library's own source, or your own corpus.

A corpus is two flat token streams (train, validation). Batches are random windows drawn from a
generator seeded by (seed, step), so the data of any step is known without replaying earlier
steps: resuming needs only the step number, and the global batch of a step is the same at any
world size. Rank r of W takes rows [r * B / W, (r + 1) * B / W) of the global batch.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from recipes.model import ModelConfig
from recipes.options import UsageError

VAL_FRACTION = 0.05


@dataclass
class Corpus:
    """Token streams stored as uint16 bit patterns in int16 tensors (memory-mapped when read
    from a file); ``token_ids`` turns a slice into int64 ids. ``vocab_size`` is None when the
    corpus does not fix it (a token file: the model preset's vocabulary applies).
    ``train_source`` / ``val_source`` name where each stream came from (for error messages) and
    ``train_max`` / ``val_max`` are their largest token ids (-1 when empty), scanned once at load."""

    train: torch.Tensor
    val: torch.Tensor
    vocab_size: int | None
    description: str
    train_source: str
    val_source: str
    train_max: int
    val_max: int
    byte_level: bool


def largest_token(tokens: torch.Tensor) -> int:
    """The largest id in a uint16 stream (-1 if empty), in chunks so a memory-mapped file of
    billions of tokens is never widened whole."""
    largest = -1
    for chunk in tokens.split(1 << 24) if len(tokens) else ():
        largest = max(largest, int((chunk.to(torch.int32) & 0xFFFF).max()))
    return largest


def looks_like_text(path: Path) -> bool:
    """Whether a file's first 64 KiB read as text: UTF-8, no NUL byte, nearly all printable. A
    uint16 token file has a NUL in every id below 256 and invalid UTF-8 in most others."""
    with path.open("rb") as file:
        head = file.read(1 << 16)
    if not head or b"\0" in head:
        return False
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head)  # a character cut at the end waits
    except UnicodeDecodeError:
        return False
    printable = sum(ch.isprintable() or ch in "\t\n\r\f\v" for ch in text)
    return printable >= 0.95 * len(text)


def token_ids(tokens: torch.Tensor) -> torch.Tensor:
    """int64 ids of uint16 tokens held in an int16 tensor."""
    return (tokens.to(torch.int32) & 0xFFFF).long()


def stdlib_files() -> list[Path]:
    """The standard library's .py files, in a fixed (sorted) order; site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _write_tokens(path: Path, tokens: bytes) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(tokens)
    tmp.replace(path)


def _read_uint16(path: Path) -> torch.Tensor:
    """Memory-map a uint16 token file (read-only use; pages are shared between ranks)."""
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: {size} bytes is not a whole number of uint16 tokens")
    if size == 0:
        return torch.empty(0, dtype=torch.int16)
    return torch.from_file(str(path), shared=True, size=size // 2, dtype=torch.int16)


def stdlib_corpus(cache_dir: str | Path, max_files: int | None = None) -> Corpus:
    """Byte-level tokens (vocab 256) of the stdlib source; every 20th file goes to validation.

    Tokens are cached as uint16 files in ``cache_dir``, keyed by the file list.
    """
    files = stdlib_files()[:max_files]
    if not files:
        raise FileNotFoundError(f"no .py files under {sysconfig.get_paths()['stdlib']}")
    key = hashlib.sha1("\n".join(str(p) for p in files).encode()).hexdigest()[:12]
    cache = Path(cache_dir)
    paths = {split: cache / f"stdlib-{key}-{split}.bin" for split in ("train", "val")}
    if not all(p.exists() for p in paths.values()):
        cache.mkdir(parents=True, exist_ok=True)
        chunks: dict[str, list[bytes]] = {"train": [], "val": []}
        for i, path in enumerate(files):
            split = "val" if i % 20 == 19 else "train"
            chunks[split].append(path.read_bytes())
        for split, path in paths.items():
            data = b"".join(chunks[split])
            as_uint16 = bytearray(2 * len(data))  # little-endian: low byte = the byte, high = 0
            as_uint16[0::2] = data
            _write_tokens(path, bytes(as_uint16))
    train, val = (_read_uint16(paths[s]) for s in ("train", "val"))
    description = f"python stdlib source, {len(files)} files"
    return Corpus(
        train,
        val,
        256,
        description,
        f"{description} (train)",
        f"{description} (every 20th file)",
        largest_token(train),
        largest_token(val),
        byte_level=True,
    )


def token_file_corpus(path: str | Path, vocab_size: int | None = None) -> Corpus:
    """A nanoGPT-style uint16 token file; validation is ``val.bin`` beside it, or its last 5%.

    ``vocab_size`` None leaves the vocabulary to the model; the largest ids of both streams are
    scanned once here so that the trainer can check them before it builds anything."""
    path = Path(path)
    tokens = _read_uint16(path)
    val_path = path.with_name("val.bin")
    if val_path.exists() and val_path != path:
        train, val = tokens, _read_uint16(val_path)
        sources = (str(path), str(val_path))
    else:
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        train, val = tokens[:cut], tokens[cut:]
        sources = (f"{path} (first {1 - VAL_FRACTION:.0%})", f"{path} (last {VAL_FRACTION:.0%})")
    return Corpus(
        train,
        val,
        vocab_size,
        f"token file {path}",
        *sources,
        largest_token(train),
        largest_token(val),
        byte_level=False,
    )


def text_corpus(path: str | Path) -> Corpus:
    """A plain text file at byte level; its last 5% is validation."""
    data = Path(path).read_bytes()
    if not data:  # torch.frombuffer refuses an empty buffer
        tokens = torch.empty(0, dtype=torch.int16)
    else:
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    train, val = tokens[:cut], tokens[cut:]
    return Corpus(
        train,
        val,
        256,
        f"text file {path}",
        f"{path} (first {1 - VAL_FRACTION:.0%})",
        f"{path} (last {VAL_FRACTION:.0%})",
        largest_token(train),
        largest_token(val),
        byte_level=True,
    )


def batch_for_step(
    tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int, step: int, rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) of the global batch of ``step``: random windows of seq_len + 1."""
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
    if len(tokens) <= seq_len + 1:
        raise ValueError(f"{len(tokens)} tokens are too few for windows of {seq_len + 1}")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - seq_len - 1, (global_batch,), generator=gen)
    per_rank = global_batch // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    windows = token_ids(tokens[mine[:, None] + torch.arange(seq_len + 1)])
    return windows[:, :-1], windows[:, 1:]


def validation_batches(
    tokens: torch.Tensor, seq_len: int, rows: int, batches: int, rank: int, world_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed, evenly spaced windows over the validation stream, split across ranks."""
    count = rows * batches * world_size
    stride = max(1, (len(tokens) - seq_len - 1) // count)
    starts = torch.arange(count) * stride
    mine = starts[rank::world_size][: rows * batches].view(batches, rows)
    out = []
    for row_starts in mine:
        windows = token_ids(tokens[row_starts[:, None] + torch.arange(seq_len + 1)])
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


def load_corpus(args: argparse.Namespace) -> Corpus:
    """The corpus the flags name; a missing, empty or malformed file is a UsageError naming the
    flag (a text file given as --data is named as such)."""
    if not (args.data or args.text):
        return stdlib_corpus(args.cache_dir)
    flag, path = ("--data", Path(args.data)) if args.data else ("--text", Path(args.text))
    if not path.exists():
        raise UsageError(f"{flag} {path}: no such file")
    if not path.is_file():
        raise UsageError(f"{flag} {path}: not a file")
    if path.stat().st_size == 0:
        raise UsageError(f"{flag} {path}: the file is empty")
    if flag == "--data" and looks_like_text(path):
        raise UsageError(
            f"--data {path}: this is a text file, not uint16 tokens; pass it as --text (byte-level)"
        )
    path = path.resolve()  # the data's identity in config.json, however it was typed
    try:
        return token_file_corpus(path, args.vocab_size) if args.data else text_corpus(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"{flag} {error}") from error


def check_corpus(corpus: Corpus, cfg: ModelConfig, args: argparse.Namespace, world_size: int) -> None:
    """Both streams fit the model: ids inside the vocabulary, long enough for their windows."""
    for split, source, tokens, largest in (
        ("training", corpus.train_source, corpus.train, corpus.train_max),
        ("validation", corpus.val_source, corpus.val, corpus.val_max),
    ):
        if len(tokens) <= cfg.seq_len + 1:
            raise UsageError(
                f"{split} data {source}: {len(tokens)} tokens are too few for one window of "
                f"--seq-len + 1 = {cfg.seq_len + 1}"
            )
        if largest >= cfg.vocab_size:
            raise UsageError(
                f"{split} data {source}: token id {largest} is outside the vocabulary of "
                f"{cfg.vocab_size} (preset {args.preset}); pass --vocab-size {largest + 1} or more"
            )
    windows = max(1, args.batch_size // world_size) * args.val_batches * world_size
    # validation_batches spaces its windows a token apart at least
    if len(corpus.val) < windows + cfg.seq_len:
        raise UsageError(
            f"validation data {corpus.val_source}: {len(corpus.val)} tokens are too few for "
            f"{windows} windows of {cfg.seq_len + 1} (--val-batches {args.val_batches}); "
            f"it needs {windows + cfg.seq_len}: lower --val-batches or --batch-size"
        )
