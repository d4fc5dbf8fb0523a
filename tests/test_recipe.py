"""The pretraining recipe: data, a multi-rank smoke run, exact resume, resume at another world size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipes import data
from recipes.build import build_optimizers
from recipes.model import Transformer, preset
from recipes.pretrain import parse_args, train
from tests.support.spawn import run_ranks


def test_stdlib_corpus_splits_by_file_and_caches(tmp_path):
    files = data.stdlib_files()[:45]
    corpus = data.stdlib_corpus(tmp_path, max_files=45)
    val_files = [f for i, f in enumerate(files) if i % 20 == 19]
    assert len(val_files) == 2
    assert len(corpus.val) == sum(f.stat().st_size for f in val_files)
    assert len(corpus.train) + len(corpus.val) == sum(f.stat().st_size for f in files)
    first_val = val_files[0].read_bytes()
    assert bytes(corpus.val[: len(first_val)].tolist()) == first_val
    assert corpus.vocab_size == 256 and int(corpus.train.max()) < 256
    again = data.stdlib_corpus(tmp_path, max_files=45)  # from the uint16 cache
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)


def test_batches_are_deterministic_and_ranks_take_disjoint_slices():
    tokens = torch.arange(10_000, dtype=torch.int16)
    full_x, full_y = data.batch_for_step(tokens, 16, 8, seed=3, step=5, rank=0, world_size=1)
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])
    parts = [data.batch_for_step(tokens, 16, 8, seed=3, step=5, rank=r, world_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), full_x), "ranks split the same global batch"
    again = data.batch_for_step(tokens, 16, 8, seed=3, step=5, rank=2, world_size=4)[0]
    assert torch.equal(again, parts[2])
    other_step = data.batch_for_step(tokens, 16, 8, seed=3, step=6, rank=0, world_size=1)[0]
    other_seed = data.batch_for_step(tokens, 16, 8, seed=4, step=5, rank=0, world_size=1)[0]
    assert not torch.equal(other_step, full_x) and not torch.equal(other_seed, full_x)
    with pytest.raises(ValueError, match="divisible"):
        data.batch_for_step(tokens, 16, 6, seed=0, step=0, rank=0, world_size=4)


def test_token_file_and_text_corpora(tmp_path):
    tokens = torch.randint(0, 60000, (1000,), dtype=torch.int32)
    raw = bytearray()
    for t in tokens.tolist():
        raw += int(t).to_bytes(2, "little")
    (tmp_path / "train.bin").write_bytes(bytes(raw))
    corpus = data.token_file_corpus(tmp_path / "train.bin")
    assert torch.equal(data.token_ids(torch.cat([corpus.train, corpus.val])), tokens.long())
    assert (corpus.train_max, corpus.val_max) == (int(tokens[:950].max()), int(tokens[950:].max()))
    assert (
        corpus.vocab_size is None
        and data.token_file_corpus(tmp_path / "train.bin", 60000).vocab_size == 60000
    )
    (tmp_path / "val.bin").write_bytes(bytes(raw[:200]))
    assert torch.equal(
        data.token_ids(data.token_file_corpus(tmp_path / "train.bin").val), tokens[:100].long()
    )
    (tmp_path / "t.txt").write_text("hello world " * 100)
    text = data.text_corpus(tmp_path / "t.txt")
    assert bytes(text.train[:11].tolist()) == b"hello world"


def _args(run_dir, cache, *extra):
    return parse_args(
        [
            "--preset",
            "tiny",
            "--steps",
            "8",
            "--batch-size",
            "8",
            "--warmup",
            "2",
            "--val-every",
            "4",
            "--val-batches",
            "1",
            "--run-dir",
            str(run_dir),
            "--cache-dir",
            str(cache),
            "--no-progress",
            *extra,
        ]
    )


def run_recipe(rank, world_size, run_dir, cache, extra):
    return train(_args(run_dir, cache, *extra))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def check_smoke_run(run_dir: Path, history: dict, optimizer: str, extra: list[str]) -> list[dict]:
    losses = [history["losses"][s] for s in range(1, 9)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.05, f"loss should fall: {losses}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and 0 < summary["optimizer_share"] < 1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["world_size"] == 2 and config["args"]["optimizer"] == optimizer
    assert config["tokens_per_step"] == 8 * 32 and config["loss_unit"] == "nats per byte"
    logged = records(run_dir)
    assert [r["step"] for r in logged] == list(range(1, 9))
    assert [r["step"] for r in logged if "val_loss" in r] == [4, 8]
    assert [r["train_loss"] for r in logged] == losses
    times = [r["time_s"] for r in logged]
    assert times == sorted(times) and all(r["grad_norm"] > 0 and r["tflops_per_rank"] > 0 for r in logged)
    if "--peak-tflops" in extra:
        assert all(r["mfu"] == pytest.approx(r["tflops_per_rank"] / 0.5) for r in logged)
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"
    else:
        assert "mfu" not in logged[0] and not (run_dir / "tensorboard").exists()
    for r in (
        logged if {"--qk-clip", "--max-logits"} & set(extra) else ()
    ):  # each layer's largest logit (2 layers)
        assert len(r["max_logit_per_layer"]) == 2 and r["max_logit"] == max(r["max_logit_per_layer"]) > 0
    return logged


def test_smoke_two_ranks_and_the_logged_gradient_norm_is_before_clipping(tmp_path, cache):
    runs = {
        "dmuon": ["--tensorboard", "--peak-tflops", "0.5", "--clip", "1e-3", "--qk-clip", "0.03"],
        "torch-muon": ["--clip", "0", "--max-logits"],
    }
    first_norms = []
    for optimizer, extra in runs.items():
        history = run_ranks(run_recipe, 2, tmp_path / optimizer, cache, ["--optimizer", optimizer, *extra])[0]
        first_norms.append(check_smoke_run(tmp_path / optimizer, history, optimizer, extra)[0]["grad_norm"])
    # Same model and first batch: the first norm is the same whether it is then clipped or not.
    assert first_norms[0] == pytest.approx(first_norms[1], rel=1e-6) and first_norms[0] > 1e-2


def test_ns_flags_reach_the_optimizer(tmp_path, cache):
    model = Transformer(preset("tiny", ffn_dim=48))
    for extra, dtype, algorithm in (
        ([], None, "standard"),
        (["--ns-dtype", "bfloat16", "--ns-algorithm", "gram"], torch.bfloat16, "gram"),
    ):
        (opt,) = build_optimizers(_args(tmp_path, cache, *extra), model)
        forms = {g["ns_algorithm"] for g in opt.param_groups if g["use_muon"]}
        assert opt.ns_dtype == dtype and forms == {algorithm}


def test_max_logits_are_each_layers_and_empty_where_a_layer_recorded_none():
    model = Transformer(preset("tiny"))
    first = model.blocks()[0].attention
    first.track_max_logits = True
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(tokens, tokens).backward()
    seen = model.max_logits()
    assert [t.shape for t in seen] == [torch.Size([first.n_heads]), torch.Size([0])]
    model.reset_max_logits()
    assert all(t.numel() == 0 for t in model.max_logits())


def test_gradient_norm_is_returned_before_clipping_and_clips():
    from recipes.build import gradient_norm

    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, tokens).backward()

    def norm() -> float:  # in float64: the float32 sums differ in order
        return torch.cat([p.grad.flatten() for p in model.parameters()]).double().norm().item()

    before = norm()
    assert gradient_norm(model, 0) == pytest.approx(before, rel=1e-5) and norm() == before
    assert gradient_norm(model, before / 4) == pytest.approx(before, rel=1e-5)
    assert norm() == pytest.approx(before / 4, rel=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_counts_what_runs(tie):
    # The math SDPA backend runs the whole T x T attention as bmm, so torch's flop counter sees
    # exactly the matmuls the formula counts (PaLM's 6 N + 12 L d T).
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from recipes.metrics import flops_per_token, matmul_params

    cfg = preset("tiny", tie_embeddings=tie)
    model = Transformer(cfg)
    assert matmul_params(cfg) == sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    assert counter.get_total_flops() == flops_per_token(cfg) * tokens.numel()


def _continued_losses(history):
    return [history["losses"][s] for s in range(5, 9)]


@pytest.mark.parametrize(
    "optimizer,layout",
    [
        ("dmuon", ["--ns-algorithm", "auto", "--ns-dtype", "bfloat16", "--ffn-dim", "48"]),
        ("adamw", []),
        ("dmuon", ["--replicas", "2"]),
        ("dmuon", ["--variant", "normuon"]),
    ],
)
def test_resume_continues_exactly(tmp_path, cache, optimizer, layout):
    full = run_ranks(
        run_recipe, 2, tmp_path / "a", cache, ["--optimizer", optimizer, "--save-every", "4", *layout]
    )[0]
    checkpoint = str(tmp_path / "a/checkpoints/step_0000004")
    resumed = run_ranks(
        run_recipe, 2, tmp_path / "b", cache, ["--optimizer", optimizer, "--resume", checkpoint, *layout]
    )[0]
    assert sorted(resumed["losses"]) == [5, 6, 7, 8]
    if "--ffn-dim" in layout:  # the run's model is the preset with this MLP width, resumed as saved
        for run in ("a", "b"):
            assert json.loads((tmp_path / run / "config.json").read_text())["model"]["ffn_dim"] == 48
    for a, b in zip(_continued_losses(full), _continued_losses(resumed), strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (a, b)


def test_resume_in_place_skips_a_partial_checkpoint_and_cuts_the_metrics_back(tmp_path, cache):
    first = run_ranks(run_recipe, 2, tmp_path, cache, ["--save-every", "2", "--keep-last", "2"])[0]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000006", "step_0000008"]
    run_id = json.loads((tmp_path / "config.json").read_text())["run_id"]
    (tmp_path / "checkpoints/step_0000008/.metadata").unlink()  # as if the last save was cut short
    again = run_ranks(
        run_recipe, 2, tmp_path, cache, ["--resume", str(tmp_path), "--save-every", "2", "--keep-last", "2"]
    )[0]
    assert sorted(again["losses"]) == [7, 8]
    for step in (7, 8):
        assert abs(again["losses"][step] - first["losses"][step]) <= 1e-6 * first["losses"][step]
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == list(range(1, 9)), "metrics cut back to step 6, then 7 and 8"
    assert [r["time_s"] for r in logged] == sorted(r["time_s"] for r in logged)
    assert json.loads((tmp_path / "config.json").read_text())["run_id"] == run_id
    assert (tmp_path / "checkpoints/step_0000008/.metadata").is_file(), "the partial save is redone"
    # The 2-rank checkpoint, loaded whole in this process (as recipes.sample does), gives the
    # validation loss the run logged at step 8: the same 8 windows, here in one batch.
    from recipes import checkpoint

    model = Transformer(preset("tiny"))
    checkpoint.load_model(tmp_path / "checkpoints/step_0000008", model)
    ((x, y),) = data.validation_batches(data.stdlib_corpus(cache).val, 32, 8, 1, rank=0, world_size=1)
    with torch.no_grad():
        assert float(model(x, y)) == pytest.approx(again["val"][8], rel=1e-5)


def test_resume_at_a_different_world_size(tmp_path, cache):
    full = run_ranks(run_recipe, 4, tmp_path / "w4", cache, ["--save-every", "4"])[0]
    resumed = run_ranks(
        run_recipe, 2, tmp_path / "w2", cache, ["--resume", str(tmp_path / "w4/checkpoints/step_0000004")]
    )[0]
    # Same global batches and state; only the order of reductions differs between 4 and 2 ranks.
    for a, b in zip(_continued_losses(full), _continued_losses(resumed), strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)


def test_gradient_accumulation_matches_one_large_batch(tmp_path, cache):
    one = run_ranks(run_recipe, 2, tmp_path / "one", cache, ["--steps", "3", "--optimizer", "adamw"])[0]
    two = run_ranks(
        run_recipe, 2, tmp_path / "two", cache, ["--steps", "3", "--optimizer", "adamw", "--grad-accum", "2"]
    )[0]
    for step in (1, 2, 3):
        assert abs(one["losses"][step] - two["losses"][step]) <= 1e-5 * one["losses"][step]


def test_overlap_backward_trains_exactly_as_the_plain_step(tmp_path, cache):
    # Gradient accumulation (no_sync on all but the last micro-batch), clipping and QK-clip, as trained.
    common = ["--steps", "4", "--grad-accum", "2", "--clip", "0.5", "--bucket-mib", "0.02"]
    common += ["--qk-clip", "0.03"]
    plain = run_ranks(run_recipe, 2, tmp_path / "plain", cache, common)[0]
    overlapped = run_ranks(run_recipe, 2, tmp_path / "overlap", cache, [*common, "--overlap-backward"])[0]
    assert overlapped["losses"] == plain["losses"]


def test_overlap_forward_trains_exactly_as_the_plain_step_and_resumes(tmp_path, cache):
    # HSDP (2, 1): every result reaches the other replica by relay, left to the next forward
    # (validation at step 4, the checkpoint's state dicts and the next step finish it).
    common = ["--steps", "8", "--replicas", "2", "--save-every", "4", "--bucket-mib", "0.02"]
    plain = run_ranks(run_recipe, 2, tmp_path / "plain", cache, common)[0]
    args = [*common, "--overlap-forward"]
    overlapped = run_ranks(run_recipe, 2, tmp_path / "overlap", cache, args)[0]
    assert overlapped["losses"] == plain["losses"] and overlapped["val"] == plain["val"]
    checkpoint = str(tmp_path / "overlap/checkpoints/step_0000004")
    resumed = run_ranks(run_recipe, 2, tmp_path / "resumed", cache, [*args, "--resume", checkpoint])[0]
    for a, b in zip(_continued_losses(plain), _continued_losses(resumed), strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (a, b)  # as test_resume_continues_exactly


def test_hsdp_replicas_train_like_fsdp(tmp_path, cache):
    # (replicate 2, shard 1): each matrix orthogonalized once across the two replicas; the same
    # global batches and averaged gradients as plain FSDP over 2 ranks.
    fsdp = run_ranks(run_recipe, 2, tmp_path / "fsdp", cache, ["--steps", "4"])[0]
    hsdp = run_ranks(run_recipe, 2, tmp_path / "hsdp", cache, ["--steps", "4", "--replicas", "2"])[0]
    for step in (1, 2, 3, 4):
        assert abs(fsdp["losses"][step] - hsdp["losses"][step]) <= 1e-5 * fsdp["losses"][step]
