"""The step runtime (private): what DMuonFSDP plans, binds and runs; see docs/design.md."""
