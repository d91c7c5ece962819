"""InstabilityDetector: watch every optimizer step for loss spikes, gradient explosions, non-finite values,
Amax growth, Sinkhorn residuals and fp16 overflows; record each event and act on it.

It also reports "degenerate hyper-connections": a multi-stream run whose n streams are still identical after
warm-up (docs/design.md §6) measures a residual net with scalar gates, whatever its config says.

Everything is checked in on_before_optimizer_step, i.e. after backward and before the update, so the action
can still veto the update. One host sync per step: loss, global and per-sublayer gradient norms and the
parameter finiteness check travel in one tensor. Amax and Sinkhorn residual come from the module's own
diagnostics (every `diagnostics_every` steps, or when SinkhornScheduler asks), so they cost nothing extra.

Actions (per event kind, `on_<kind>`): log | skip (drop this update) | rollback (skip, then GradientSnapshots
restores a validated snapshot) | stop (skip, then trainer.should_stop with a message). Without a
GradientSnapshots callback, rollback degrades to skip (to stop for non-finite parameters, which a skip
cannot repair), and the event row says so.
"""

from __future__ import annotations

import inspect
import math
import statistics
from collections import deque
from typing import Optional

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from .events import (
    ACTIONS,
    Action,
    StabilityEvent,
    channel_of,
    check_choice,
    check_number,
    log_metrics,
    norm_sum,
    set_tag,
    stronger,
)

_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class _Rows:
    """Ring buffer of the last `size` equal-length rows, with a column median (numpy: no per-step re-packing)."""

    def __init__(self, size: int, rows: Optional[list[list[float]]] = None):
        self.size, self.buf, self.n, self.pos = size, None, 0, 0
        for r in rows or []:
            self.append(r)

    def __len__(self) -> int:
        return self.n

    def append(self, row) -> None:
        if self.buf is None or self.buf.shape[1] != len(row):
            self.buf, self.n, self.pos = np.empty((self.size, len(row))), 0, 0
        self.buf[self.pos] = row
        self.pos, self.n = (self.pos + 1) % self.size, min(self.n + 1, self.size)

    def median(self) -> np.ndarray:
        return np.median(self.buf[: self.n], axis=0)

    def rows(self) -> list[list[float]]:
        if self.buf is None:
            return []
        order = range(self.pos - self.n, self.pos)
        return [self.buf[i % self.size].tolist() for i in order]


