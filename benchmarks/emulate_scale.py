"""DMuonFSDP's step at the scale it is for, on two CPU cores: W ranks that emulate GPUs.

Two cores cannot run W ranks of Newton-Schulz at once and loopback hides the network, so each of
the W spawned ranks (gloo, one thread) runs DMuonFSDP on Llama-3-8B-shaped layers shrunk by
``--scale`` S in every dimension (dim 4096/S, kv 1024/S, MLP 14336/S; real data, real exchanges,
exact results) while:

- each rank has an emulated device that runs, like a GPU stream and asynchronously to the host,
  every matmul inside ``step()`` (mm, bmm, addmm, baddbmm, ``.out`` forms included) for its flops
  counted as if every dimension were S times larger (x S^3) at ``--tflops``; elementwise work
  and host work run for real (on a GPU both are small beside these matrices' Newton-Schulz);
- every all-to-all crosses one link shared by all exchanges: it starts once every rank's device
  has reached it (its data is ready) and the exchange launched before it has ended, and lasts
  its busiest rank's time: the larger of bytes sent and received (x S^2, own segment aside) at
  ``--link-gbs``, or, with nodes (``--gpus-per-node``, or ``--replicas`` R: HSDP with a replica
  a node), the slower of its two tiers (to ranks of its node at ``--node-gbs``, to others at
  ``--link-gbs``), plus ``--latency-us`` per peer; the device's later work waits for it (a table
  in shared memory; ``CLOCK_MONOTONIC`` is shared by the processes);
- a step ends when its rank's device is through (the host sleeps until then).

The device and the link run ``--dilation`` times slower than stated and the times measured are
divided by it: W ranks share two cores, and their real host work (Python, dispatch, the small
real matrices), which on GPUs would run on W hosts beside the device, must stay small beside
the emulated times (at 400 TFLOP/s undilated, host work alone took 133 ms of a 8-bucket step at
W=8 whose NS floor is 104 ms).

``--model pi0``: pi0's Muon matrices instead (``benchmarks.paper.shapes.pi0_units``: SigLIP,
projector, time MLP, joint Gemma + action-expert layers), each dimension / S rounded to the
nearest integer (4304, SigLIP's MLP width, is divisible by 16 at most; the flops counted are
the rounded matrices', so the step and its NS floor stay comparable); ``--layers`` L is then
the joint layers, with round(1.5 L) SigLIP blocks beside them (27 : 18, as in pi0), default
18 (the whole model); one ``Layer`` module per unit (a SigLIP block, the projector, the time
MLP, a joint layer), as FSDP2 would wrap them.

``bucket_bytes`` is scaled alike (/ S^2), so buckets hold what they would at full size, and the
planner's cost model is the emulated hardware's (``ns_flops_per_byte``, ``--tflops`` over
``--link-gbs``, and its host work per bucket, both scaled to the shrunk matrices). Reported per
world size, medians over ``--steps`` timed steps after warm-up, contenders in turns:

- the default step (128 MiB buckets, the planner's ramp), the same cut by ``bucket_bytes``
  alone (``ns_flops_per_byte=0``, "plain cut") and the step with every matrix in one bucket,
  over the NS floor (total NS flops / W / rate, each matrix in the form it runs), over the
  one-owner bound (``instruments.plans.one_owner_bound``: the busiest rank's NS, and each
  matrix's way to its owner, NS and way back, which no cut or launch order shortens; this
  checkout's contenders only) and against each other;
- with ``--fast-link F``, the default and one-bucket steps again on a link F times faster: the
  link's time left exposed is the default step minus the same on the fast link, its busy time
  the sum of every exchange's time on the link (per step); the default over one bucket on the
  fast link is what the buckets cost in host work;
- ``StepStats.buffer_bytes`` of rank 0 for the model and one ``--deeper`` times deeper;
- with ``--before REV``, the default and one-bucket steps of the package as it was at git
  revision REV (its ``dmuon_fsdp`` exported to a temporary folder and imported from there);
- with ``--replicas`` R > 1 (HSDP R x W / R, the weights replicated over the mesh's first dim),
  also the steps with ``overlap_forward`` (default buckets and one bucket), and after each step
  the next forward of the layers (modules that only read their weights) timed apart: what the
  relays left to it cost when no compute hides them. The one-owner bound is over both tiers.

    python -m benchmarks.emulate_scale --before 552dc0a      # W = 8 and 16, ~10 minutes on 2 cores
    python -m benchmarks.emulate_scale --world-sizes 8 --layers 8 --scale 64 --tflops 50 \
        --link-gbs 5 --dilation 1 --fast-link 1e6             # the issue-42 setting, host work in
    python -m benchmarks.emulate_scale --world-sizes 16 --layers 2    # fewer matrices than ranks
    python -m benchmarks.emulate_scale --world-sizes 8 --replicas 4 --layers 8 --latency-us 5 \
        --before ec845b2                                      # HSDP 4 x 2, a replica a node
    python -m benchmarks.emulate_scale --model pi0 --scale 64 --world-sizes 8 16   # pi0, whole
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.stop import let_threads_run

if TYPE_CHECKING:  # (the package is imported in each rank, from the folder its contender names)
    from torch.distributed.device_mesh import DeviceMesh

LLAMA3_8B = (4096, 1024, 14336)  # dim, kv dim, MLP width
EMULATED_MODELS = ("llama3-8b", "pi0")
DEFAULT_BUCKET = 128 * 2**20
ONE_BUCKET = 2**62
MAX_EXCHANGES = 4096
_aten = torch.ops.aten
MATMULS = {
    _aten.mm.default,
    _aten.mm.out,
    _aten.bmm.default,
    _aten.bmm.out,
    _aten.addmm.default,
    _aten.addmm.out,
    _aten.baddbmm.default,
    _aten.baddbmm.out,
}


def layer_shapes(scale: int) -> list[tuple[int, int]]:
    """q, k, v, o, gate, up, down of one Llama-3-8B layer, each dimension / ``scale``."""
    dim, kv, ffn = (n // scale for n in LLAMA3_8B)
    return [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]


def model_units(args: argparse.Namespace) -> list[list[tuple[int, int]]]:
    """The emulated model's matrices, shrunk by ``--scale``, one list per ``Layer`` module:
    ``--layers`` Llama-3-8B layers, or pi0's units (module docstring)."""
    if args.model != "pi0":
        return [layer_shapes(args.scale)] * args.layers
    # (imported here, in the main process only: a rank imports --before's package first)
    from benchmarks.paper.shapes import pi0_units

    def shrink(n: int) -> int:
        return max(1, round(n / args.scale))

    units = pi0_units(vision_layers=pi0_vision_layers(args.layers), joint_layers=args.layers)
    return [[(shrink(r), shrink(c)) for _, shapes in unit for r, c in shapes] for unit in units]


