"""`mhc fit` arguments checked by `mhc fit`'s own parser without building anything, before a tool starts the runs:
`mhc sweep` checks one trial's arguments (sweeps/trial_args_check.py), `mhc grid` every run of the grid. A key the
parser does not know (`--set trainer.max_stepz=3`) or a value of the wrong type would otherwise be found by each run in
turn, every child process exiting 2 with the reason only in its log.

One parser serves every argument list (building it takes about a second, parsing a list a fraction of that).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from argparse import ArgumentError
from collections.abc import Sequence
from typing import Optional


class _Done(Exception):
    pass


def fit_args_problems(argvs: Sequence[Sequence[str]], cross_field: bool = False) -> list[Optional[str]]:
    """For each argument list (`mhc fit` arguments without `fit`): None when the parser accepts it, else its reason in
    one line. cross_field: also the model's cross-field rules (d_model % n_heads, ...), which hold for a complete run's
    arguments but not for a sweep's probe values."""
    from lightning.pytorch.cli import LightningCLI

    from ..training.module import check_fused
    from .cli import MHCLightningCLI, build_cli, parser_message, validate_model_config

    problems: list[Optional[str]] = []

    def problem(cli, parser, argv) -> Optional[str]:
        try:
            LightningCLI.parse_arguments(cli, parser, list(argv))
            if cross_field:
                validate_model_config(cli.config.model)
                check_fused(cli.config.model.optim.fused, cli.config.trainer.precision)
        except ArgumentError as err:
            return parser_message(err)
        except (ValueError, TypeError) as err:
            return f"invalid model configuration: {err}"
        return None

    class ParseEach(MHCLightningCLI):
        def parse_arguments(self, parser, args) -> None:
            problems.extend(problem(self, parser, argv) for argv in argvs)
            raise _Done

    with (
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        try:
            build_cli([], run=False, exit_on_error=False, cli_class=ParseEach)
        except _Done:
            pass
    return problems
