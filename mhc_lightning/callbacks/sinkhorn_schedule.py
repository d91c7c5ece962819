"""SinkhornScheduler: the Sinkhorn iteration count of each mHC sublayer, adapted during training.

Policy (every `every` steps, on the module's diagnostics of one sequence; docs/design.md §3):

    tol = base_tol * 10 ** (-intensity)                       # intensity = constraint intensity (sweeps)
    r_l = max_tokens max(|row sums - 1|, |col sums - 1|) of H_res at layer l, measured at the current count
    tighten  (detector events since the last update, or std of log grad norm over the last grad_window
              steps > grad_log_std_max):   t_l <- ceil(up_factor * t_l)   for every layer, hold decreases
    else r_l > tol:                        t_l <- ceil(up_factor * t_l)
    else r_l < down_margin * tol:          t_l <- t_l - down_step         (unless holding)
    t_l <- clamp(t_l, min_iters, max_iters)

Multiplicative increase / additive decrease: the residual decays roughly geometrically with the count, so
a shortfall is closed in a few updates while savings are taken cautiously; the band [down_margin*tol, tol]
keeps the count from oscillating. With per_layer=false one count (from the worst layer) is used for all.
After a rollback, GradientSnapshots' cool-down asks (through the shared channel) for at least
`cooldown_sinkhorn_iters` until the cool-down ends; the bounds still apply.

The count is the plain int attribute `HyperConnection.sinkhorn_iters`, read at every forward and passed
to the Sinkhorn op as a runtime argument (the fused Triton kernel takes it as a scalar, not a constexpr),
so changing it never recompiles a kernel.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ..model import hyper_connections
from .events import channel_of, check_number, log_metrics
from .instability import KINDS

# Detector / snapshot event kinds that mean "the constraint must tighten": all but the two that H_res does not cause
# (an fp16 overflow, which the GradScaler handles, and streams that stayed identical), and the snapshots' rollback.
TIGHTEN_KINDS = frozenset(KINDS) - {"amp_overflow", "degenerate_streams"} | {"rollback"}


def next_iters(
    iters: int,
    residual: float,
    tol: float,
    *,
    tighten: bool,
    hold: bool,
    up_factor: float,
    down_step: int,
    down_margin: float,
    min_iters: int,
    max_iters: int,
) -> int:
    """One policy update for one count (see the module docstring); pure, for tests and docs."""
    if tighten or not residual <= tol:  # NaN residual counts as too large
        new = max(iters + 1, math.ceil(iters * up_factor))
    elif residual < down_margin * tol and not hold:
        new = iters - down_step
    else:
        new = iters
    return max(min_iters, min(max_iters, new))


class SinkhornScheduler(Callback):
    """Adapt the Sinkhorn iteration count per mHC sublayer (or globally) between bounds.

    Args:
        intensity: constraint intensity, the knob a sweep tunes: tol = base_tol * 10**(-intensity);
            0 = base tolerance, each +1 asks for a 10x smaller doubly-stochastic residual.
        base_tol: residual tolerance at intensity 0.
        min_iters, max_iters: bounds on every count.
        init_iters: starting count for every layer; null = keep the model's configured sinkhorn_iters.
        every: optimizer steps between updates (the module is asked for diagnostics on those steps).
        per_layer: one count per sublayer (true) or one for all (false).
        up_factor: multiplicative increase (> 1) when the residual is above tol or tightening is asked.
        down_step: additive decrease when the residual is below down_margin * tol.
        down_margin: fraction of tol under which the count may go down (hysteresis band).
        tighten_on_events: raise all counts after detector events / rollbacks.
        grad_window: steps of log grad norms kept for the variance signal.
        grad_log_std_max: tighten when the std of log grad norm over grad_window exceeds this; null = off.
        hold_steps: after tightening, no decrease for this many steps.
    """

    def __init__(
        self,
        intensity: float = 0.0,
        base_tol: float = 1e-2,
        min_iters: int = 4,
        max_iters: int = 50,
        init_iters: Optional[int] = None,
        every: int = 25,
        per_layer: bool = True,
        up_factor: float = 1.5,
        down_step: int = 1,
        down_margin: float = 0.1,
        tighten_on_events: bool = True,
        grad_window: int = 50,
        grad_log_std_max: Optional[float] = 1.0,
        hold_steps: int = 100,
    ):
        super().__init__()
        me = type(self).__name__
        check_number(me, "intensity", intensity)
        check_number(me, "base_tol", base_tol, low=0, strict=True)
        check_number(me, "min_iters", min_iters, low=1, integer=True)
        check_number(me, "max_iters", max_iters, low=min_iters, integer=True)
        check_number(me, "init_iters", init_iters, low=min_iters, high=max_iters, integer=True, optional=True)
        check_number(me, "every", every, low=1, integer=True)
        check_number(me, "up_factor", up_factor, low=1, strict=True)
        check_number(me, "down_step", down_step, low=1, integer=True)
        check_number(me, "down_margin", down_margin, low=0, strict=True, high=1)
        check_number(me, "grad_window", grad_window, low=2, integer=True)
        check_number(me, "grad_log_std_max", grad_log_std_max, low=0, strict=True, optional=True)
        check_number(me, "hold_steps", hold_steps, low=0, integer=True)
        for name, value in (("per_layer", per_layer), ("tighten_on_events", tighten_on_events)):
            if not isinstance(value, bool):
                raise ValueError(f"{me}.{name} must be true or false, got {value!r}")
        self.intensity, self.base_tol = float(intensity), base_tol
        self.tol = base_tol * 10 ** (-self.intensity)
        self.min_iters, self.max_iters, self.init_iters = min_iters, max_iters, init_iters
        self.every, self.per_layer = every, per_layer
        self.up_factor, self.down_step, self.down_margin = up_factor, down_step, down_margin
        self.tighten_on_events, self.grad_log_std_max, self.hold_steps = tighten_on_events, grad_log_std_max, hold_steps
        self.log_grads: deque[float] = deque(maxlen=grad_window)
        self.iters: list[int] = []  # the schedule's counts (restored from checkpoints, then pushed to the layers)
        self.hold_until = -1
        self.history: deque[tuple[int, list[int]]] = deque(maxlen=200)  # (step, counts) of recent updates
        self._layers: list = []
        self._seen_events = 0
        self._batch_step = 0
        self._active = True

    @property
    def state_key(self) -> str:
        return type(self).__name__

    # ---- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._seen_events = 0
        model = getattr(pl_module, "model", None)
        self._layers = [l for l in hyper_connections(model) if l.spec.sinkhorn] if model is not None else []
        if not self._layers:
            self._active = False
            exact = sorted({l.mode for l in hyper_connections(model) if l.spec.exact} if model is not None else ())
            why = (
                f"residual_mode={exact[0]} makes H_res exactly doubly stochastic without Sinkhorn"
                if exact
                else "the model has no mHC (Sinkhorn) sublayers"
            )
            rank_zero_warn(f"{type(self).__name__}: {why}; nothing to schedule.")
            return
        channel_of(pl_module, trainer).sinkhorn_owner = self
        if not self.iters:  # a checkpoint restores them in load_state_dict (called after setup)
            start = [self.init_iters or l.sinkhorn_iters for l in self._layers]
            self.iters = [max(self.min_iters, min(self.max_iters, t)) for t in start]
            if not self.per_layer:
                self.iters = [max(self.iters)] * len(self.iters)
        self._push()

    def on_train_start(self, trainer, pl_module) -> None:
        if self._active:
            self._push()  # after a checkpoint restored self.iters
            self._log(trainer, trainer.global_step, residual=None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._active:
            return
        step = self._batch_step = trainer.global_step
        if step % self.every == 0:
            pl_module.request_diagnostics()
        channel = channel_of(pl_module)
        if step < channel.tighten_until:  # rollback cool-down floor, within the bounds
            floor = min(self.max_iters, channel.tighten_iters)
            if any(t < floor for t in self.iters):
                self.iters = [max(t, floor) for t in self.iters]
                self.hold_until = max(self.hold_until, channel.tighten_until)
                self._push()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._active:
            return
        g = getattr(pl_module, "last_grad_norm", None)
        if pl_module.last_loss is not None and g is not None and math.isfinite(g) and g > 0:
            self.log_grads.append(math.log(g))
        step = self._batch_step
        if step % self.every != 0 or pl_module.last_diagnostics_step != step or not pl_module.last_per_layer:
            return
        per = pl_module.last_per_layer
        residuals = [max(r, c) for r, c in zip(per["sinkhorn_row_residual_max"], per["sinkhorn_col_residual_max"])]
        residuals = [residuals[l.layer_index] for l in self._layers]
        self.update(step, residuals, self._tighten_reason(pl_module))
        log_metrics(trainer, {"sinkhorn/residual_max": max(residuals)}, step)
        self._log(trainer, step, residual=residuals)

    def state_dict(self) -> dict:
        return {
            "iters": list(self.iters),
            "hold_until": self.hold_until,
            "log_grads": list(self.log_grads),
            "history": [(s, list(i)) for s, i in self.history],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.iters = list(state_dict["iters"])
        self.hold_until = state_dict["hold_until"]
        self.log_grads.clear(), self.log_grads.extend(state_dict["log_grads"])
        self.history.clear(), self.history.extend((s, list(i)) for s, i in state_dict["history"])

    # ---- policy ---------------------------------------------------------------------------
    def _tighten_reason(self, pl_module) -> Optional[str]:
        channel = channel_of(pl_module)
        new = channel.events_since(self._seen_events)
        self._seen_events = len(channel.events)
        if self.tighten_on_events:
            kinds = sorted({e.kind for e in new if e.kind in TIGHTEN_KINDS})
            if kinds:
                return "events: " + ", ".join(kinds)
        if self.grad_log_std_max is not None and len(self.log_grads) >= self.log_grads.maxlen // 2:
            std = statistics.pstdev(self.log_grads)
            if std > self.grad_log_std_max:
                return f"std of log grad norm {std:.3g} > {self.grad_log_std_max:g}"
        return None

    def update(self, step: int, residuals: list[float], tighten_reason: Optional[str] = None) -> list[int]:
        """Apply the policy to measured per-layer residuals (one entry per mHC sublayer); returns the counts."""
        tighten = tighten_reason is not None
        if tighten:
            self.hold_until = max(self.hold_until, step + self.hold_steps)
        hold = step < self.hold_until
        kw = dict(
            tighten=tighten,
            hold=hold,
            up_factor=self.up_factor,
            down_step=self.down_step,
            down_margin=self.down_margin,
            min_iters=self.min_iters,
            max_iters=self.max_iters,
        )
        if self.per_layer:
            self.iters = [next_iters(t, r, self.tol, **kw) for t, r in zip(self.iters, residuals)]
        else:
            worst = max(residuals) if all(r == r for r in residuals) else float("nan")
            self.iters = [next_iters(max(self.iters), worst, self.tol, **kw)] * len(self.iters)
        self.history.append((step, list(self.iters)))
        self._push()
        return self.iters

    def _push(self) -> None:
        for layer, t in zip(self._layers, self.iters):
            layer.sinkhorn_iters = int(t)

    def _log(self, trainer, step: int, residual) -> None:
        metrics = {f"sinkhorn/iters/layer_{l.layer_index:02d}": float(t) for l, t in zip(self._layers, self.iters)}
        metrics["sinkhorn/iters_mean"] = sum(self.iters) / len(self.iters)
        metrics["sinkhorn/tol"] = self.tol
        log_metrics(trainer, metrics, step)
