"""MetricRecorder: the values of a trial's objective metrics over its fit, and the objective metrics it never saw."""

from __future__ import annotations

import statistics

from lightning.pytorch.callbacks import Callback


class MetricRecorder(Callback):
    """Values of the objective metrics over the trial, for `reduce` (last / min / max / mean / median).

    val/* metrics are read at each validation end; the others (logged per step, e.g. tokens/s, Amax)
    whenever their value in trainer.callback_metrics changes, since that dict keeps the last value.

    A val/* objective that is not among the metrics after the first validation is never going to be logged (a typo,
    or a metric the model does not log): the fit stops there and `missing` names it, so the sweep can stop before
    other trials train for nothing. Other objectives are judged at the end of fit (they may be logged only every
    few steps).
    """

    def __init__(self, metrics: list[str]):
        self.history: dict[str, list[tuple[int, float]]] = {m: [] for m in metrics}
        self.missing: list[str] = []
        self._validated = False

    def _grab(self, trainer, validation: bool) -> None:
        for m, h in self.history.items():
            if m.startswith("val/") != validation:
                continue
            v = trainer.callback_metrics.get(m)
            if v is None:
                continue
            v = float(v)
            if validation or not h or h[-1][1] != v:
                h.append((trainer.global_step, v))

    def on_train_batch_end(self, trainer, *args) -> None:
        self._grab(trainer, validation=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self._grab(trainer, validation=False)
        self.missing += [
            m for m, h in self.history.items() if not m.startswith("val/") and not h and m not in self.missing
        ]

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        self._grab(trainer, validation=True)
        if not self._validated:
            self._validated = True
            self.missing = [m for m in self.history if m.startswith("val/") and m not in trainer.callback_metrics]
            if self.missing:  # the same on every rank (validation metrics are synced), so all ranks stop together
                trainer.should_stop = True

    @classmethod
    def from_result(cls, history: dict[str, list], missing: list[str]) -> MetricRecorder:
        """A recorder holding what another process recorded (a subprocess trial's result file)."""
        rec = cls(list(history))
        rec.history = {m: [(int(step), float(v)) for step, v in h] for m, h in history.items()}
        rec.missing = list(missing)
        return rec

    def value(self, metric: str, reduce: str) -> float:
        vals = [v for _, v in self.history[metric]]
        if not vals:
            raise ValueError(f"objective metric {metric!r} was never logged during the trial")
        return {
            "last": lambda: vals[-1],
            "min": lambda: min(vals),
            "max": lambda: max(vals),
            "mean": lambda: statistics.fmean(vals),
            "median": lambda: statistics.median(vals),
        }[reduce]()