class InstabilityDetector(Callback):
    """Detect training instabilities every step and log / skip / roll back / stop.

    Args:
        loss_window: number of recent (non-event) losses in the running median / MAD window.
        loss_min_history: no spike verdict before this many losses are in the window.
        loss_z_threshold: spike when (loss - median) / (1.4826 MAD) exceeds this; null turns the check off.
        loss_min_scale: floor of the robust scale as a fraction of the median (a plateau has MAD ~ 0).
        grad_window, grad_min_history: the same, for the global and per-sublayer gradient norms.
        grad_factor: explosion when the global pre-clip grad norm exceeds this times its running median.
        layer_grad_factor: the same per sublayer (attention / MLP with its HC coefficients).
        amax_bound: event when the composite H_res Amax gain (max of forward and backward, worst token)
            exceeds this (docs/design.md §7); needs module diagnostics; null = off.
        sinkhorn_residual_bound: event when max |row/col sum - 1| of H_res exceeds this (mHC only).
        min_stream_spread: "degenerate hyper-connections" event (once per run) when, from step `degenerate_after`
            on, the relative spread of the streams at the last sublayer (diagnostic streams/spread_last) is
            below this; null = off. Bitwise identical streams give exactly 0.
        check_params: also check that every parameter is finite (one extra read of the weights per step).
        min_loss_scale: under 16-mixed, non-finite gradients are an fp16 overflow (amp_overflow, which the
            GradScaler handles) until the scale falls below this; then they count as nonfinite_grad.
        on_<kind>: action for each event kind, one of log | skip | rollback | stop.
    """

    def __init__(
        self,
        loss_window: int = 100,
        loss_min_history: int = 20,
        loss_z_threshold: Optional[float] = 6.0,
        loss_min_scale: float = 0.01,
        grad_window: int = 100,
        grad_min_history: int = 20,
        grad_factor: Optional[float] = 10.0,
        layer_grad_factor: Optional[float] = 20.0,
        amax_bound: Optional[float] = 2.0,
        sinkhorn_residual_bound: Optional[float] = 0.05,
        min_stream_spread: Optional[float] = 1e-6,
        degenerate_after: int = 50,
        check_params: bool = True,
        min_loss_scale: float = 1.0,
        on_loss_spike: Action = "rollback",
        on_grad_explosion: Action = "skip",
        on_layer_grad_explosion: Action = "log",
        on_nonfinite_loss: Action = "skip",
        on_nonfinite_grad: Action = "skip",
        on_nonfinite_param: Action = "rollback",
        on_amax: Action = "log",
        on_sinkhorn_residual: Action = "log",
        on_amp_overflow: Action = "log",
        on_degenerate_streams: Action = "log",
    ):
        given = dict(locals())  # the on_<kind> arguments, read by kind below
        super().__init__()
        me = type(self).__name__
        for name, value in (("loss_window", loss_window), ("grad_window", grad_window)):
            check_number(me, name, value, low=2, integer=True)
        check_number(me, "loss_min_history", loss_min_history, low=2, high=loss_window, integer=True)
        check_number(me, "grad_min_history", grad_min_history, low=2, high=grad_window, integer=True)
        check_number(me, "loss_z_threshold", loss_z_threshold, low=0, strict=True, optional=True)
        check_number(me, "loss_min_scale", loss_min_scale, low=0)
        for name, value in (
            ("grad_factor", grad_factor),
            ("layer_grad_factor", layer_grad_factor),
            ("amax_bound", amax_bound),
        ):
            check_number(me, name, value, low=1, strict=True, optional=True)
        check_number(me, "sinkhorn_residual_bound", sinkhorn_residual_bound, low=0, strict=True, optional=True)
        check_number(me, "min_loss_scale", min_loss_scale, low=0)
        check_number(me, "min_stream_spread", min_stream_spread, low=0, strict=True, optional=True)
        check_number(me, "degenerate_after", degenerate_after, low=0, integer=True)
        if not isinstance(check_params, bool):
            raise ValueError(f"{me}.check_params must be true or false, got {check_params!r}")
        self.actions = {kind: given[f"on_{kind}"] for kind in KINDS}
        for kind, action in self.actions.items():
            check_choice(me, f"on_{kind}", action, ACTIONS)
        self.loss_z_threshold, self.loss_min_scale = loss_z_threshold, loss_min_scale
        self.loss_min_history, self.grad_min_history = loss_min_history, grad_min_history
        self.grad_factor, self.layer_grad_factor = grad_factor, layer_grad_factor
        self.amax_bound, self.sinkhorn_residual_bound = amax_bound, sinkhorn_residual_bound
        self.check_params, self.min_loss_scale = check_params, min_loss_scale
        self.min_stream_spread, self.degenerate_after = min_stream_spread, degenerate_after
        self.losses: deque[float] = deque(maxlen=loss_window)
        self.grad_norms: deque[float] = deque(maxlen=grad_window)
        self.layer_norms = _Rows(grad_window)  # per-sublayer grad norms, one row per healthy step
        self.counts = {k: 0 for k in KINDS}
        self._params: list[torch.nn.Parameter] = []
        self._warned_fallback = False
        self._seen: dict[str, float] = {}

    @property
    def state_key(self) -> str:
        return type(self).__name__

    # ---- Lightning hooks ------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        for hook in ("grad_norms", "last_loss", "skip_optimizer_step", "last_diagnostics_step"):
            if not hasattr(pl_module, hook):
                raise TypeError(
                    f"{type(self).__name__} needs the LitLM hooks (missing {hook!r} on "
                    f"{type(pl_module).__name__}); see mhc_lightning/training/module.py"
                )
        channel_of(pl_module, trainer)
        self._params = list(pl_module.parameters())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        loss = pl_module.last_loss
        if loss is None:  # the batch was skipped: nothing was computed
            return
        step = trainer.global_step
        total, per_layer = pl_module.grad_norms()
        loss = loss.reshape(1).float()
        if trainer.world_size > 1:  # gradients are all-reduced already, the loss is per rank: decide alike
            loss = trainer.strategy.reduce(loss, reduce_op="mean")
        parts = [loss, total.reshape(1).float(), per_layer.float()]
        if self.check_params:
            parts.append(norm_sum([p.detach() for p in self._params]).reshape(1))
        values = torch.cat([t.to(parts[0].device) for t in parts]).tolist()  # the one host sync
        loss_v, grad_v, layer_v = values[0], values[1], values[2 : 2 + per_layer.numel()]
        param_v = values[-1] if self.check_params else 0.0

        events = self._evaluate(trainer, pl_module, step, loss_v, grad_v, layer_v, param_v)
        # What the detector sees, on the logging cadence. Straight to the loggers: self.log per key per step would be
        # most of this callback's budget (docs/stability.md, "Overhead"), and only every n-th value is kept.
        if self._seen and step % max(1, trainer.log_every_n_steps) == 0:
            log_metrics(trainer, self._seen, step)
        if events:
            self._act(trainer, pl_module, step, events)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        channel_of(pl_module).flush(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        channel_of(pl_module).flush(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        channel_of(pl_module).flush(trainer)

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "layer_norms": self.layer_norms.rows(),
            "counts": dict(self.counts),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.losses.clear(), self.losses.extend(state_dict["losses"])
        self.grad_norms.clear(), self.grad_norms.extend(state_dict["grad_norms"])
        self.layer_norms = _Rows(self.grad_norms.maxlen, state_dict["layer_norms"])
        self.counts.update(state_dict["counts"])

    # ---- detection ------------------------------------------------------------------------
    def _evaluate(self, trainer, pl_module, step, loss_v, grad_v, layer_v, param_v) -> list[StabilityEvent]:
        events: list[StabilityEvent] = []

        def add(kind, value, threshold, detail=""):
            events.append(
                StabilityEvent(
                    step, kind, float(value), float(threshold), self.actions[kind], type(self).__name__, detail
                )
            )

        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if not math.isfinite(loss_v):
            add("nonfinite_loss", loss_v, math.inf, "loss is not finite")
        if not math.isfinite(grad_v):
            if scaler is not None:
                scale = float(scaler.get_scale())  # only read on overflow: no per-step sync
                add(
                    "amp_overflow",
                    scale,
                    self.min_loss_scale,
                    "fp16 gradient overflow; the GradScaler skips this update and lowers the scale",
                )
                if scale < self.min_loss_scale:
                    add("nonfinite_grad", grad_v, math.inf, f"still non-finite at loss scale {scale:g}")
            else:
                bad = [i for i, v in enumerate(layer_v) if not math.isfinite(v)]
                add("nonfinite_grad", grad_v, math.inf, f"non-finite gradient norm; sublayers {bad or 'none'}")
        if not math.isfinite(param_v):
            add("nonfinite_param", param_v, math.inf, "a parameter is not finite before this update")

        spike, self._seen = False, {}
        if self.loss_z_threshold is not None and math.isfinite(loss_v) and len(self.losses) >= self.loss_min_history:
            med = statistics.median(self.losses)
            mad = statistics.median(abs(v - med) for v in self.losses)
            scale = max(_MAD_TO_SIGMA * mad, self.loss_min_scale * abs(med), 1e-12)
            z = (loss_v - med) / scale
            self._seen["stability/loss_z"] = z
            if z > self.loss_z_threshold:  # upward only: a falling loss is never an instability
                spike = True
                add(
                    "loss_spike",
                    z,
                    self.loss_z_threshold,
                    f"loss {loss_v:.4f} vs running median {med:.4f} "
                    f"(robust scale {scale:.4g}, window {len(self.losses)})",
                )

        exploded = False
        if math.isfinite(grad_v) and len(self.grad_norms) >= self.grad_min_history:
            if self.grad_factor is not None:
                med = statistics.median(self.grad_norms)
                ratio = grad_v / max(med, 1e-12)
                self._seen["stability/grad_norm_ratio"] = ratio
                if ratio > self.grad_factor:
                    exploded = True
                    add(
                        "grad_explosion",
                        ratio,
                        self.grad_factor,
                        f"pre-clip grad norm {grad_v:.4g} vs running median {med:.4g}",
                    )
            if self.layer_grad_factor is not None and layer_v and len(self.layer_norms) >= self.grad_min_history:
                meds = np.maximum(self.layer_norms.median(), 1e-12)
                ratios = np.asarray(layer_v) / meds
                worst = int(ratios.argmax())
                self._seen["stability/layer_grad_norm_ratio_max"] = float(ratios[worst])
                if ratios[worst] > self.layer_grad_factor:
                    exploded = True
                    over = np.flatnonzero(ratios > self.layer_grad_factor).tolist()
                    add(
                        "layer_grad_explosion",
                        ratios[worst],
                        self.layer_grad_factor,
                        f"sublayers {over}; worst {worst}: norm {layer_v[worst]:.4g} "
                        f"vs median {float(meds[worst]):.4g}",
                    )

        if pl_module.last_diagnostics_step == step and pl_module.last_diagnostics:
            d = pl_module.last_diagnostics
            if self.amax_bound is not None and "amax/composite_fwd_max" in d:
                amax = max(d["amax/composite_fwd_max"], d["amax/composite_bwd_max"])
                log_metrics(trainer, {"stability/amax": amax}, step)
                if not amax <= self.amax_bound:
                    add(
                        "amax",
                        amax,
                        self.amax_bound,
                        f"composite H_res gain fwd {d['amax/composite_fwd_max']:.4g}, "
                        f"bwd {d['amax/composite_bwd_max']:.4g} (worst token)",
                    )
            sinkhorn = (
                getattr(getattr(pl_module, "model", None), "cfg", None) is not None
                and pl_module.model.cfg.hyper.spec.sinkhorn
            )
            if self.sinkhorn_residual_bound is not None and sinkhorn and "sinkhorn/col_residual_max" in d:
                res = max(d["sinkhorn/row_residual_max"], d["sinkhorn/col_residual_max"])
                if not res <= self.sinkhorn_residual_bound:
                    add(
                        "sinkhorn_residual",
                        res,
                        self.sinkhorn_residual_bound,
                        f"max |row sum - 1| {d['sinkhorn/row_residual_max']:.3g}, "
                        f"max |col sum - 1| {d['sinkhorn/col_residual_max']:.3g}",
                    )

            spread = d.get("streams/spread_last")
            if (
                self.min_stream_spread is not None
                and spread is not None
                and step >= self.degenerate_after
                and not self.counts["degenerate_streams"]
                and not spread >= self.min_stream_spread
            ):
                add(
                    "degenerate_streams",
                    spread,
                    self.min_stream_spread,
                    f"degenerate hyper-connections: the {pl_module.model.n} streams are still identical after "
                    f"{step} steps (relative spread {spread:.3g} at the last sublayer), so this run measures a "
                    "residual net with scalar gates; change model.arch.hyper.bias_init (home, a6, hc_identity) "
                    "or model.arch.hyper.phi_init (normal, xavier)",
                )

        # Only healthy steps feed the running statistics, so an event never raises its own baseline.
        if math.isfinite(loss_v) and not spike:
            self.losses.append(loss_v)
        if math.isfinite(grad_v) and not exploded and all(math.isfinite(v) for v in layer_v):
            self.grad_norms.append(grad_v)
            if layer_v:
                self.layer_norms.append(layer_v)
        return events

    # ---- actions --------------------------------------------------------------------------
    def _act(self, trainer, pl_module, step: int, events: list[StabilityEvent]) -> None:
        channel = channel_of(pl_module)
        for e in events:
            if e.action == "rollback" and channel.rollback_handler is None:
                e.action = "stop" if e.kind == "nonfinite_param" else "skip"
                e.detail += f"; rollback unavailable (no GradientSnapshots callback): {e.action} instead"
                if not self._warned_fallback:
                    self._warned_fallback = True
                    rank_zero_warn(
                        f"{type(self).__name__}: a rollback was requested but no GradientSnapshots "
                        "callback is configured; skipping the update instead."
                    )
        action = "log"
        for e in events:
            action = stronger(e.action, action)
            self.counts[e.kind] += 1
            channel.record(e, trainer)
        channel.last_event_step = step
        if action == "log":
            return
        pl_module.skip_optimizer_step = True  # every non-log action first vetoes this update
        primary = next(e for e in events if e.action == action)
        if action == "rollback":
            channel.rollback_request = primary
        elif action == "stop":
            msg = (
                f"{type(self).__name__}: stopping at step {step}: {primary.kind} "
                f"(value {primary.value:.4g}, threshold {primary.threshold:.4g}; {primary.detail}). "
                f"The update of this step was not applied; see the {len(channel.events)} event(s) in "
                "the stability/events.json table."
            )
            rank_zero_warn(msg)
            set_tag(trainer, "stability.stop_reason", msg[:4900])
            trainer.should_stop = True


# The event kinds, written once: as the detector's on_<kind> arguments (the config keys that set their actions).
_ARGS = inspect.signature(InstabilityDetector.__init__).parameters
KINDS = tuple(name.removeprefix("on_") for name in _ARGS if name.startswith("on_"))
