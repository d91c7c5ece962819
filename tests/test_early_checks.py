"""`mhc fit|validate|test` inputs answered before torch and Lightning are imported (early_checks.py): a typo costs
a fraction of a second, not the seconds to a minute their imports take."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from helpers import CONF, fast_first

from mhc_lightning.fit.early_checks import parser_keys

BAD_INPUTS = {  # mhc arguments: what the one line says
    "flag": (
        ["fit", "-c", "{quickstart}", "--trainer.max_stepz=3"],
        "unrecognized arguments: --trainer.max_stepz=3 (did you mean --trainer.max_steps?) (options: `mhc fit --help`)",
    ),
    "config_file": (
        ["fit", "-c", "{conf}/quickstar.yaml"],
        "config file {conf}/quickstar.yaml does not exist (did "
        "you mean {conf}/quickstart.yaml?); pass -c with the path of a YAML file (see conf/).",
    ),
    "yaml": (["fit", "-c", "broken.yaml"], "config file broken.yaml, line 3, column 1: not valid YAML"),
    "config_key": (
        ["fit", "-c", "typo.yaml"],
        "config file typo.yaml: unknown key model.arch.hyper.n_stream (did you mean model.arch.hyper.n_streams?)",
    ),
    "corpus": (["fit", "--data.corpus", "nowhere/"], "corpus path nowhere does not exist"),
    "binary": (["fit", "--data.corpus=noise.txt"], "corpus file noise.txt does not look like text"),
    "fifo": (["fit", "--data.corpus=pipe"], "corpus path pipe is neither a file nor a folder (a pipe, socket or"),
    "checkpoint": (
        ["fit", "-c", "{quickstart}", "--ckpt_path", "runs/1/last.ckpt"],
        "checkpoint runs/1/last.ckpt does not exist",
    ),
    "no_checkpoint": (["validate", "-c", "{quickstart}"], "validate evaluates a checkpoint: pass --ckpt_path"),
    "best": (["fit", "-c", "{quickstart}", "--ckpt_path", "best"], "--ckpt_path best: Lightning's best checkpoint"),
    "hpc": (
        ["validate", "-c", "{quickstart}", "--ckpt_path=hpc"],
        "--ckpt_path hpc: no hpc_ckpt_<n>.ckpt (Lightning's SLURM requeue checkpoint) in trainer.default_root_dir runs",
    ),
}

CHILD = """
import contextlib, io, json, sys
from mhc_lightning.commands import main
said = {}
for name, args in json.loads(sys.argv[1]).items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit) as done:
        main(args)
    said[name] = err.getvalue()
print(json.dumps({"said": said, "heavy": sorted(m for m in ("torch", "lightning", "mlflow") if m in sys.modules)}))
"""


def test_cheap_inputs_are_answered_before_torch_and_lightning_are_imported(tmp_path):
    """Every case in one fresh interpreter: one line each, exit 2, nothing written, and torch, Lightning and MLflow
    never imported."""
    (tmp_path / "broken.yaml").write_text("trainer:\n  max_steps: [3\n")
    (tmp_path / "typo.yaml").write_text("model:\n  arch:\n    hyper:\n      n_stream: 2\n")
    (tmp_path / "noise.txt").write_bytes(bytes(range(256)) * 64)
    os.mkfifo(tmp_path / "pipe")
    fill = {"quickstart": str(CONF / "quickstart.yaml"), "conf": str(CONF)}
    cases = {name: [a.format(**fill) for a in args] for name, (args, _) in BAD_INPUTS.items()}
    before = sorted(p.name for p in tmp_path.iterdir())
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    for name, (args, says) in BAD_INPUTS.items():
        line = result["said"][name]
        assert line.count("\n") == 1 and line.startswith(f"mhc {args[0]}: error: {says.format(**fill)}"), (name, line)
    assert result["heavy"] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no store, no runs/


def _real_options(subcommand: str) -> set[str]:
    """The option keys of the parser `mhc <subcommand>` builds (Lightning's and ours), links aside."""
    from mhc_lightning.fit.cli import MHCLightningCLI, build_cli

    found = {}

    class Keep(MHCLightningCLI):
        def parse_arguments(self, parser, args) -> None:
            found["parser"] = parser._subcommands_action._name_parser_map[subcommand]
            raise KeyboardInterrupt  # built: nothing to parse

    with warnings.catch_warnings(), pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("ignore")
        build_cli([subcommand], cli_class=Keep, exit_on_error=False)
    return {
        opt[2:].rstrip("+")
        for action in found["parser"]._actions
        for opt in action.option_strings
        if opt.startswith("--") and not opt.endswith(".help")
    }


@fast_first("subcommand", ["fit", "validate"])
def test_the_keys_read_from_source_are_the_parsers(subcommand):
    """Never stricter than the parser (every option it has passes), and no key it lacks passes outside a Trainer
    argument, where loggers and callbacks take keys of their own."""
    keys, real = parser_keys(subcommand), _real_options(subcommand)
    assert [o for o in sorted(real) if not keys.known(o, abbreviated=False)] == []
    links = {"model.arch.vocab_size", "model.arch.context"}  # set through data.*: the parser refuses them
    assert sorted(keys.full - keys.open - real - links) == []
    assert keys.known("trainer.logger.init_args.tracking_uri", abbreviated=False)
    assert keys.known("model.arch.hyper.residual_mod", abbreviated=True)  # argparse's abbreviation
    assert not keys.known("model.arch.hyper.residual_mod", abbreviated=False)  # not in a config file
