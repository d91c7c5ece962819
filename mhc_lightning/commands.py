"""`mhc`: the command dispatcher (the console script). Cheap to import: no torch, no Lightning, no MLflow.

`mhc --help` and an unknown command answer from here at once; a tool (`sweep`, `compare`, `report`, `grid`) imports
only its own module; `fit`, `validate` and `test` import Lightning through fit/cli.py, and only when they run, after the
checks that need no Lightning (fit/early_checks.py: flags, config files, corpus, checkpoint).

Whatever the command, a problem the user can fix (a UserError, a parser error, a broken YAML file) is printed as one
line, `mhc <command>: error: ...`, with exit status 2 and no traceback.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple, Optional

from .errors import EXIT_USER_ERROR, UserError, one_line
from .fit.child_processes import die_with_parent
from .fit.early_checks import check_arguments
from .loggers.credentials import clean_tracking_env, mask

# The Trainer entry points `mhc` offers. `predict` is left out: the byte LM has no prediction data or
# writer, so Lightning's `predict` could only fail.
TRAINER_COMMANDS = {
    "fit": "train a model: one MLflow run with metrics, diagnostics, config and checkpoints",
    "validate": "evaluate a checkpoint (--ckpt_path) on the validation split, as a run named <run>-validate",
    "test": "evaluate a checkpoint (--ckpt_path) on the held-out split, as a run named <run>-test",
}


TRAINER_TARGET = "mhc_lightning.fit.cli:run_trainer_command"  # (command, args, argv) of fit / validate / test


class Tool(NamedTuple):
    target: str  # module:function taking the argument list
    summary: str


TOOLS = {  # subcommands with their own argparse front ends; everything else is LightningCLI
    "sweep": Tool("mhc_lightning.sweeps.cli:main", "Optuna sweeps of `mhc fit`, tracked in MLflow"),
    "compare": Tool("mhc_lightning.reports.cli:main", "table and plots of MLflow runs"),
    "report": Tool(
        "mhc_lightning.reports.cli:report_main",
        "runs grouped by tags, mean +- std over seeds (= mhc compare --group-by)",
    ),
    "prepare": Tool(
        "mhc_lightning.data.prepare:main", "tokenize text / JSON Lines / parquet into token shards for `mhc fit`"
    ),
    "grid": Tool("mhc_lightning.grids.cli:main", "a grid of `mhc fit` runs: parallel processes here, or SLURM jobs"),
    "export": Tool("mhc_lightning.fit.pretrained:main", "a checkpoint's model as model.safetensors + config.json"),
}


def overview() -> str:
    """`mhc --help`: every command with one line."""
    width = max(map(len, [*TRAINER_COMMANDS, *TOOLS])) + 2
    lines = [
        "usage: mhc <command> [options]     (`mhc <command> --help` lists a command's options)",
        "",
        "Train, stress and compare residual / HC / mHC transformers, tracked in MLflow.",
        "",
        "training (Lightning; -c config.yaml files from conf/ and --key=value flags, later ones win):",
    ]
    lines += [f"  {name:<{width}}{text}" for name, text in TRAINER_COMMANDS.items()]
    lines += ["", "tools:"]
    lines += [f"  {name:<{width}}{tool.summary}" for name, tool in TOOLS.items()]
    lines += ["", "start with:  mhc fit -c conf/quickstart.yaml"]
    return "\n".join(lines)


def fail(command: str, message: str) -> None:
    """The one line of a problem the user can fix, exit status 2; a password in any URL it quotes is masked."""
    print(f"mhc {command}: error: {mask(one_line(message))}", file=sys.stderr)
    sys.exit(EXIT_USER_ERROR)


def main(argv: Optional[list[str]] = None) -> None:
    die_with_parent()  # started by `mhc grid` / `mhc sweep` / DDP rank 0: do not outlive it
    clean_tracking_env()  # a password in MLFLOW_TRACKING_URI: into MLflow's credential variables, out of configs
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(overview())
        sys.exit(0)
    command = args[0]
    if command not in TRAINER_COMMANDS and command not in TOOLS:
        print(
            f"mhc: error: unknown command {command!r}; the commands are {', '.join([*TRAINER_COMMANDS, *TOOLS])} "
            "(`mhc --help` says what each does)",
            file=sys.stderr,
        )
        sys.exit(EXIT_USER_ERROR)
    if command in TOOLS:
        module, _, func = TOOLS[command].target.partition(":")
        try:
            sys.exit(getattr(importlib.import_module(module), func)(args[1:]))
        except UserError as err:
            fail(command, str(err))
    try:  # a typo, a missing file: answered before torch and Lightning are imported
        check_arguments(command, args[1:])
    except UserError as err:
        fail(command, str(err))
    # by name, as the tools: fit/cli.py imports this module (for TOOLS and main), never the other way round
    module, _, func = TRAINER_TARGET.partition(":")
    # argv=None lets LightningCLI read sys.argv itself
    getattr(importlib.import_module(module), func)(command, args, None if argv is None else args)


if __name__ == "__main__":
    main()
