"""Checks of a sweep that need the `mhc fit` parser, run by the launcher before any trial: a key the parser does not
know (`trainer.max_stepz`, a misspelt `fixed` key) or a value of the wrong type would otherwise be found by each trial
in turn, each one failing until budget.max_failed stops the sweep. The parsing is shared with `mhc grid`
(fit/args_check.py)."""

from __future__ import annotations

from .spec import SpecError, SweepSpec
from .trial_args import trial_args


def probe_values(spec: SweepSpec) -> dict:
    """One value for every parameter of the space, `when` conditions ignored (so every key is checked): the first
    choice of a categorical, the low end of a range."""
    return {p.key: p.choices[0] if p.type == "categorical" else p.low for p in spec.space if p.key not in spec.skipped}


def check_trial_args(spec: SweepSpec) -> None:
    """Parse a trial's `mhc fit` arguments without building anything; raise SpecError with the parser's message. The
    model's cross-field rules are left out: they depend on the sampled combination, a trial's business."""
    from ..fit.args_check import fit_args_problems

    (problem,) = fit_args_problems([trial_args(spec, probe_values(spec))])
    if problem:
        raise SpecError(f"{spec.path}: `mhc fit` rejects the sweep's arguments (fixed, space or trial.args): {problem}")
