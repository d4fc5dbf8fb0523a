"""What CPU + gloo would hide from the suite, emulated on CPU (``tests.support.cuda``): a copy
that converts 16-bit elements through float (CUDA's foreach copy) must not change NorMuon's
numbers, which travel as float32 bits on a 16-bit wire."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dmuon_fsdp import DMuonFSDP
from tests import gpu_check
from tests.support.cuda import CudaForeachCopy, bits
from tests.support.layout_runs import SHAPES, Weights
from tests.support.paired_runs import snapshot
from tests.support.spawn import cpu_mesh, run_ranks
from tests.support.training import train

STEPS = 6
WIRES = (torch.bfloat16, torch.float16)


def normuon_copies(rank, world_size, layout):
    """Per wire dtype: the names of the parameters and state tensors whose bits differ between a
    run with CPU's copies and one with CUDA's, how many row-state numbers differ, of how many."""
    mesh = (
        cpu_mesh()
        if layout == "fsdp"
        else init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    )
    out = {}
    for wire in WIRES:
        runs = []
        for emulated in (False, True):
            model = Weights(SHAPES)
            fully_shard(model, mesh=mesh)
            opt = DMuonFSDP(
                model.named_parameters(),
                lr=0.05,
                variant="normuon",
                ns_dtype=torch.float32,
                comm_dtype=wire,
                bucket_bytes=256,
            )
            if emulated:
                with CudaForeachCopy():
                    train([(model, opt)], STEPS, loss=model)
            else:
                train([(model, opt)], STEPS, loss=model)
            runs.append(snapshot(model, opt))
        plain, cuda = runs
        differing = [n for n in plain if not torch.equal(bits(plain[n]), bits(cuda[n]))]
        moments = [n for n in plain if n.endswith("neuron_second_moment")]
        changed = sum(int((bits(plain[n]) != bits(cuda[n])).sum()) for n in moments)
        out[str(wire)] = differing, changed, sum(plain[n].numel() for n in moments)
    return out


@pytest.mark.parametrize("layout,world_size", [("fsdp", 4), ("hsdp", 4)])
def test_normuon_numbers_travel_as_bits_under_cuda_copies(layout, world_size):
    for result in run_ranks(normuon_copies, world_size, layout):
        for wire, (differing, changed, compared) in result.items():
            assert compared > 0
            message = f"{wire} wire: {changed} of {compared} row-state numbers differ"
            assert differing == [], f"{message}: {differing}"


def cpu_parameters_on_nccl(rank, world_size):
    """Plain CPU tensors (as DDP replicates them) in a job whose default group had NCCL alone
    (emulated: its backend config says so) are refused when the optimizer is built."""
    nccl_only = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cuda:nccl"
    try:
        DMuonFSDP([("encoder.weight", torch.nn.Parameter(torch.ones(4, 3)))])
    except ValueError as e:
        return str(e)
    finally:
        dist.get_backend_config = nccl_only
    return None


def test_cpu_parameters_with_an_nccl_only_group_are_refused_naming_the_parameter():
    errors = run_ranks(cpu_parameters_on_nccl, 2)
    assert errors[0] == errors[1] and errors[0] is not None
    assert errors[0].startswith("encoder.weight is on cpu") and "cuda:nccl" in errors[0]


def gpu_check_job(rank, world_size):
    """The GPU check's job (``tests.gpu_check``), on CPU ranks over gloo."""
    return [gpu_check.check_case(case, torch.device("cpu")) for case in gpu_check.CASES]


def test_the_gpu_checks_job_on_cpu_equals_float64_and_its_serialized_run():
    # Four ranks, FSDP and HSDP, overlap on and off, bf16 and fp32 wire, Muon and NorMuon, steps
    # begun in backward: against the float64 reference, and bitwise against the same run with
    # every collective completed before the next op (a buffer touched in flight would differ).
    for result in run_ranks(gpu_check_job, gpu_check.WORLD):
        for c in result:
            assert c["error"] <= c["bound"] and c["differing"] == 0, c
            assert c["buckets"] >= 6, c
            assert c["started_in_backward"] > 0 or "in backward" not in c["case"], c
