"""SinkhornScheduler: converged -> fewer iterations, tightened tolerance -> more, bounds, triggers, logging."""

from __future__ import annotations

import pytest
from helpers import NaNGradAt, fast_first, tiny_fit, tiny_module
from lightning.pytorch.loggers import Logger

from mhc_lightning.callbacks import InstabilityDetector, SinkhornScheduler
from mhc_lightning.callbacks.sinkhorn_schedule import next_iters

POLICY = dict(up_factor=1.5, down_step=1, down_margin=0.1, min_iters=4, max_iters=30)


class MemoryLogger(Logger):
    """Keeps logged metrics in memory: {name: [(step, value), ...]}."""

    def __init__(self):
        super().__init__()
        self.metrics: dict[str, list[tuple[int, float]]] = {}

    name, version = "memory", 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        for k, v in metrics.items():
            self.metrics.setdefault(k, []).append((step, float(v)))


def test_policy_step():
    tol = 1e-3
    assert next_iters(20, 1e-6, tol, tighten=False, hold=False, **POLICY) == 19  # converged: down
    assert next_iters(20, 5e-4, tol, tighten=False, hold=False, **POLICY) == 20  # inside the band: keep
    assert next_iters(20, 5e-3, tol, tighten=False, hold=False, **POLICY) == 30  # above tol: x1.5
    assert next_iters(20, 1e-6, tol, tighten=True, hold=True, **POLICY) == 30  # tighten wins
    assert next_iters(20, 1e-6, tol, tighten=False, hold=True, **POLICY) == 20  # holding: no decrease
    assert next_iters(4, 0.0, tol, tighten=False, hold=False, **POLICY) == 4  # lower bound
    assert next_iters(25, 1.0, tol, tighten=False, hold=False, **POLICY) == 30  # upper bound
    assert next_iters(5, float("nan"), tol, tighten=False, hold=False, **POLICY) == 8  # NaN residual: up


def test_converged_sinkhorn_goes_down_and_is_logged_per_layer(tiny_corpus):
    """zeros init: H_res = J/n is doubly stochastic, residual ~1e-6 << tol: the counts step down to min."""
    logger = MemoryLogger()
    sched = SinkhornScheduler(every=2, min_iters=16, max_iters=30)
    _, module = tiny_fit(tiny_corpus, [sched], steps=14, logger=logger)
    counts = [c[0] for _, c in sched.history]
    assert counts == [19, 18, 17, 16, 16, 16, 16]
    assert [l.sinkhorn_iters for l in module.model.sublayers] == [16] * 4
    layer0 = logger.metrics["sinkhorn/iters/layer_00"]
    assert layer0[0] == (0, 20.0) and layer0[-1] == (12, 16.0)
    assert {f"sinkhorn/iters/layer_{i:02d}" for i in range(4)} <= set(logger.metrics)
    assert logger.metrics["sinkhorn/tol"][0][1] == pytest.approx(1e-2)


def test_counts_reach_sublayers_under_an_activation_checkpoint_wrapper(tiny_corpus):
    """Sublayers wrapped by `apply_activation_checkpointing` (what FSDPStrategy's activation_checkpointing_policy
    applies): the counts reach the sublayers themselves, not the wrappers, which keep attributes written through
    them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from mhc_lightning.model import HyperConnection, hyper_connections

    module = tiny_module("mhc")
    apply_activation_checkpointing(module.model, check_fn=lambda m: isinstance(m, HyperConnection))
    sched = SinkhornScheduler(every=2, min_iters=16, max_iters=30)
    tiny_fit(tiny_corpus, [sched], steps=8, module=module)
    assert [c[0] for _, c in sched.history] == [19, 18, 17, 16]
    assert [l.sinkhorn_iters for l in hyper_connections(module.model)] == [16] * 4


def test_tightened_tolerance_goes_up_within_bounds(tiny_corpus):
    """intensity 8: tol = 1e-10, below the eps-limited residual (~1e-6): counts rise, capped at max_iters."""
    sched = SinkhornScheduler(intensity=8, every=2, init_iters=6, min_iters=4, max_iters=12, per_layer=False)
    _, module = tiny_fit(tiny_corpus, [sched], steps=9)
    assert [c for _, c in sched.history] == [[9] * 4, [12] * 4, [12] * 4, [12] * 4, [12] * 4]
    assert sched.tol == pytest.approx(1e-10)
    assert {l.sinkhorn_iters for l in module.model.sublayers} == {12}


def test_detector_events_tighten_and_hold(tiny_corpus):
    det = InstabilityDetector()
    sched = SinkhornScheduler(every=4, min_iters=4, max_iters=40, hold_steps=8)
    _, module = tiny_fit(tiny_corpus, [NaNGradAt(5), det, sched], steps=21)
    history = dict(sched.history)
    assert history[0] == [19] * 4 and history[4] == [18] * 4  # converged: down
    assert history[8] == [27] * 4  # the NaN event at step 5 tightened (18 * 1.5)
    assert history[12] == [27] * 4  # held for hold_steps (8) after tightening ...
    assert history[16] == [26] * 4 and history[20] == [25] * 4  # ... then down again


def test_grad_variance_tightens():
    sched = SinkhornScheduler(grad_window=10, grad_log_std_max=0.5)
    sched.iters = [10, 10]
    sched.log_grads.extend([0.0, 3.0] * 5)  # grad norm jumping by e^3 every step
    assert sched._tighten_reason(_ModuleWithChannel()) == "std of log grad norm 1.5 > 0.5"
    assert sched.update(0, [0.0, 0.0], "std of log grad norm") == [15, 15]


class _ModuleWithChannel:
    pass


def test_no_sinkhorn_layers_is_a_noop(tiny_corpus):
    sched = SinkhornScheduler(every=2)
    with pytest.warns(UserWarning, match="no mHC"):
        tiny_fit(tiny_corpus, [sched], steps=3, module=tiny_module("hc"))
    assert sched.history.maxlen and not sched.history


@fast_first(
    "kwargs, match",
    [
        ({"min_iters": 10, "max_iters": 5}, r"SinkhornScheduler.max_iters must be an integer >= 10"),
        ({"init_iters": 100}, r"SinkhornScheduler.init_iters must be an integer >= 4 and <= 50 or null"),
        ({"up_factor": 1.0}, r"SinkhornScheduler.up_factor must be a number > 1"),
        ({"intensity": "high"}, r"SinkhornScheduler.intensity must be a number"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SinkhornScheduler(**kwargs)
