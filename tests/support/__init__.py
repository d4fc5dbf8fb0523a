"""What the test modules share, imported as ``tests.support.<module>``:

- spawn: ``run_ranks``, a function on W CPU ranks (gloo) forked from a preloaded forkserver; ``cpu_mesh``.
- training: ``train``, the one training loop (plain steps or a test's own, runs side by side);
  ``Reference``, the float64 Muon that follows a run on its full gradients and counts its steps.
- reference: the float64 reference Muon and Newton-Schulz written from the formulas; ``relative_error``.
- models: the shapes model (gradients chosen exactly), its param groups and reference run;
  matrix shapes of real models for the planner tests.
- layout_runs: the layout tests' weights, options and ``against_reference`` runs, and ``check``.
- paired_runs: plain and ``overlap_backward=True`` copies of one model, and how to compare them.
- moe: a Mixture-of-Experts block laid out as torchtitan lays it out, on CPU meshes.
- checkpoints: a model and its optimizer saved and loaded through torch.distributed.checkpoint.
"""
