"""Sample from a pretraining run's checkpoint, in one process (torch.distributed not initialized).

    python -m recipes.sample --run-dir runs/cpu-demo-dmuon --prompt "def "
    python -m recipes.sample --run-dir runs/gpt --prompt-ids 50256,464 --tokens 50

The model is rebuilt from the run's config.json and loaded from its newest complete checkpoint
(or --checkpoint), whatever number of ranks wrote it: torch.distributed.checkpoint reshards on
load. Byte-level runs (loss in nats per byte: the stdlib corpus or --text) take a text prompt and
print text; token-file runs have no tokenizer here, so they take --prompt-ids and print token ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

import torch

if not __package__:  # run by path (python recipes/x.py, torchrun recipes/x.py): the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes import checkpoint
from recipes.model import ModelConfig, Transformer
from recipes.options import HelpFormatter, Parser, UsageError


def fail(message: str) -> NoReturn:
    raise UsageError(message)


def build_parser() -> Parser:
    p = Parser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--run-dir", required=True, help="the run directory (config.json, checkpoints/)")
    p.add_argument(
        "--checkpoint", default=None, help="a step directory to load instead of the newest complete one"
    )
    p.add_argument("--prompt", default=None, help="text to continue (byte-level runs)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated token ids to continue (any run)")
    p.add_argument("--tokens", type=int, default=200, help="new tokens to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy decoding")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available"
    )
    return p


@torch.no_grad()
def generate(
    model: Transformer, ids: list[int], n: int, temperature: float, top_k: int, seed: int
) -> list[int]:
    """``n`` new token ids continuing ``ids``; the context is the last seq_len tokens."""
    device = model.output.weight.device
    generator = torch.Generator(device).manual_seed(seed)
    tokens = torch.tensor([ids], device=device)
    for _ in range(n):
        logits = model(tokens[:, -model.cfg.seq_len :])[0, -1].float()
        if temperature == 0:
            next_id = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        tokens = torch.cat([tokens, next_id.view(1, 1)], dim=1)
    return tokens[0, len(ids) :].tolist()


def prompt_ids(args: argparse.Namespace, byte_level: bool, config_path: Path, vocab: int) -> list[int]:
    if args.prompt is not None and args.prompt_ids is not None:
        fail("pass either --prompt or --prompt-ids, not both")
    if args.prompt is not None:
        if not byte_level:
            fail(f"--prompt: {config_path} is a token-file run (no tokenizer here); pass --prompt-ids")
        ids = list(args.prompt.encode("utf-8"))
    elif args.prompt_ids is not None:
        try:
            ids = [int(i) for i in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            fail(f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers")
        if any(not 0 <= i < vocab for i in ids):
            fail(f"--prompt-ids: ids must lie in [0, {vocab}), the vocabulary of {config_path}")
    else:
        fail("pass --prompt (byte-level runs) or --prompt-ids")
    if not ids:
        fail("empty prompt")
    return ids


def sample(args: argparse.Namespace) -> str:
    """The prompt and its continuation: text for byte-level runs, else comma-separated ids."""
    if args.tokens < 0 or args.temperature < 0 or args.top_k < 0:
        fail("--tokens, --temperature and --top-k must not be negative")
    run_dir = Path(args.run_dir)
    config_path = run_dir / "config.json"
    if not run_dir.is_dir():
        fail(f"--run-dir {run_dir}: no such directory")
    if not config_path.is_file():
        fail(f"--run-dir {run_dir}: no config.json (not a run directory)")
    config = json.loads(config_path.read_text())
    cfg = ModelConfig(**config["model"])
    byte_level = config["loss_unit"] == "nats per byte"
    ids = prompt_ids(args, byte_level, config_path, cfg.vocab_size)
    path = Path(args.checkpoint) if args.checkpoint else checkpoint.latest(run_dir)
    if path is None:
        fail(f"no complete checkpoint (step_*/.metadata) under {run_dir / 'checkpoints'}")
    if not checkpoint.is_complete(path):
        fail(f"--checkpoint {path}: not a complete checkpoint (no .metadata)")
    model = Transformer(cfg)
    checkpoint.load_model(path, model)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    model.to("cuda" if cuda else "cpu").eval()
    new = generate(model, ids, args.tokens, args.temperature, args.top_k, args.seed)
    if byte_level:
        # ids past 255 (a byte-level run trained with a larger --vocab-size) print as U+FFFD
        raw = b"".join(bytes([i]) if i < 256 else "\ufffd".encode() for i in ids + new)
        return raw.decode("utf-8", errors="replace")
    return ",".join(map(str, ids + new))


def main(argv: list[str] | None = None) -> int:
    """Print a sample; bad input or an unreadable checkpoint prints one ``error:`` line, status 2."""
    try:
        print(sample(build_parser().parse_args(argv)))
        return 0
    except (UsageError, checkpoint.CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
