"""The simulated reaching task of recipes/episodes.py: determinism, cache, expert, rendering, rollout."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from recipes import episodes as ep
from recipes.episodes import Episodes, Observation, TaskConfig


@pytest.fixture(scope="module")
def data() -> ep.TaskData:
    return ep.make_dataset(seed=7, n_train=64, n_val=200)


def _equal(a: Episodes, b: Episodes) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values(), strict=True))


def test_same_seed_is_bitwise_equal_and_another_seed_differs(data: ep.TaskData) -> None:
    again = ep.make_dataset(seed=7, n_train=64, n_val=200)
    assert _equal(data.train, again.train) and _equal(data.val, again.val)
    other = ep.make_dataset(seed=8, n_train=64, n_val=200)
    assert not torch.equal(data.train.objects, other.train.objects)
    # The held-out layouts come from another stream: none repeats a training start.
    gaps = torch.cdist(data.val.start, data.train.start)
    assert gaps.min() > 0


def test_layouts_respect_the_separation_and_colors_are_distinct(data: ep.TaskData) -> None:
    config = data.config
    points = torch.cat([data.train.start[:, None], data.train.objects], dim=1)
    gaps = torch.cdist(points, points) + torch.eye(points.shape[1]) * 10
    assert gaps.min() >= config.min_separation - 1e-6
    assert all(len(set(row.tolist())) == config.n_objects for row in data.train.colors)
    assert points.min() >= config.object_radius and points.max() <= 1 - config.object_radius


def test_cache_is_written_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = TaskConfig(horizon=30, chunk=6)
    first = ep.load_or_make(tmp_path, seed=1, n_train=20, n_val=5, config=config)
    (path,) = tmp_path.glob("*.pt")
    assert path == ep.cache_path(tmp_path, 1, 20, 5, config)
    assert "seed1" in path.name and "train20" in path.name and "T30" in path.name
    stamp = path.stat().st_mtime_ns

    def no_generation(*args: object, **kwargs: object) -> ep.TaskData:
        raise AssertionError("the cached dataset should have been read, not made again")

    monkeypatch.setattr(ep, "make_dataset", no_generation)
    second = ep.load_or_make(tmp_path, seed=1, n_train=20, n_val=5, config=config)
    assert path.stat().st_mtime_ns == stamp
    assert second.config == config and second.seed == 1
    assert _equal(first.train, second.train) and _equal(first.val, second.val)
    monkeypatch.undo()
    ep.load_or_make(tmp_path, seed=2, n_train=20, n_val=5, config=config)
    assert len(list(tmp_path.glob("*.pt"))) == 2


@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_expert_succeeds_in_closed_loop(data: ep.TaskData, noise: float) -> None:
    result = ep.rollout(ep.expert_policy(data.val, noise=noise), data.val, chunk_execute=4)
    assert result.success_rate >= 0.98
    assert result.paths.shape == (200, data.config.horizon + 1, 2)
    assert result.queries == math.ceil(data.config.horizon / 4)
    # The recorded demonstrations (noisy expert) succeed too.
    final = (data.train.positions[:, -1] - data.train.target_xy).norm(dim=-1)
    assert (final <= data.config.success_radius).float().mean() >= 0.98


def test_a_policy_that_does_not_move_fails(data: ep.TaskData) -> None:
    def still(obs: Observation) -> torch.Tensor:
        return torch.zeros(len(obs.states), data.config.chunk, 2)

    result = ep.rollout(still, data.val)
    assert result.success_rate == 0.0
    assert torch.equal(result.paths[:, -1], data.val.start)


def test_chunks_are_executed_in_order(data: ep.TaskData) -> None:
    """The first chunk_execute actions of each chunk run; the rest are dropped."""
    few = data.val.subset(slice(0, 4))

    def right_then_left(obs: Observation) -> torch.Tensor:
        chunk = torch.zeros(len(obs.states), 4, 2)
        chunk[:, 0, 0] = 1.0
        chunk[:, 1:, 0] = -1.0
        return chunk

    step = data.config.max_step
    once = ep.rollout(right_then_left, few, chunk_execute=1)
    assert torch.allclose(once.paths[:, 1, 0] - once.paths[:, 0, 0], torch.full((4,), step))
    assert torch.all(once.paths[:, -1, 0] == 1.0)  # always right, clipped at the table's edge
    twice = ep.rollout(right_then_left, few, chunk_execute=2)
    assert torch.allclose(twice.paths[:, -1], few.start, atol=1e-6)  # right, left, right, left...
    split = ep.rollout(ep.expert_policy(few), few, batch_size=3)
    assert torch.equal(split.paths, ep.rollout(ep.expert_policy(few), few).paths)


def test_images_show_the_named_color_at_its_position(data: ep.TaskData) -> None:
    config = data.config
    n = 32
    batch = ep.samples(data.train, torch.arange(n), torch.zeros(n, dtype=torch.long))
    images = batch.obs.images
    assert images.shape == (n, 3, config.image_size, config.image_size) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1

    def pixel(i: int, xy: torch.Tensor) -> torch.Tensor:
        col, row = (xy * config.image_size).long().clamp(max=config.image_size - 1).tolist()
        return images[i, :, row, col]

    for i in range(n):
        words = ep.detokenize(batch.obs.tokens[i]).split()
        (named,) = [w for w in words if w in ep.PALETTE]
        target = data.train.target_xy[i]
        assert torch.allclose(pixel(i, target), torch.tensor(ep.PALETTE[named]), atol=1e-5)
        assert torch.allclose(pixel(i, data.train.start[i]), torch.tensor(ep.EFFECTOR_RGB), atol=1e-5)
        assert ep.detokenize(data.train.tokens[i]) == data.train.instruction(i)


def test_samples_hold_the_next_expert_actions_with_a_mask(data: ep.TaskData) -> None:
    config = data.config
    steps = torch.tensor([0, 5, config.horizon - config.chunk, config.horizon - 3, config.horizon - 1])
    episodes = torch.tensor([0, 1, 2, 3, 4])
    batch = ep.samples(data.train, episodes, steps)
    assert batch.actions.shape == (5, config.chunk, 2) and batch.mask.shape == (5, config.chunk)
    assert batch.mask.sum(dim=1).tolist() == [config.chunk, config.chunk, config.chunk, 3, 1]
    for row, (e, t) in enumerate(zip(episodes.tolist(), steps.tolist(), strict=True)):
        real = int(batch.mask[row].sum())
        assert torch.equal(batch.actions[row, :real], data.train.actions[e, t : t + real])
        assert torch.all(batch.actions[row, real:] == 0)
        assert torch.equal(batch.obs.states[row], data.train.positions[e, t])
    assert data.train.actions.abs().max() <= 1
    drawn = ep.random_batch(data.train, 16, torch.Generator().manual_seed(0))
    assert drawn.obs.images.shape[0] == 16 and drawn.obs.tokens.shape == (16, ep.MAX_TOKENS)
    assert int(data.train.tokens.max()) < ep.vocab_size()


def test_bad_arguments_are_named(data: ep.TaskData) -> None:
    cases = [
        ("n_train", lambda: ep.make_dataset(0, -1, 1)),
        ("n_val", lambda: ep.make_dataset(0, 1, -5)),
        ("seed", lambda: ep.make_dataset(-1, 1, 1)),
        ("chunk", lambda: TaskConfig(horizon=40, chunk=41)),
        ("colors", lambda: TaskConfig(colors=("red", "purple", "blue"))),
        ("n_objects", lambda: TaskConfig(n_objects=4, colors=("red", "green", "blue"))),
        ("horizon", lambda: TaskConfig(horizon=10)),
        ("min_separation", lambda: TaskConfig(min_separation=0.05)),
        ("color", lambda: ep.instruction_text("purple")),
        ("text", lambda: ep.tokenize("reach the purple object")),
        ("chunk_execute", lambda: ep.rollout(ep.expert_policy(data.val), data.val, chunk_execute=0)),
        ("chunk_execute", lambda: ep.rollout(ep.expert_policy(data.val), data.val, chunk_execute=9)),
        ("policy", lambda: ep.rollout(lambda obs: torch.zeros(len(obs.states), 2), data.val)),
        ("min_separation", lambda: ep.make_dataset(0, 4, 0, TaskConfig(n_objects=6, min_separation=0.6))),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=f"^{name}:"):
            call()


def test_picture_is_written(data: ep.TaskData, tmp_path: Path) -> None:
    few = data.val.subset(slice(0, 8))
    result = ep.rollout(ep.expert_policy(few, noise=0.3), few)
    out = ep.draw_rollouts(result, few, tmp_path / "pictures" / "rollouts.png")
    assert out.exists() and out.stat().st_size > 1000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
