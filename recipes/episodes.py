"""A small simulated reaching task for a vision-language-action policy, made on the machine.

A table is the unit square [0, 1]^2. An end effector (a point, drawn as a white disc) starts at a
random position; ``n_objects`` discs of distinct colors (drawn from ``PALETTE``) lie at random
positions, at least ``min_separation`` apart from each other and from the start. An instruction
names one of them ("reach the red object", "go to the blue one", ...). The episode succeeds when,
after ``horizon`` control steps, the effector is within ``success_radius`` of the named object.

- State: the effector's position (x, y) in [0, 1] (proprioception).
- Action: a displacement in units of ``max_step``, so each coordinate is in [-1, 1]; the
  environment clips it to that box, moves the effector by ``action * max_step`` and clips the
  position to the table.
- Image: an RGB float32 tensor (3, S, S) in [0, 1], S = ``image_size``; pixel (row r, column c)
  has its center at x = (c + 0.5) / S, y = (r + 0.5) / S, so row 0 is y near 0 (show it with
  ``origin="lower"``). Disc edges are antialiased, so positions are visible below a pixel.
- Instruction: word ids from the fixed vocabulary ``VOCAB`` (id 0 pads), ``MAX_TOKENS`` long.
- Expert: moves straight at the target at full speed (the largest coordinate of the action is
  1 until the target is within a step), plus Gaussian noise of std ``expert_noise`` per action
  coordinate, so the demonstrations also show corrections.

``make_dataset`` plays the expert on ``n_train`` and ``n_val`` layouts drawn from two disjoint
random streams of one seed (the validation layouts are new) and keeps layouts and trajectories,
not pixels: images are a function of (layout, position) and ``render`` draws over ten thousand
32x32 frames a second on two CPU cores, so ``samples`` / ``random_batch`` render each training
batch when it is asked for (observation at step t, the next ``chunk`` expert actions, zero-padded
past the horizon, and their mask). ``load_or_make`` caches a dataset in a ``.pt`` file named
after its settings and seed. ``rollout`` runs a policy in closed loop on a batch of environments at
once, executing the first ``chunk_execute`` actions of each predicted chunk before it asks again
(as pi0 does), and ``draw_rollouts`` pictures the result.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

FORMAT_VERSION = 1

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.75, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.85, 0.10),
    "magenta": (0.85, 0.20, 0.85),
    "cyan": (0.10, 0.85, 0.85),
}
PALETTE_NAMES: tuple[str, ...] = tuple(PALETTE)
_PALETTE_RGB = np.array(list(PALETTE.values()), dtype=np.float32)
TABLE_RGB = (0.20, 0.20, 0.20)
EFFECTOR_RGB = (1.0, 1.0, 1.0)

TEMPLATES: tuple[str, ...] = (
    "reach the {color} object",
    "go to the {color} one",
    "move to the {color} block",
    "touch the {color} disc",
    "put the gripper on the {color} object",
)
PAD = "<pad>"
VOCAB: tuple[str, ...] = (
    PAD,
    *sorted({w for t in TEMPLATES for w in t.split() if w != "{color}"} | set(PALETTE_NAMES)),
)
PAD_ID = 0
MAX_TOKENS = max(len(t.split()) for t in TEMPLATES)
_WORD_ID = {w: i for i, w in enumerate(VOCAB)}


def vocab_size() -> int:
    """The number of token ids (the padding id included)."""
    return len(VOCAB)


def instruction_text(color: str, template: int = 0) -> str:
    """The instruction naming ``color`` in template number ``template``."""
    if color not in PALETTE:
        raise ValueError(f"color: {color!r} is not in the palette {PALETTE_NAMES}")
    if not 0 <= template < len(TEMPLATES):
        raise ValueError(f"template: {template} is not in [0, {len(TEMPLATES)})")
    return TEMPLATES[template].format(color=color)


def tokenize(text: str) -> list[int]:
    """Word ids of an instruction, padded with ``PAD_ID`` to ``MAX_TOKENS``."""
    words = text.lower().split()
    unknown = [w for w in words if w not in _WORD_ID]
    if unknown:
        raise ValueError(f"text: words {unknown} are not in the vocabulary")
    if len(words) > MAX_TOKENS:
        raise ValueError(f"text: {len(words)} words, more than MAX_TOKENS={MAX_TOKENS}")
    return [_WORD_ID[w] for w in words] + [PAD_ID] * (MAX_TOKENS - len(words))


def detokenize(ids: list[int] | torch.Tensor) -> str:
    """The words of a token id sequence, padding dropped."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    return " ".join(VOCAB[i] for i in values if i != PAD_ID)


