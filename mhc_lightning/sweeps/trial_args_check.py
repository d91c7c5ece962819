"""Checks of a sweep that need the `mhc fit` parser, run by the launcher before any trial: a key the parser does not
know (`trainer.max_stepz`, a misspelt `fixed` key) or a value of the wrong type would otherwise be found by each trial
in turn, each one failing until budget.max_failed stops the sweep."""
from __future__ import annotations

import contextlib
import io
import warnings

from .spec import SpecError, SweepSpec
from .trial_args import trial_args


def probe_values(spec: SweepSpec) -> dict:
    """One value for every parameter of the space, `when` conditions ignored (so every key is checked): the first
    choice of a categorical, the low end of a range."""
    return {p.key: p.choices[0] if p.type == "categorical" else p.low
            for p in spec.space if p.key not in spec.skipped}


def check_trial_args(spec: SweepSpec) -> None:
    """Parse a trial's `mhc fit` arguments without building anything; raise SpecError with the parser's message."""
    from lightning.pytorch.cli import LightningCLI

    from ..cli import MHCLightningCLI, build_cli

    class Parsed(Exception):
        pass

    class ParseOnly(MHCLightningCLI):
        def parse_arguments(self, parser, args) -> None:
            # the parser only: the model's cross-field rules depend on the sampled combination, a trial's business
            LightningCLI.parse_arguments(self, parser, args)

        def before_instantiate_classes(self) -> None:
            raise Parsed

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build_cli(trial_args(spec, probe_values(spec)), run=False, cli_class=ParseOnly)
    except Parsed:
        return
    except SystemExit:
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        detail = lines[-1] if lines else "rejected"
        raise SpecError(f"{spec.path}: `mhc fit` rejects the sweep's arguments (fixed, space or trial.args): "
                        f"{detail.removeprefix('error: ')}") from None