def pi0_vision_layers(joint_layers: int) -> int:
    """SigLIP blocks beside ``joint_layers`` joint layers: 27 : 18, as in pi0."""
    return round(joint_layers * 27 / 18)


def matmul_flops(func: OpOverload, args: tuple[Any, ...]) -> int:
    """2 x multiply-adds of one matmul call (the batch included)."""
    if func in (_aten.mm.default, _aten.mm.out) or func in (_aten.bmm.default, _aten.bmm.out):
        a, b = args[0], args[1]
    else:  # addmm / baddbmm: (input, a, b)
        a, b = args[1], args[2]
    batch = a.shape[0] if a.ndim == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class EmulatedDevice(TorchDispatchMode):
    """A device that runs each matmul for its flops x ``scale``^3 at ``rate`` flop/s, in launch
    order, asynchronously like a GPU stream: ``busy_until`` is when it is through what was
    launched (never before the host launched it); elementwise work is not charged."""

    def __init__(self, rate: float, scale: int) -> None:
        super().__init__()
        self.rate, self.cube = rate, scale**3
        self.busy_until = 0.0
        self.flops = 0

    def __torch_dispatch__(
        self, func: OpOverload, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            flops = matmul_flops(func, args) * self.cube
            self.flops += flops
            self.busy_until = max(self.busy_until, time.monotonic()) + flops / self.rate
        return out

    def synchronize(self) -> None:
        left = self.busy_until - time.monotonic()
        if left > 0:
            time.sleep(left)


class PacedLink:
    """``dist.all_to_all_single`` paced on the network (see the module docstring), in stream order
    with ``device``: an exchange starts once every rank's device reached it and the one before it
    ended, and lasts its busiest rank's time: the slower of its two links (bytes to ranks of its
    node over ``near`` bytes/s, to other nodes over ``far``, the larger of sent and received,
    x S^2) and ``latency`` seconds per peer; the device's later work waits for it. ``table``
    (shared by the ranks) holds, per exchange in launch order, each rank's time on the link and
    ready time. ``node_of[r]``: the node of global rank r."""

    def __init__(
        self,
        table: torch.Tensor,
        rank: int,
        scale: int,
        near: float,
        far: float,
        latency: float,
        node_of: list[int],
        device: EmulatedDevice,
    ) -> None:
        self.table, self.rank, self.device = table, rank, device
        self.square, self.near, self.far, self.latency, self.node_of = scale**2, near, far, latency, node_of
        self.launched = 0
        self.ends: list[float] = []
        self.real = dist.all_to_all_single

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
        group: dist.ProcessGroup | None = None,
        async_op: bool = False,
    ) -> _PacedWork:
        if output_split_sizes is None or input_split_sizes is None:
            raise ValueError("PacedLink paces exchanges with split sizes (as DMuonFSDP's)")
        n = self.launched
        self.launched += 1
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        me, size = self.rank, input.element_size() * self.square
        tiers = {True: [0, 0], False: [0, 0]}  # near / far: [sent, received]
        peers = 0
        for peer, sent, received in zip(ranks, input_split_sizes, output_split_sizes, strict=True):
            if peer != me and (sent or received):
                near = self.node_of[peer] == self.node_of[me]
                tiers[near][0] += sent
                tiers[near][1] += received
                peers += 1
        seconds = max(max(tiers[True]) * size / self.near, max(tiers[False]) * size / self.far)
        self.table[n, self.rank, 0] = seconds + peers * self.latency
        self.table[n, self.rank, 1] = max(time.monotonic(), self.device.busy_until)
        work = self.real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        assert work is not None, "the step launches its all-to-alls with async_op=True"
        return _PacedWork(work, self, n)

    def duration(self, n: int) -> float:
        """How long exchange ``n`` holds the link (every rank has launched it)."""
        return float(self.table[n, :, 0].max())

    def end(self, n: int) -> float:
        """When exchange ``n`` leaves the link (every exchange before it is complete in the table)."""
        while len(self.ends) <= n:
            k = len(self.ends)
            ready = max(self.ends[-1] if self.ends else 0.0, float(self.table[k, :, 1].max()))
            self.ends.append(ready + self.duration(k))
        return self.ends[n]


