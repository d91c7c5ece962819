"""Lightning callbacks: the stability toolkit (one focused callback per file).

- InstabilityDetector (instability.py): detects loss spikes, gradient explosions, non-finite values, Amax
  growth, Sinkhorn residuals and fp16 overflows every step; logs and acts (log / skip / rollback / stop).
- GradientSnapshots (snapshots.py; snapshot_state.py, snapshot_files.py): snapshot ring with validated rollback.
- SinkhornScheduler (sinkhorn_schedule.py): adaptive Sinkhorn iteration count ("constraint intensity").
- RankConsistencyCheck (rank_consistency.py): every DDP rank holds the same weights and optimizer state.

They share one record (events.py) and work alone or together: conf/presets/stability.yaml, docs/stability.md.

`mhc fit|validate|test` install more by default (fit/cli.py's build_cli), among them FinalValidation
(final_validation.py: every fit ends with a validation), PerLayerArtifacts (per_layer_artifacts.py: the per-layer
diagnostics as MLflow artifacts), DivergenceGuard (divergence.py: a non-finite training loss ends the fit, FAILED, exit
status 3) and GracefulStop (graceful_stop.py: Ctrl-C or SIGTERM stops at the end of a step with a checkpoint).
"""

from .events import StabilityChannel, StabilityEvent, channel_of
from .instability import InstabilityDetector
from .rank_consistency import RankConsistencyCheck
from .sinkhorn_schedule import SinkhornScheduler
from .snapshots import GradientSnapshots, RollbackError

__all__ = [
    "GradientSnapshots",
    "InstabilityDetector",
    "RankConsistencyCheck",
    "RollbackError",
    "SinkhornScheduler",
    "StabilityChannel",
    "StabilityEvent",
    "channel_of",
]
