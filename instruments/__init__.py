"""Instruments shared by the tests and the benchmarks, neither the package nor its tests:
counters of what a step dispatches on torch's public surfaces (``counters``) and yardsticks for
plans (``plans``)."""