@dataclass(frozen=True)
class TaskConfig:
    """The task's sizes. ``object_radius`` is the drawn radius of an object and also the margin
    that keeps objects and the start inside the table; ``chunk`` is the number of future actions
    a training sample holds (the policy's action horizon)."""

    image_size: int = 32
    n_objects: int = 3
    colors: tuple[str, ...] = PALETTE_NAMES
    horizon: int = 40
    chunk: int = 8
    max_step: float = 0.05
    success_radius: float = 0.06
    object_radius: float = 0.07
    effector_radius: float = 0.04
    min_separation: float = 0.2
    expert_noise: float = 0.1

    def __post_init__(self) -> None:
        # A list from JSON or a caller becomes a tuple, so the config stays hashable and equal.
        object.__setattr__(self, "colors", tuple(self.colors))
        unknown = [c for c in self.colors if c not in PALETTE]
        if unknown:
            raise ValueError(f"colors: {unknown} are not in the palette {PALETTE_NAMES}")
        if len(set(self.colors)) != len(self.colors):
            raise ValueError(f"colors: {self.colors} repeats a color")
        if self.image_size < 8:
            raise ValueError(f"image_size: {self.image_size}, must be at least 8 pixels")
        if not 1 <= self.n_objects <= len(self.colors):
            raise ValueError(
                f"n_objects: {self.n_objects}, must be in [1, {len(self.colors)}] (one distinct color each)"
            )
        if self.horizon < 1:
            raise ValueError(f"horizon: {self.horizon}, must be at least 1 step")
        if not 1 <= self.chunk <= self.horizon:
            raise ValueError(f"chunk: {self.chunk}, must be in [1, horizon={self.horizon}]")
        for name in ("max_step", "success_radius", "object_radius", "effector_radius"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: {getattr(self, name)}, must be positive")
        if not 0 < self.object_radius < 0.5:
            raise ValueError(f"object_radius: {self.object_radius}, must be below 0.5 (half the table)")
        if self.horizon * self.max_step < 1:
            # Otherwise the expert cannot cross the table: some layouts would be unreachable.
            raise ValueError(
                f"horizon: {self.horizon} steps of max_step={self.max_step} cannot cross the table"
            )
        if self.min_separation < 2 * self.object_radius or self.min_separation <= self.success_radius:
            # Objects must not overlap (the renderer composes them), and the start must be outside
            # every success disc, so a policy that does not move always fails.
            raise ValueError(
                f"min_separation: {self.min_separation}, must be at least 2 * object_radius="
                f"{2 * self.object_radius} and above success_radius={self.success_radius}"
            )
        if self.expert_noise < 0:
            raise ValueError(f"expert_noise: {self.expert_noise}, must be non-negative")

    def digest(self) -> str:
        """A short hash of every setting (names a cache file)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(f"v{FORMAT_VERSION}:{text}".encode()).hexdigest()[:10]


@dataclass
class Episodes:
    """N episodes: layouts, instructions and the expert's trajectory. ``colors`` holds indices
    into ``PALETTE_NAMES``; ``target`` is the slot in ``objects`` the instruction names;
    ``actions[:, t]`` (normalized, in [-1, 1]) moves ``positions[:, t]`` to ``positions[:, t + 1]``."""

    config: TaskConfig
    start: torch.Tensor  # (N, 2) float32
    objects: torch.Tensor  # (N, K, 2) float32
    colors: torch.Tensor  # (N, K) int64
    target: torch.Tensor  # (N,) int64
    template: torch.Tensor  # (N,) int64
    tokens: torch.Tensor  # (N, MAX_TOKENS) int64
    positions: torch.Tensor  # (N, T + 1, 2) float32
    actions: torch.Tensor  # (N, T, 2) float32

    _TENSORS: ClassVar[tuple[str, ...]] = (
        "start",
        "objects",
        "colors",
        "target",
        "template",
        "tokens",
        "positions",
        "actions",
    )

    def __len__(self) -> int:
        return self.start.shape[0]

    @property
    def target_xy(self) -> torch.Tensor:
        """(N, 2) position of the named object."""
        return self.objects[torch.arange(len(self)), self.target]

    def instruction(self, i: int) -> str:
        color = PALETTE_NAMES[int(self.colors[i, self.target[i]])]
        return instruction_text(color, int(self.template[i]))

    def subset(self, index: torch.Tensor | slice | list[int]) -> Episodes:
        """The episodes at ``index``, in that order."""
        picked = {name: getattr(self, name)[index] for name in self._TENSORS}
        return Episodes(config=self.config, **picked)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self._TENSORS}


@dataclass
class TaskData:
    """A training and a held-out set of one seed."""

    seed: int
    train: Episodes
    val: Episodes

    @property
    def config(self) -> TaskConfig:
        return self.train.config


@dataclass
class Observation:
    """What a policy sees of B environments. ``episode_index`` says which episode of the evaluated
    ``Episodes`` each row is: only scripted policies (the expert) may read it."""

    images: torch.Tensor  # (B, 3, S, S) float32 in [0, 1]
    states: torch.Tensor  # (B, 2) float32 effector position
    tokens: torch.Tensor  # (B, MAX_TOKENS) int64
    episode_index: torch.Tensor  # (B,) int64


@dataclass
class Batch:
    """Training samples: the observation at step ``step`` of episode ``episode_index`` and the
    expert's next ``chunk`` actions; ``mask`` is False where the chunk runs past the horizon
    (those actions are zeros: holding still)."""

    obs: Observation
    actions: torch.Tensor  # (B, H, 2) float32 in [-1, 1]
    mask: torch.Tensor  # (B, H) bool
    step: torch.Tensor  # (B,) int64


Policy = Callable[[Observation], torch.Tensor]


@dataclass
class RolloutResult:
    """Closed-loop outcome of N episodes."""

    success_rate: float
    success: torch.Tensor  # (N,) bool
    final_distance: torch.Tensor  # (N,) float32 distance to the named object at the horizon
    paths: torch.Tensor  # (N, T + 1, 2) float32 effector positions, the start included
    chunk_execute: int
    queries: int  # policy calls per episode


def render(
    objects: torch.Tensor, colors: torch.Tensor, effector: torch.Tensor, config: TaskConfig
) -> torch.Tensor:
    """(B, 3, S, S) float32 images of B scenes: ``objects`` (B, K, 2), ``colors`` (B, K) palette
    indices, ``effector`` (B, 2); the effector is drawn over the objects."""
    # numpy, not torch: torch's CPU kernels for these small broadcast products ran several times
    # slower here (torch 2.13, 2 cores).
    s = config.image_size
    b, k = colors.shape
    centers = (np.arange(s, dtype=np.float32) + 0.5) / s
    xy = np.concatenate(
        [objects.detach().cpu().numpy(), effector.detach().cpu().numpy()[:, None]], axis=1
    ).astype(np.float32)
    dx2 = np.square(centers - xy[..., 0:1])  # (B, K + 1, S) over columns
    dy2 = np.square(centers - xy[..., 1:2])  # (B, K + 1, S) over rows
    distance = np.sqrt(dy2[..., :, None] + dx2[..., None, :]).reshape(b, k + 1, s * s)
    radius = np.full((k + 1, 1), config.object_radius, dtype=np.float32)
    radius[k] = config.effector_radius
    # The fraction of each pixel inside each disc, from the signed distance to the edge in pixels
    # (a cheap antialiasing). Objects never overlap (min_separation >= 2 * object_radius), so
    # their fractions sum to at most 1 and the table takes the rest.
    cover = np.clip((radius - distance) * s + 0.5, 0.0, 1.0)
    over = cover[:, k]
    weights = np.empty((b, k + 2, s * s), dtype=np.float32)
    weights[:, 0] = 1.0 - cover[:, :k].sum(axis=1)
    weights[:, 1 : k + 1] = cover[:, :k]
    weights[:, : k + 1] *= (1.0 - over)[:, None]
    weights[:, k + 1] = over
    rgb = np.empty((b, 3, k + 2), dtype=np.float32)
    rgb[:, :, 0] = TABLE_RGB
    rgb[:, :, 1 : k + 1] = _PALETTE_RGB[colors.cpu().numpy()].transpose(0, 2, 1)
    rgb[:, :, k + 1] = EFFECTOR_RGB
    return torch.from_numpy(np.matmul(rgb, weights).reshape(b, 3, s, s))


def step(positions: torch.Tensor, actions: torch.Tensor, config: TaskConfig) -> torch.Tensor:
    """The next effector positions after normalized ``actions`` (clipped to [-1, 1])."""
    return (positions + actions.clamp(-1.0, 1.0) * config.max_step).clamp(0.0, 1.0)


def expert_action(positions: torch.Tensor, targets: torch.Tensor, config: TaskConfig) -> torch.Tensor:
    """Noise-free expert actions: straight at the target, the largest coordinate at full speed
    until the target is within one step, then exactly onto it."""
    delta = targets - positions
    scale = delta.abs().amax(dim=-1, keepdim=True).clamp(min=config.max_step)
    return delta / scale


def observe(episodes: Episodes, index: torch.Tensor, positions: torch.Tensor) -> Observation:
    """The observation of episodes ``index`` with the effector at ``positions``."""
    images = render(episodes.objects[index], episodes.colors[index], positions, episodes.config)
    return Observation(images, positions.clone(), episodes.tokens[index], index)


def _check_count(name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: {value!r}, must be an integer of at least {least}")


def _sample_layouts(rng: np.random.Generator, n: int, config: TaskConfig) -> np.ndarray:
    """(n, K + 1, 2) points, the start first, pairwise at least min_separation apart, by rejection
    of whole layouts (resampled in place, so the draw stays a function of the seed)."""
    lo, hi = config.object_radius, 1.0 - config.object_radius
    k = config.n_objects + 1
    points = rng.uniform(lo, hi, size=(n, k, 2))
    pairs = np.triu_indices(k, 1)
    for _ in range(10_000):
        gaps = np.linalg.norm(points[:, pairs[0]] - points[:, pairs[1]], axis=-1)
        crowded = (gaps < config.min_separation).any(axis=1)
        if not crowded.any():
            return points
        points[crowded] = rng.uniform(lo, hi, size=(int(crowded.sum()), k, 2))
    raise ValueError(
        f"min_separation: {config.min_separation} leaves no room for n_objects={config.n_objects} "
        f"and the start on the table"
    )


def make_episodes(rng: np.random.Generator, n: int, config: TaskConfig) -> Episodes:
    """``n`` episodes drawn from ``rng``, with the expert's (noisy) closed-loop trajectories."""
    _check_count("n", n, 0)
    layouts = _sample_layouts(rng, n, config)
    allowed = np.array([PALETTE_NAMES.index(c) for c in config.colors])
    # A random permutation of the allowed colors per episode; its first K are the objects' colors.
    colors = allowed[np.argsort(rng.random((n, len(allowed))), axis=1)[:, : config.n_objects]]
    target = rng.integers(0, config.n_objects, size=n)
    template = rng.integers(0, len(TEMPLATES), size=n)
    noise = rng.standard_normal((n, config.horizon, 2)) * config.expert_noise

    table = torch.tensor(
        [[tokenize(instruction_text(c, t)) for t in range(len(TEMPLATES))] for c in PALETTE_NAMES]
    )
    colors_t = torch.from_numpy(colors).long()
    target_t = torch.from_numpy(target).long()
    template_t = torch.from_numpy(template).long()
    named = colors_t[torch.arange(n), target_t]
    objects = torch.from_numpy(layouts[:, 1:]).float()
    start = torch.from_numpy(layouts[:, 0]).float()

    goal = objects[torch.arange(n), target_t]
    noise_t = torch.from_numpy(noise).float()
    positions = torch.empty(n, config.horizon + 1, 2)
    actions = torch.empty(n, config.horizon, 2)
    positions[:, 0] = start
    for t in range(config.horizon):
        action = (expert_action(positions[:, t], goal, config) + noise_t[:, t]).clamp(-1.0, 1.0)
        actions[:, t] = action
        positions[:, t + 1] = step(positions[:, t], action, config)
    return Episodes(
        config=config,
        start=start,
        objects=objects,
        colors=colors_t,
        target=target_t,
        template=template_t,
        tokens=table[named, template_t],
        positions=positions,
        actions=actions,
    )


def make_dataset(seed: int, n_train: int, n_val: int, config: TaskConfig | None = None) -> TaskData:
    """Train and held-out episodes of ``seed``, from two independent streams of it: the same seed
    gives bitwise the same tensors, and no held-out layout is a training layout."""
    config = config or TaskConfig()
    _check_count("seed", seed, 0)
    _check_count("n_train", n_train, 1)
    _check_count("n_val", n_val, 0)
    train = make_episodes(np.random.default_rng([seed, 0]), n_train, config)
    val = make_episodes(np.random.default_rng([seed, 1]), n_val, config)
    return TaskData(seed=seed, train=train, val=val)


def cache_path(cache_dir: str | Path, seed: int, n_train: int, n_val: int, config: TaskConfig) -> Path:
    """Where ``load_or_make`` keeps a dataset: its name carries the main settings and a hash of all."""
    c = config
    name = (
        f"reach-seed{seed}-train{n_train}-val{n_val}-k{c.n_objects}-img{c.image_size}-"
        f"T{c.horizon}-H{c.chunk}-{c.digest()}.pt"
    )
    return Path(cache_dir) / name


def load_or_make(
    cache_dir: str | Path, seed: int, n_train: int, n_val: int, config: TaskConfig | None = None
) -> TaskData:
    """The dataset of these settings, read from ``cache_dir`` if made before, else made and saved."""
    config = config or TaskConfig()
    path = cache_path(cache_dir, seed, n_train, n_val, config)
    if path.exists():
        stored = torch.load(path, weights_only=True)
        if stored["format"] != FORMAT_VERSION or TaskConfig(**stored["config"]) != config:
            raise ValueError(f"cache_dir: {path} holds a dataset of other settings; delete it")
        return TaskData(
            seed=stored["seed"],
            train=Episodes(config=config, **stored["train"]),
            val=Episodes(config=config, **stored["val"]),
        )
    data = make_dataset(seed, n_train, n_val, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT_VERSION,
        "seed": seed,
        "config": dataclasses.asdict(config),
        "train": data.train.tensors(),
        "val": data.val.tensors(),
    }
    # Written aside and renamed, so a reader (another rank, a killed run) never sees half a file.
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(payload, tmp)
    tmp.replace(path)
    return data


def samples(episodes: Episodes, episode_index: torch.Tensor, step_index: torch.Tensor) -> Batch:
    """Training samples at (episode, step) pairs; steps in [0, horizon)."""
    config = episodes.config
    episode_index = torch.as_tensor(episode_index, dtype=torch.long)
    step_index = torch.as_tensor(step_index, dtype=torch.long)
    if episode_index.shape != step_index.shape or episode_index.dim() != 1:
        raise ValueError(
            f"step_index: shape {tuple(step_index.shape)} must match episode_index "
            f"{tuple(episode_index.shape)}, one dimension"
        )
    if len(episode_index) and not 0 <= int(episode_index.min()) <= int(episode_index.max()) < len(episodes):
        raise ValueError(f"episode_index: outside [0, {len(episodes)})")
    if len(step_index) and not 0 <= int(step_index.min()) <= int(step_index.max()) < config.horizon:
        raise ValueError(f"step_index: outside [0, horizon={config.horizon})")
    times = step_index[:, None] + torch.arange(config.chunk)  # (B, H)
    mask = times < config.horizon
    rows = episode_index[:, None] * config.horizon + times.clamp(max=config.horizon - 1)
    # index_select on the flattened steps: torch's broadcast advanced indexing was slow here.
    chunks = episodes.actions.reshape(-1, 2).index_select(0, rows.reshape(-1)).view(*rows.shape, 2)
    chunks = chunks * mask.unsqueeze(-1)
    obs = observe(episodes, episode_index, episodes.positions[episode_index, step_index])
    return Batch(obs=obs, actions=chunks, mask=mask, step=step_index)


def random_batch(episodes: Episodes, batch_size: int, generator: torch.Generator) -> Batch:
    """``batch_size`` samples at uniformly drawn (episode, step) pairs."""
    _check_count("batch_size", batch_size, 1)
    episode_index = torch.randint(len(episodes), (batch_size,), generator=generator)
    step_index = torch.randint(episodes.config.horizon, (batch_size,), generator=generator)
    return samples(episodes, episode_index, step_index)


def expert_policy(episodes: Episodes, noise: float = 0.0, seed: int = 0) -> Policy:
    """The scripted expert as a policy on ``episodes``: an open-loop chunk of ``chunk`` actions
    planned from the current state (it reads ``Observation.episode_index`` to know the target)."""
    if noise < 0:
        raise ValueError(f"noise: {noise}, must be non-negative")
    config = episodes.config
    goals = episodes.target_xy
    generator = torch.Generator().manual_seed(seed)

    def policy(obs: Observation) -> torch.Tensor:
        goal = goals[obs.episode_index]
        position = obs.states
        chunk = []
        for _ in range(config.chunk):
            a = expert_action(position, goal, config)
            if noise:
                a = a + noise * torch.randn(a.shape, generator=generator)
            a = a.clamp(-1.0, 1.0)
            chunk.append(a)
            position = step(position, a, config)
        return torch.stack(chunk, dim=1)

    return policy


@torch.no_grad()
def rollout(
    policy: Policy, episodes: Episodes, chunk_execute: int | None = None, batch_size: int | None = None
) -> RolloutResult:
    """Run ``policy`` on every episode in closed loop, all environments stepped together. The
    policy takes an ``Observation`` and returns (B, H, 2) normalized action chunks; the first
    ``chunk_execute`` actions of each are executed before it is asked again (default: half the
    config's chunk). ``batch_size`` bounds how many environments one policy call sees."""
    config = episodes.config
    n = len(episodes)
    if chunk_execute is None:
        chunk_execute = max(1, config.chunk // 2)
    _check_count("chunk_execute", chunk_execute, 1)
    if chunk_execute > config.horizon:
        raise ValueError(f"chunk_execute: {chunk_execute}, more than horizon={config.horizon}")
    if batch_size is not None:
        _check_count("batch_size", batch_size, 1)
    index = torch.arange(n)
    paths = torch.empty(n, config.horizon + 1, 2)
    paths[:, 0] = episodes.start
    plan = torch.zeros(n, chunk_execute, 2)
    queries = 0
    for t in range(config.horizon):
        k = t % chunk_execute
        if k == 0:
            plan = _query(policy, episodes, index, paths[:, t], chunk_execute, batch_size or max(n, 1))
            queries += 1
        paths[:, t + 1] = step(paths[:, t], plan[:, k], config)
    distance = (paths[:, -1] - episodes.target_xy).norm(dim=-1)
    success = distance <= config.success_radius
    return RolloutResult(
        success_rate=float(success.float().mean()) if n else 0.0,
        success=success,
        final_distance=distance,
        paths=paths,
        chunk_execute=chunk_execute,
        queries=queries,
    )


def _query(
    policy: Policy,
    episodes: Episodes,
    index: torch.Tensor,
    positions: torch.Tensor,
    chunk_execute: int,
    batch_size: int,
) -> torch.Tensor:
    """The first ``chunk_execute`` actions of the policy's chunks for all environments."""
    parts = []
    for lo in range(0, len(index), batch_size):
        rows = index[lo : lo + batch_size]
        out = policy(observe(episodes, rows, positions[lo : lo + batch_size]))
        if out.dim() != 3 or out.shape[0] != len(rows) or out.shape[2] != 2:
            raise ValueError(f"policy: returned shape {tuple(out.shape)}, expected ({len(rows)}, H, 2)")
        if out.shape[1] < chunk_execute:
            raise ValueError(
                f"chunk_execute: {chunk_execute}, more than the policy's chunk of {out.shape[1]}"
            )
        if not torch.isfinite(out).all():
            raise ValueError("policy: returned non-finite actions")
        parts.append(out[:, :chunk_execute].float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0, chunk_execute, 2)


def draw_rollouts(
    result: RolloutResult, episodes: Episodes, path: str | Path, count: int = 8, columns: int = 4
) -> Path:
    """A PNG grid of the first ``count`` episodes: objects in their colors, the named one circled
    (dashed: the success radius), the start (hollow circle), the path and the end (cross); the
    title gives the instruction and the outcome."""
    # A bare Figure draws with Agg and leaves pyplot's global backend and figure list alone.
    from matplotlib.figure import Figure
    from matplotlib.patches import Circle

    _check_count("count", count, 1)
    _check_count("columns", columns, 1)
    if len(result.success) != len(episodes):
        raise ValueError(f"result: {len(result.success)} episodes, but episodes has {len(episodes)}")
    count = min(count, len(episodes))
    if count == 0:
        raise ValueError("episodes: empty, nothing to draw")
    config = episodes.config
    rows = (count + columns - 1) // columns
    cols = min(columns, count)
    fig = Figure(figsize=(2.6 * cols, 2.9 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    for i, ax in enumerate(axes.flat[:count]):
        ax.set_facecolor(TABLE_RGB)
        for k in range(config.n_objects):
            x, y = episodes.objects[i, k].tolist()
            color = PALETTE[PALETTE_NAMES[int(episodes.colors[i, k])]]
            ax.add_patch(Circle((x, y), config.object_radius, facecolor=color, edgecolor="black", lw=0.5))
        gx, gy = episodes.target_xy[i].tolist()
        ax.add_patch(Circle((gx, gy), config.success_radius, fill=False, edgecolor="white", lw=1.2, ls="--"))
        ax.add_patch(Circle((gx, gy), config.object_radius + 0.03, fill=False, edgecolor="white", lw=1.0))
        trail = result.paths[i].numpy()
        ok = bool(result.success[i])
        ax.plot(trail[:, 0], trail[:, 1], color="white", lw=1.0, alpha=0.9)
        ax.plot(*trail[0], marker="o", ms=7, mfc="none", mec="white", mew=1.2)
        ax.plot(*trail[-1], marker="x", ms=8, color="lime" if ok else "orangered", mew=2.0)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        outcome = "success" if ok else "FAIL"
        ax.set_title(
            f"{episodes.instruction(i)}\n{outcome}, d={float(result.final_distance[i]):.3f}",
            fontsize=7,
            color="darkgreen" if ok else "firebrick",
        )
    fig.suptitle(f"success rate {result.success_rate:.2f} over {len(episodes)} episodes", fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
