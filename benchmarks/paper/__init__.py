"""DMuonFSDP at scale, on paper: the planner alone, no processes and no GPUs, one command:

    python -m benchmarks.paper [--report step|balance|hsdp|e2e|moe|embodied] [options]

Each report prints a markdown table and writes its figures as JSON (``--out``, default
``runs/bench/paper_<report>.json``; ``step`` also plots a PNG beside it). These are predictions of
a cost model, not measurements. The modules:

- ``shapes``: the models (real models' hidden-matrix shapes, dense, MoE and vision-language-action)
  and how their matrices lie on the ranks (FSDP2 rows; experts over ep x efsdp);
- ``costs``: GPU figures and the cost of each part of an optimizer step per rank (NS flops at a
  fraction of peak, bytes over one link, element-wise state traffic through HBM);
- ``step``: ``--report step`` (predicted optimizer step of DMuonFSDP, gather-all Muon and AdamW
  against W), ``balance`` (the busiest rank's NS against the lower bound) and ``hsdp`` (bytes and
  NS of four ways to run Muon on R x S HSDP);
- ``e2e``: ``--report e2e``, a whole training step with backward, AdamW against DMuonFSDP with and
  without ``overlap_backward``, bucket by bucket;
- ``moe``: ``--report moe``, MoE models with expert parallelism;
- ``embodied``: ``--report embodied``, the e2e step for two VLAs (pi0, WALL-OSS) on 16 nodes of 8
  GPUs (DDP, FSDP2, HSDP), beside the DMuon report's measured steps;
- ``__main__``: the command.

Each module's docstring states what it models and what it assumes.

    python -m benchmarks.paper --gpu h200
    python -m benchmarks.paper --report balance --world-sizes 8 16 64
    python -m benchmarks.paper --report hsdp --meshes 2x4 4x8 8x8 --models gpt2-124m llama3-8b
    python -m benchmarks.paper --report e2e --tokens-per-rank 8192 --mfu 0.4 --models llama3-70b
    python -m benchmarks.paper --report moe --ep 8
    python -m benchmarks.paper --report embodied --samples-per-rank 48
"""
