"""The record the stability callbacks share: events, the rollback request, and who handles what.

One `StabilityChannel` per LightningModule, reached with `channel_of(pl_module)`. It is plain state, not a
bus: the detector appends events and may set `rollback_request`; GradientSnapshots registers itself as
`rollback_handler` and consumes the request in on_train_batch_end; SinkhornScheduler registers as
`sinkhorn_owner` and reads `tighten_until` (rollback cool-down) and new events. Every callback can flush
the events table, so each one works alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Optional, get_args

from lightning.pytorch.utilities import rank_zero_info

from ..loggers.mlflow_runs import mlflow_loggers

if TYPE_CHECKING:
    import torch

Action = Literal["log", "skip", "rollback", "stop"]
ACTIONS = get_args(Action)
_SEVERITY = {a: i for i, a in enumerate(ACTIONS)}  # stop > rollback > skip > log
EVENTS_ARTIFACT = "stability/events.json"


def check_choice(owner: str, name: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {list(allowed)}, got {value!r}")


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    low: Optional[float] = None,
    strict: bool = False,
    high: Optional[float] = None,
    optional: bool = False,
    integer: bool = False,
) -> None:
    """Raise ValueError naming owner.name unless low <(=) value (<= high); None passes when optional."""
    if value is None and optional:
        return
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok and low is not None:
        ok = value > low if strict else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        rng = f"{'>' if strict else '>='} {low}" if low is not None else "a number"
        rng += f" and <= {high}" if high is not None else ""
        what = "an integer" if integer else "a number"
        none = " or null (off)" if optional else ""
        raise ValueError(f"{owner}.{name} must be {what} {rng}{none}, got {value!r}")


def norm_sum(tensors: list) -> torch.Tensor:
    """Sum of the 2-norms of `tensors` as a float32 scalar on the first one's device: finite iff every value is.

    Half-precision norms are computed in float32 (an fp16 norm overflows long before its values do). Tensors on
    other devices (an optimizer's step counters stay on the CPU) are reduced where they live, then moved.
    """
    import torch

    if not tensors:
        return torch.zeros(())
    home, total = tensors[0].device, []
    for dev in dict.fromkeys(t.device for t in tensors):
        on = [t for t in tensors if t.device == dev]
        half = [t for t in on if t.dtype in (torch.float16, torch.bfloat16)]
        rest = [t for t in on if t.dtype not in (torch.float16, torch.bfloat16)]
        norms = [torch.stack(torch._foreach_norm(half, 2, dtype=torch.float32))] if half else []
        norms += [torch.stack(torch._foreach_norm(rest)).float()] if rest else []
        total.append(torch.cat(norms).sum().to(home))
    return torch.stack(total).sum()


def stronger(a: str, b: str) -> str:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


@dataclass
class StabilityEvent:
    """One row of the events table."""

    step: int
    kind: str  # e.g. loss_spike, nonfinite_grad, amax, rollback, rollback_rejected, sinkhorn_schedule
    value: float
    threshold: float
    action: str  # what was done: log / skip / rollback / stop / restored / rejected / ...
    source: str = ""  # the callback that recorded it
    detail: str = ""


@dataclass
class StabilityChannel:
    events: list[StabilityEvent] = field(default_factory=list)
    rollback_request: Optional[StabilityEvent] = None  # set by the detector, consumed by GradientSnapshots
    rollback_handler: Any = None  # the GradientSnapshots instance of this fit, if any
    sinkhorn_owner: Any = None  # the SinkhornScheduler instance of this fit, if any
    tighten_until: int = -1  # rollback cool-down: keep Sinkhorn iterations raised until this global step
    tighten_iters: int = 0  # ... to at least this many
    last_event_step: Optional[int] = None  # newest step with a detector event (snapshots avoid saving right after one)
    _flushed: int = 0
    _trainer_id: int = 0

    def record(self, event: StabilityEvent, trainer=None) -> StabilityEvent:
        self.events.append(event)
        rank_zero_info(
            f"[stability] step {event.step}: {event.kind} value={event.value:.4g} "
            f"threshold={event.threshold:.4g} action={event.action}" + (f" ({event.detail})" if event.detail else "")
        )
        if trainer is not None:
            log_metrics(
                trainer,
                {f"stability/{event.kind}": event.value, "stability/events_total": float(len(self.events))},
                event.step,
            )
        return event

    def events_since(self, index: int) -> list[StabilityEvent]:
        return self.events[index:]

    def flush(self, trainer) -> None:
        """Append the rows not yet written to the MLflow events table (log_table appends to an existing file)."""
        rows = self.events[self._flushed :]
        if not rows or trainer.global_rank != 0:
            return
        table = {k: [asdict(e)[k] for e in rows] for k in asdict(rows[0])}
        for lg in mlflow_loggers(trainer):
            lg.experiment.log_table(lg.run_id, data=table, artifact_file=EVENTS_ARTIFACT)
        self._flushed = len(self.events)


def channel_of(pl_module, trainer=None) -> StabilityChannel:
    """The module's channel; a new fit (another trainer) starts a fresh record."""
    ch = getattr(pl_module, "stability_channel", None)
    if ch is None or (trainer is not None and ch._trainer_id != id(trainer)):
        ch = StabilityChannel(_trainer_id=id(trainer) if trainer is not None else 0)
        pl_module.stability_channel = ch
    return ch


def log_metrics(trainer, metrics: dict[str, float], step: int) -> None:
    """Straight to the loggers: usable from any hook, and events are rare, so no aggregation is wanted."""
    if trainer.global_rank != 0:
        return
    for lg in trainer.loggers:
        lg.log_metrics(metrics, step=step)


def set_tag(trainer, key: str, value: str) -> None:
    if trainer.global_rank != 0:
        return
    for lg in mlflow_loggers(trainer):
        lg.experiment.set_tag(lg.run_id, key, value)
