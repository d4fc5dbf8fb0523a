"""Train a pi0-shaped vision-language-action policy with DMuonFSDP or AdamW, then judge it in
closed loop.

    torchrun --nproc-per-node 2 -m recipes.vla --optimizer dmuon

The task is made here (``recipes.episodes``): reach the object an instruction names among
distractors, seen in small RGB images; a scripted expert's episodes, cached per seed, teach the
policy (``recipes.policy``) to predict chunks of actions by flow matching. Under --parallel ddp
(torch's DistributedDataParallel, as lerobot and openpi train) or fsdp (``fully_shard`` of
each vision block and joint layer), with float32 or bfloat16 weights (DMuonFSDP keeps float32
main weights for them). Every --val-every steps the action error on held-out samples; at the
end the policy acts in the simulator on held-out episodes (chunks executed as pi0 does) and the
run dir gets its success rate in summary.json and a picture of rollouts (rollouts.png). The run
dir, resume, checkpoints, signals and exit statuses are those of ``recipes.pretrain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

if not __package__:  # run by path: the repository's recipes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmuon_fsdp import DMuonFSDP, clip_grad_norm_, param_groups
from recipes import episodes, options, run_dir, runner
from recipes.build import learning_rates
from recipes.metrics import peak_memory_mb, step_times
from recipes.options import UsageError, lr_factor
from recipes.policy import PRESETS, Policy, PolicyConfig, flow_matching_loss, preset, sample_actions
from recipes.runner import Rank0Files, save, should_save
from recipes.stop import StopSignals

DEFAULT_LR = {"dmuon": 0.02, "adamw": 2e-3}  # from the sweep in docs/embodied.md


def build_parser(description: str) -> argparse.ArgumentParser:
    p = options.Parser(description=description, formatter_class=options.HelpFormatter)
    model = p.add_argument_group("policy and task")
    model.add_argument("--preset", default="cpu-demo", choices=sorted(PRESETS), help="policy size")
    model.add_argument("--episodes", type=int, default=2000, help="expert episodes to train on")
    model.add_argument(
        "--eval-episodes", type=int, default=200, help="held-out episodes acted in closed loop"
    )
    model.add_argument(
        "--chunk-execute", type=int, default=4, help="actions of each chunk executed before the next query"
    )
    model.add_argument("--euler-steps", type=int, default=10, help="Euler steps of the flow per action chunk")
    model.add_argument("--cache-dir", default="runs/cache", help="where the episodes are cached")
    opt = p.add_argument_group("optimization")
    opt.add_argument(
        "--optimizer", default="dmuon", choices=sorted(DEFAULT_LR), help="dmuon: DMuonFSDP; adamw"
    )
    opt.add_argument("--steps", type=int, default=2000, help="optimizer steps of the whole run")
    opt.add_argument("--batch-size", type=int, default=64, help="global samples per optimizer step")
    opt.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak lr; the Muon lr for dmuon (default: 0.02, 2e-3 for adamw)",
    )
    opt.add_argument(
        "--adamw-lr", type=float, default=3e-3, help="AdamW lr of the input and output layers in dmuon runs"
    )
    opt.add_argument("--weight-decay", type=float, default=0.0, help="decoupled weight decay")
    options.add_schedule_flags(opt)
    opt.add_argument(
        "--parallel", default="ddp", choices=["ddp", "fsdp"], help="DistributedDataParallel or FSDP2"
    )
    opt.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the policy's weights"
    )
    options.add_run_flags(p)
    options.add_system_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return options.parse_args(argv, __doc__ or "", build_parser, DEFAULT_LR, "vla-{preset}-{optimizer}")


@dataclass
class Setup:
    data: episodes.TaskData
    cfg: PolicyConfig
    config: dict  # for config.json


def prepare(args: argparse.Namespace, world_size: int) -> Setup:
    """Every check that needs no process group, then the episodes (made once per seed, cached)."""
    saved = run_dir.saved_config(args)
    if saved is not None:
        options.continue_run(args, saved["args"])
    options.check_run_numbers(
        args,
        {
            "--episodes": (args.episodes, 1),
            "--eval-episodes": (args.eval_episodes, 1),
            "--chunk-execute": (args.chunk_execute, 1),
            "--euler-steps": (args.euler_steps, 1),
        },
        {},
    )
    for flag, value in (("--batch-size", args.batch_size), ("--eval-episodes", args.eval_episodes)):
        if value % world_size:
            raise UsageError(f"{flag} {value} must be divisible by the {world_size} ranks")
    run_dir.check_run_dir(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device here")
    task = episodes.TaskConfig()
    cfg = preset(
        args.preset,
        vocab_size=episodes.vocab_size(),
        text_len=episodes.MAX_TOKENS,
        image_size=task.image_size,
        chunk=task.chunk,
    )
    if args.chunk_execute > cfg.chunk:
        raise UsageError(
            f"--chunk-execute {args.chunk_execute} is longer than the policy's chunk of {cfg.chunk}"
        )
    data = episodes.load_or_make(args.cache_dir, args.seed, args.episodes, args.eval_episodes, task)
    description = f"reach task {task.digest()}: {args.episodes} episodes, seed {args.seed}"
    config = run_dir.make_config(
        args, world_size, description, dataclasses.asdict(cfg), task=dataclasses.asdict(task)
    )
    return Setup(data, cfg, config)


def build(
    args: argparse.Namespace, cfg: PolicyConfig, device: torch.device
) -> tuple[Policy, torch.nn.Module]:
    """The policy (seeded) and what a step calls: DDP's wrapper of it, or the policy with each
    vision block, each joint layer and the whole ``fully_shard``."""
    torch.manual_seed(args.seed)
    policy = Policy(cfg).to(device=device, dtype=getattr(torch, args.dtype))
    if args.parallel == "fsdp":
        for block in [*policy.vision, *policy.layers]:
            fully_shard(block)
        fully_shard(policy)
        return policy, policy
    return policy, DistributedDataParallel(policy)


def build_optimizer(args: argparse.Namespace, policy: Policy) -> torch.optim.Optimizer:
    if args.optimizer == "adamw":
        return torch.optim.AdamW(
            policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
        )
    routing = policy.routing()
    groups = param_groups(
        policy, lr=args.lr, weight_decay=args.weight_decay, head=routing["head"], adamw=routing["adamw"]
    )
    return DMuonFSDP(groups, adamw_lr=args.adamw_lr, adamw_weight_decay=args.weight_decay)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The draws of one rank's step (its samples, noise and times): from the seed, step and rank
    alone, so a resumed run draws what the uninterrupted one did."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4096 + rank)


def to_device(batch: episodes.Batch, device: torch.device) -> tuple[torch.Tensor, ...]:
    obs = batch.obs
    return tuple(x.to(device) for x in (obs.images, obs.tokens, obs.states, batch.actions, batch.mask))


@torch.no_grad()
def action_error(
    model: torch.nn.Module,
    cfg: PolicyConfig,
    val: episodes.Episodes,
    args: argparse.Namespace,
    device: torch.device,
) -> float:
    """Mean squared error of sampled chunks against the expert's on held-out samples (the same
    ones every time: 256 (episode, step) pairs), over every rank's share."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pick = torch.Generator().manual_seed(args.seed + 1)
    index = torch.randint(len(val), (256,), generator=pick)
    steps = torch.randint(val.config.horizon, (256,), generator=pick)
    mine = slice(rank * 256 // world, (rank + 1) * 256 // world)
    images, tokens, states, actions, mask = to_device(episodes.samples(val, index[mine], steps[mine]), device)
    sampled = sample_actions(
        model, cfg, images, tokens, states, torch.Generator().manual_seed(rank), args.euler_steps
    )
    total = torch.stack([((sampled - actions).square().mean(-1) * mask).sum(), mask.sum()]).double()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


@torch.no_grad()
def closed_loop(
    model: torch.nn.Module,
    cfg: PolicyConfig,
    val: episodes.Episodes,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[float, episodes.RolloutResult]:
    """The policy acting on this rank's share of the held-out episodes (every rank the same
    number: FSDP2's forward is collective); the success rate over all of them, and this rank's
    rollouts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = len(val) // world
    mine = val.subset(slice(rank * share, (rank + 1) * share))
    generator = torch.Generator().manual_seed(args.seed * 7919 + rank)

    def act(obs: episodes.Observation) -> torch.Tensor:
        chunk = sample_actions(
            model,
            cfg,
            obs.images.to(device),
            obs.tokens.to(device),
            obs.states.to(device),
            generator,
            args.euler_steps,
        )
        return chunk.clamp(-1, 1).cpu()

    result = episodes.rollout(act, mine, args.chunk_execute)
    successes = torch.tensor(
        [float(result.success.sum()), float(len(mine))], dtype=torch.float64, device=device
    )
    dist.all_reduce(successes)
    return (successes[0] / successes[1]).item(), result


def train(args: argparse.Namespace) -> dict:
    """Run training and the closed-loop evaluation; returns {"losses": {step: loss}, "val":
    {step: action error}, "success": rate} (the same on every rank)."""
    return runner.launch(args, prepare, run)


def run(
    args: argparse.Namespace,
    setup: Setup,
    start: run_dir.RunStart,
    device: torch.device,
    files: Rank0Files,
    stop: StopSignals,
) -> dict:
    data, cfg = setup.data, setup.cfg
    rank, world = files.rank, dist.get_world_size()
    policy, model = build(args, cfg, device)
    optimizer = build_optimizer(args, policy)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(args))
    runner.restore(start, policy, [optimizer], [scheduler])
    params = sum(p.numel() for p in policy.parameters())
    elapsed, log, console = runner.open_run(
        args,
        start,
        files,
        f"{args.optimizer}: {params / 1e6:.2f}M parameters ({args.dtype}), {args.parallel} over {world} "
        f"ranks on {device}, {setup.config['data']}",
    )
    history: dict = {"losses": {}, "val": {}}
    fb_times, opt_times = [], []
    saved = (start.step, start.checkpoint) if start.checkpoint is not None else (None, None)
    began = time.perf_counter()
    for step in range(start.step, args.steps):
        t0 = time.perf_counter()
        generator = step_generator(args.seed, step, rank)
        batch = episodes.random_batch(data.train, args.batch_size // world, generator)
        images, tokens, states, actions, mask = to_device(batch, device)
        loss = flow_matching_loss(model, images, tokens, states, actions, mask, generator)
        loss.backward()
        grad_norm = clip_grad_norm_(policy.parameters(), args.clip if args.clip > 0 else float("inf")).item()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        lrs = learning_rates(args, [optimizer])
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        loss_total, signalled = files.agree(loss.item(), float(stop.requested is not None))
        train_loss = history["losses"][step + 1] = loss_total / world
        fb_times.append(t1 - t0)
        opt_times.append(t2 - t1)
        record = {
            "step": step + 1,
            "train_loss": train_loss,
            "grad_norm": grad_norm,
            **lrs,
            "samples_per_s": args.batch_size / (t2 - t0),
            "fwd_bwd_ms": 1e3 * (t1 - t0),
            "opt_ms": 1e3 * (t2 - t1),
            "peak_memory_mb": peak_memory_mb(device),
        }
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            record["val_action_mse"] = history["val"][step + 1] = action_error(
                model, cfg, data.val, args, device
            )
        record["time_s"] = elapsed + time.perf_counter() - began
        if log:
            files.do(log.write, record)
        console.step(record)
        stopping = signalled > 0 and step + 1 < args.steps
        if should_save(args, step + 1, stopping, saved[0]):
            path = save(args, start.run_dir, step + 1, policy, [optimizer], [scheduler], console, files)
            saved = (step + 1, path)
        if stopping:
            runner.stop_after("recipes.vla", args, step + 1, saved[1], start, stop, console, files)
    console.close()
    success, rollouts = closed_loop(model, cfg, data.val, args, device)
    history["success"] = success
    summary = {
        "name": start.run_dir.name,
        "optimizer": args.optimizer,
        "preset": args.preset,
        "parallel": args.parallel,
        "dtype": args.dtype,
        "world_size": world,
        "steps": args.steps,
        "params": params,
        "lr": args.lr,
        "success": success,
        "eval_episodes": args.eval_episodes,
        "val_action_mse": history["val"].get(args.steps),
        "final_train_loss": history["losses"].get(args.steps),
        **step_times([1e3 * t for t in fb_times], [1e3 * t for t in opt_times]),
        "checkpoint": str(saved[1]) if saved[1] is not None else None,
    }
    if log:
        files.do(log.close)
    files.do(
        write_summary, start.run_dir, summary, rollouts, data.val.subset(slice(0, len(rollouts.success)))
    )
    files.agree()
    return history


def write_summary(
    directory: Path, summary: dict, rollouts: episodes.RolloutResult, shown: episodes.Episodes
) -> None:
    run_dir.replace_file(directory / "summary.json", json.dumps(summary, indent=2))
    episodes.draw_rollouts(rollouts, shown, directory / "rollouts.png")
    print(
        f"{summary['optimizer']}: closed-loop success {summary['success']:.1%} on {summary['eval_episodes']} "
        f"held-out episodes, val action mse {summary['val_action_mse']:.4f}, median step "
        f"{summary['median_step_ms']:.1f} ms; rollouts in {directory / 'rollouts.png'}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Train and evaluate; the exit status (``recipes.runner.main``)."""
    return runner.main(train, lambda: parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
