"""dmuon_fsdp: distributed Muon for FSDP2 and DTensor.

fully_shard(model)
opt = DMuonFSDP(model.parameters(), lr=0.02)      # or DMuonFSDP(param_groups(model))
"""

from dmuon_fsdp._step.errors import GradientMismatchError, NonFiniteGradientError
from dmuon_fsdp._step.planner import Plan
from dmuon_fsdp._step.run import StepStats
from dmuon_fsdp.backward import clip_grad_norm_
from dmuon_fsdp.newton_schulz import MUON_COEFFICIENTS, POLAR_EXPRESS, newton_schulz
from dmuon_fsdp.optimizer import DMuonFSDP
from dmuon_fsdp.qk_clip import AttentionWeights, QKClip
from dmuon_fsdp.routing import Route, Routing, param_groups

__all__ = [
    "AttentionWeights",
    "DMuonFSDP",
    "GradientMismatchError",
    "MUON_COEFFICIENTS",
    "NonFiniteGradientError",
    "POLAR_EXPRESS",
    "Plan",
    "QKClip",
    "Route",
    "Routing",
    "StepStats",
    "clip_grad_norm_",
    "newton_schulz",
    "param_groups",
]
__version__ = "0.1.0"

# What users catch and read (tracebacks, reprs, isinstance checks) is named by the package, not
# by the private module it is written in (and pickles by that name).
for _public in (GradientMismatchError, NonFiniteGradientError, Plan, Route, Routing, StepStats):
    _public.__module__ = __name__
