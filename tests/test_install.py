"""Installed as the README says (torch, then the package and what it declares), DMuonFSDP's
checkpoints save and load with torch.distributed.checkpoint: DCP writes tensors through numpy,
which torch itself does not install."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys, tempfile
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from dmuon_fsdp import DMuonFSDP

dist.init_process_group("gloo", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
opt = DMuonFSDP(model.parameters(), lr=0.02)
model(torch.randn(2, 8)).sum().backward()
opt.step()
saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
with tempfile.TemporaryDirectory() as directory:
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    opt.state[next(iter(opt.state))]["momentum_buffer"].zero_()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
loaded = opt.state_dict()["state"][0]
assert all(torch.equal(loaded[k].full_tensor(), v.full_tensor()) for k, v in saved.items() if k != "step")
dist.destroy_process_group()
print("saved and loaded")
"""


def test_a_dcp_checkpoint_saves_and_loads_in_the_environment_the_readme_installs(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    # The README: torch first (here the build this suite runs on), then the package.
    subprocess.run([*pip, f"torch=={torch.__version__.split('+')[0]}"], check=True)
    subprocess.run([*pip, str(ROOT)], check=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": ""}
    done = subprocess.run(
        [python, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved and loaded" in done.stdout
