"""Benchmarks and measurements of dmuon_fsdp; each module runs from the repository root as
``python -m benchmarks.<name>`` (its docstring says what it measures and how)."""