class _PacedWork:
    def __init__(self, work: dist.Work, link: PacedLink, n: int) -> None:
        self.work, self.link, self.n = work, link, n

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self.work.wait(*args, **kwargs)  # every rank launched it: the table row is complete
        device = self.link.device
        device.busy_until = max(device.busy_until, self.link.end(self.n))  # a stream wait
        return result


def make_params(units: list[list[tuple[int, int]]], mesh: DeviceMesh) -> list[torch.nn.Parameter]:
    """The units' weights, in order, sharded by rows over the mesh's last dim (FSDP2; HSDP on a
    2-D mesh, replicated over its first)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    shapes = [shape for unit in units for shape in unit]
    placements = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    return [
        torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=gen) * 0.02, mesh, placements))
        for s in shapes
    ]


class Layer(torch.nn.Module):
    """A layer's weights, and a forward that only reads them: the next forward of the model, whose
    modules' pre-hooks finish what ``overlap_forward`` left in flight."""

    def __init__(self, weights: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """Random gradients, equal on the ranks that hold the same rows (replicas: HSDP averages them)."""
    from torch.distributed.tensor import DTensor

    gen = None
    for p in params:
        assert isinstance(p, DTensor)  # (make_params distributes every parameter)
        if gen is None:
            coordinate = p.device_mesh.get_coordinate()
            gen = torch.Generator().manual_seed(1000 + step + (coordinate[-1] if coordinate else 0))
        local = torch.randn(p.to_local().shape, generator=gen)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


@dataclass(frozen=True)
class Contender:
    """One run's settings: the package (None: this checkout), ``bucket_bytes`` at full size, the
    ramp (False: ``ns_flops_per_byte=0``; one bucket is every matrix in one), the links' speed-up
    and ``overlap_forward`` (its relays finished between steps, untimed, as a forward would)."""

    name: str
    package: str | None
    bucket: int
    ramp: bool = True
    link_factor: float = 1.0
    later: bool = False


def network_of(args: argparse.Namespace, world: int) -> tuple[int, float, float]:
    """(GPUs a node, bytes/s within a node, bytes/s between nodes) emulated: one node at
    ``--link-gbs`` unless ``--gpus-per-node`` (default: a replica's ranks with ``--replicas``)."""
    per_node = args.gpus_per_node or (world // args.replicas if args.replicas > 1 else world)
    near = (args.node_gbs if per_node < world else args.link_gbs) * 1e9
    return per_node, near, args.link_gbs * 1e9


def rank_main(
    rank: int,
    world: int,
    port: int,
    contender: Contender,
    args: argparse.Namespace,
    units: list[list[tuple[int, int]]],
    table: torch.Tensor,
    out: str,
) -> None:
    package, bucket = contender.package, contender.bucket
    if package is not None:
        sys.path.insert(0, package)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    import dmuon_fsdp
    from dmuon_fsdp import DMuonFSDP

    shape = (args.replicas, world // args.replicas) if args.replicas > 1 else (world,)
    mesh = init_device_mesh("cpu", shape)
    device = EmulatedDevice(args.tflops * 1e12 / args.dilation, args.scale)
    per_node, near, far = network_of(args, world)
    speed = contender.link_factor / args.dilation
    nodes = [r // per_node for r in range(world)]
    link = PacedLink(
        table, rank, args.scale, near * speed, far * speed, args.latency_us * 1e-6 / speed, nodes, device
    )
    # the package calls it through the module (Any: torch's own signature differs by release)
    cast(Any, dist).all_to_all_single = link.all_to_all_single
    result: dict = {"package": str(Path(dmuon_fsdp.__file__).parent)}
    scaled = max(1, bucket // args.scale**2)
    options: dict[str, Any] = dict(
        lr=0.02, ns_dtype=torch.bfloat16, comm_dtype=torch.bfloat16, bucket_bytes=scaled
    )
    if contender.later:
        options["overlap_forward"] = True
    if "ns_flops_per_byte" in inspect.signature(DMuonFSDP).parameters:  # (not in older packages)
        # The planner sees the real (shrunk) matrices: flops S^3 and bytes S^2 times fewer than the
        # emulated ones, so its link-to-flops ratio is the hardware's / S, and its host work per
        # bucket (emulated-device flops) S^3 times fewer real flops.
        rate = args.tflops * 1e12 / (args.link_gbs * 1e9) / args.scale
        options["ns_flops_per_byte"] = rate if contender.ramp else 0.0
        from dmuon_fsdp._step import pipeline

        pipeline.BUCKET_HOST_FLOPS /= args.scale**3
    params = make_params(units, mesh)
    bounds = list(itertools.accumulate((len(unit) for unit in units), initial=0))
    model = torch.nn.Sequential(*(Layer(params[a:b]) for a, b in itertools.pairwise(bounds)))
    opt = DMuonFSDP(params, **options)
    result.update(timed_steps(opt, model, params, device, link, args, world))
    plan, stats = opt.plan, opt.last_step_stats
    assert plan is not None and stats is not None  # (opt has stepped)
    if package is None:  # this checkout's plan (instruments import its package)
        from instruments.plans import one_owner_bound
        from instruments.traffic import Network

        # at full size: flops S^3 and bytes S^2 times the shrunk matrices'; every gradient is ready
        flops_s = args.scale**3 / (args.tflops * 1e12)
        network = Network(per_node, near / 1e9, far / 1e9, 0.0, 2 * args.scale**2)
        result["bound_s"] = one_owner_bound(plan, range(len(plan.matrices)), flops_s, network)
    result.update(
        buckets=len(plan.buckets), relays=len(getattr(plan, "relays", ())), buffer_bytes=stats.buffer_bytes
    )
    if contender.name.endswith("default") and contender.link_factor == 1:  # memory of a deeper model
        deeper = make_params(units * args.deeper, mesh)
        deep_opt = DMuonFSDP(deeper, **options)
        set_grads(deeper, 0)
        deep_opt.step()
        deep_stats = deep_opt.last_step_stats
        assert deep_stats is not None  # (deep_opt has stepped)
        result["deeper_buffer_bytes"] = deep_stats.buffer_bytes
    dist.all_to_all_single = link.real
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    let_threads_run()  # gloo's threads drop the tensors of plain collectives first
    dist.destroy_process_group()


def timed_steps(
    opt: Any,
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    device: EmulatedDevice,
    link: PacedLink,
    args: argparse.Namespace,
    world: int,
) -> dict:
    """Warm-up, then timed steps: their times (the slowest rank's, each from a barrier to its
    device being through), the link's busy time per step, the NS floor; and the next forward of
    ``model`` after each, timed apart (its pre-hooks finish what ``overlap_forward`` left in
    flight: for the others, nothing)."""
    starts: list[float] = []
    ends: list[float] = []
    finished: list[float] = []
    exchanges: list[range] = []
    model(torch.zeros(1))  # (the forward before the first step, in which modules are found)
    for step in range(args.warmup + args.steps):
        set_grads(params, step)
        dist.barrier()
        device.busy_until, device.flops = 0.0, 0
        first = link.launched
        start = time.monotonic()
        with device:
            opt.step()
        device.synchronize()  # the step is done when the device is
        starts.append(start)
        ends.append(time.monotonic())
        with device:
            model(torch.zeros(1))
        device.synchronize()
        finished.append(time.monotonic())
        exchanges.append(range(first, link.launched))
    times = torch.tensor([starts, ends, finished], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    total_flops = torch.tensor([float(device.flops)], dtype=torch.float64)
    dist.all_reduce(total_flops)  # one step's NS flops of every rank: the job's
    steps = ((times[1] - times[0])[args.warmup :] / args.dilation).tolist()
    later = ((times[2] - times[1])[args.warmup :] / args.dilation).tolist()
    busy = [sum(link.duration(n) for n in ran) / args.dilation for ran in exchanges[args.warmup :]]
    return {
        "step_s": statistics.median(steps),
        "steps_s": steps,
        "finished_later_s": statistics.median(later),
        "link_busy_s": statistics.median(busy),
        "floor_s": float(total_flops) / world / (args.tflops * 1e12),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    world: int, contender: Contender, args: argparse.Namespace, units: list[list[tuple[int, int]]]
) -> dict:
    table = torch.zeros(MAX_EXCHANGES, world, 2, dtype=torch.float64).share_memory_()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(rank_main, args=(world, free_port(), contender, args, units, table, out.name), nprocs=world)
        return json.loads(Path(out.name).read_text())


def export(rev: str) -> str:
    """The package as it was at git revision ``rev``, in a temporary folder."""
    folder = tempfile.mkdtemp(prefix="dmuon_before_")
    archive = subprocess.run(["git", "archive", rev, "dmuon_fsdp"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument(
        "--model",
        default="llama3-8b",
        choices=EMULATED_MODELS,
        help="the matrices: Llama-3-8B layers, or pi0's (SigLIP, projector, time MLP, joint layers)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="llama3-8b: layers (default 16); pi0: joint layers, with 1.5x as many SigLIP blocks "
        "(default 18, the whole model)",
    )
    parser.add_argument("--deeper", type=int, default=4)
    parser.add_argument("--scale", type=int, default=128, help="S: every dimension / S")
    parser.add_argument("--tflops", type=float, default=400.0, help="emulated bf16 matmul rate")
    parser.add_argument(
        "--link-gbs", type=float, default=50.0, help="GB/s of the one shared link (between nodes, with nodes)"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="R: HSDP, each world size as R replicas x W / R shards"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="ranks a node (consecutive), within which exchanges move at --node-gbs (default: one replica's "
        "ranks with --replicas, else every rank in one node at --link-gbs)",
    )
    parser.add_argument("--node-gbs", type=float, default=450.0, help="GB/s within a node (with nodes)")
    parser.add_argument("--latency-us", type=float, default=0.0, help="latency per peer of an exchange")
    parser.add_argument(
        "--dilation",
        type=float,
        default=10.0,
        help="run the device and the link this many times slower and divide the times measured by it, "
        "so that real host work (W ranks sharing two cores) stays small beside them",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="turns of every contender")
    parser.add_argument("--before", help="git revision of the package to compare with")
    parser.add_argument(
        "--fast-link", type=float, default=0.0, help="F: also run on a link F times faster (e.g. 1e6)"
    )
    parser.add_argument("--out", default="runs/bench/emulate_scale.json")
    args = parser.parse_args()
    if args.layers is None:
        args.layers = 18 if args.model == "pi0" else 16
    if args.model == "llama3-8b" and any(n % args.scale for n in LLAMA3_8B):
        parser.error(f"--scale {args.scale} does not divide the Llama-3-8B dimensions {LLAMA3_8B}")
    units = model_units(args)
    contenders = contenders_of(args)
    results: dict = {}
    for world in args.world_sizes:
        runs: dict = {c: [] for c in contenders}
        for _ in range(args.rounds):
            for c in contenders:
                runs[c].append(run(world, c, args, units))
        for c, rs in runs.items():
            results[f"W={world} {c.name}"] = {
                **rs[0],
                "step_s": statistics.median(r["step_s"] for r in rs),
                "rounds_s": [r["step_s"] for r in rs],
            }
    print_table(results, args)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\nJSON: {path}")


def contenders_of(args: argparse.Namespace) -> list[Contender]:
    """This checkout's default step, plain cut and one bucket (and both on the fast link), and the
    default and one-bucket steps of ``--before``; with replicas, the default step with
    ``overlap_forward`` of both and this checkout's one bucket with it."""
    out: list[Contender] = []
    before = export(args.before) if args.before else None
    if before is not None:
        out += [
            Contender("before default", before, DEFAULT_BUCKET),
            Contender("before one", before, ONE_BUCKET, ramp=False),
        ]
    out += [
        Contender("default", None, DEFAULT_BUCKET),
        Contender("plain cut", None, DEFAULT_BUCKET, ramp=False),
        Contender("one", None, ONE_BUCKET, ramp=False),
    ]
    if args.fast_link:
        out += [
            Contender("default fast", None, DEFAULT_BUCKET, link_factor=args.fast_link),
            Contender("one fast", None, ONE_BUCKET, ramp=False, link_factor=args.fast_link),
        ]
    if args.replicas > 1:
        if before is not None:
            out.append(Contender("before forward", before, DEFAULT_BUCKET, later=True))
        out.append(Contender("forward", None, DEFAULT_BUCKET, later=True))
        out.append(Contender("forward one", None, ONE_BUCKET, ramp=False, later=True))
    return out


def print_table(results: dict, args: argparse.Namespace) -> None:
    nodes = (
        f"{args.gpus_per_node or 'a replica of'} ranks a node at {args.node_gbs:g} GB/s, "
        f"{args.link_gbs:g} GB/s between nodes, {args.latency_us:g} us a peer"
        if args.replicas > 1 or args.gpus_per_node
        else f"{args.link_gbs:g} GB/s shared link"
    )
    mesh = f"HSDP {args.replicas} x W / {args.replicas}, " if args.replicas > 1 else ""
    model = (
        f"pi0-shaped matrices / {args.scale}, rounded ({pi0_vision_layers(args.layers)} SigLIP blocks, "
        f"projector, time MLP, {args.layers} joint layers)"
        if args.model == "pi0"
        else f"Llama-3-8B-shaped layers / {args.scale} ({args.layers} layers)"
    )
    print(
        f"## Emulated GPUs: {model}, {mesh}"
        "bf16 NS and wire, "
        f"{args.tflops:g} TFLOP/s, {nodes}; medians of {args.steps} steps x "
        f"{args.rounds} rounds (device and link run {args.dilation:g}x slower, times divided back)\n"
    )
    fast = (
        ["exposed link ms", "link busy ms", "exposed / busy", "fast link: default / one"]
        if args.fast_link
        else []
    )
    columns = [
        "W",
        "package",
        "buckets (default)",
        "default step ms",
        "plain cut ms",
        "one bucket ms",
        "NS floor ms",
        "default / floor",
        "one-owner bound ms",
        "default / bound",
        "default / one bucket",
        *(["overlap_forward step ms (its relays, after) ms", "its buffer KiB"] if args.replicas > 1 else []),
        *fast,
        "buffer KiB (rank 0, real size)",
        f"{args.deeper}x deeper KiB",
        "deeper / model",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|---:|---|" + "---:|" * (len(columns) - 2))
    for world in args.world_sizes:
        for prefix in ("before ", "") if args.before else ("",):
            d, one = results[f"W={world} {prefix}default"], results[f"W={world} {prefix}one"]
            plain = results.get(f"W={world} {prefix}plain cut")
            cells = [
                world,
                "before" if prefix else "after",
                d["buckets"],
                f"{d['step_s'] * 1e3:.1f}",
                f"{plain['step_s'] * 1e3:.1f}" if plain else "-",
                f"{one['step_s'] * 1e3:.1f}",
                f"{d['floor_s'] * 1e3:.1f}",
                f"{d['step_s'] / d['floor_s']:.2f}x",
                f"{d['bound_s'] * 1e3:.1f}" if "bound_s" in d else "-",
                f"{d['step_s'] / d['bound_s']:.2f}x" if "bound_s" in d else "-",
                f"{d['step_s'] / one['step_s']:.2f}x",
            ]
            if args.replicas > 1:
                later = results.get(f"W={world} {prefix}forward")
                cells.append(
                    f"{later['step_s'] * 1e3:.1f} ({later['finished_later_s'] * 1e3:.1f})" if later else "-"
                )
                cells.append(f"{later['buffer_bytes'] / 2**10:.0f}" if later else "-")
            if args.fast_link:
                df, of = (
                    results.get(f"W={world} {prefix}default fast"),
                    results.get(f"W={world} {prefix}one fast"),
                )
                if df and of:
                    exposed = d["step_s"] - df["step_s"]
                    cells += [
                        f"{exposed * 1e3:.1f}",
                        f"{d['link_busy_s'] * 1e3:.1f}",
                        f"{exposed / d['link_busy_s']:.2f}",
                        f"{df['step_s'] / of['step_s']:.2f}x",
                    ]
                else:
                    cells += ["-"] * 4
            if "deeper_buffer_bytes" in d:
                kib, deep = d["buffer_bytes"] / 2**10, d["deeper_buffer_bytes"] / 2**10
                cells += [f"{kib:.0f}", f"{deep:.0f}", f"{deep / kib:.2f}x"]
            else:
                cells += ["-"] * 3
            print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
