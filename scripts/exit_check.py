"""Do training jobs end cleanly? Runs N short torchrun jobs (2 CPU ranks, gloo) of FSDP2 + an
optimizer, each ending with ``destroy_process_group()`` and a normal interpreter exit, and counts
the jobs whose exit status is not 0 (e.g. a rank aborting at exit with "terminate called without
an active exception").

    python scripts/exit_check.py --runs 100                  # DMuonFSDP
    python scripts/exit_check.py --runs 100 --optimizer adamw
    python scripts/exit_check.py --runs 30 --recipe --optimizer torch-muon   # recipes/pretrain.py

With --recipe each job is the pretraining recipe (tiny preset, a checkpoint half-way and at the
end) in a fresh run directory, instead of the small training loop below.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def worker(optimizer: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dmuon_fsdp import DMuonFSDP, param_groups

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(96, 32), *[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                                  for _ in range(2)], nn.Linear(32, 96))  # fmt: skip
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model[1:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = DMuonFSDP(param_groups(model), lr=0.02)
    for step in range(steps):
        ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="number of torchrun jobs")
    parser.add_argument("--optimizer", choices=("dmuon", "adamw", "torch-muon"), default="dmuon")
    parser.add_argument("--recipe", action="store_true", help="run recipes/pretrain.py as the job")
    parser.add_argument("--steps", type=int, default=5, help="training steps per job")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be positive")
    if args.optimizer == "torch-muon" and not args.recipe:
        parser.error("--optimizer torch-muon needs --recipe")
    if args.worker:
        worker(args.optimizer, args.steps)
        return
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failed = []
    with tempfile.TemporaryDirectory() as logs:
        for run in range(args.runs):
            if args.recipe:
                command = [*torchrun, os.path.join(root, "recipes", "pretrain.py"), "--preset", "tiny",
                           "--optimizer", args.optimizer, "--steps", str(args.steps), "--batch-size", "8",
                           "--save-every", str(max(1, args.steps // 2)), "--val-every", str(args.steps),
                           "--run-dir", os.path.join(logs, f"run{run}"), "--no-progress",
                           "--cache-dir", os.path.join(root, "runs", "cache")]  # fmt: skip
            else:
                command = [*torchrun, os.path.abspath(__file__), "--worker", "--optimizer", args.optimizer,
                           "--steps", str(args.steps)]  # fmt: skip
            log = os.path.join(logs, f"run{run}.log")
            with open(log, "w") as out:
                code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
            if code != 0:
                failed.append(run)
                lines = [line for line in open(log) if "terminate" in line or "Signal" in line or "Error" in line]
                print(f"run {run}: exit status {code}: {''.join(lines[:4]).strip()}", flush=True)
    job = "recipe" if args.recipe else "loop"
    print(f"{job}, {args.optimizer}: {len(failed)} of {args.runs} jobs exited non-zero")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
