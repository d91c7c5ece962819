"""The `mhc` dispatcher: help without Lightning, and LightningCLI's optimizer keys refused in one line."""

from __future__ import annotations

import subprocess
import sys
from argparse import ArgumentError

import pytest
from helpers import CONF, fast_first

REFUSAL = (
    "is not an option of mhc: the optimizer is AdamW with weight-decay groups (none on norms, biases, HC "
    "coefficients) and a linear warmup then cosine schedule, set by model.optim.lr"
)


def test_help_and_the_tools_import_neither_torch_nor_lightning():
    """`mhc --help` answers before anything heavy is imported (Lightning alone costs seconds); the reports read the
    mode registry without torch."""
    code = (
        "import sys, contextlib, io\nfrom mhc_lightning.commands import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main(['--help'])\n"
        "import mhc_lightning.grids.cli, mhc_lightning.reports.cli, mhc_lightning.sweeps.cli\n"
        "import mhc_lightning.reports.runs\n"
        "print(sorted(m for m in ('torch', 'lightning', 'mlflow', 'optuna', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@fast_first(
    "flag, named",
    [
        ("--optimizer=Adam", "--optimizer"),
        ("--optimizer.lr=0.1", "--optimizer"),
        ("--lr_scheduler=StepLR", "--lr_scheduler"),
    ],
)
def test_optimizer_flags_are_refused_in_one_line(flag, named, capsys):
    from mhc_lightning.commands import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "-c", str(CONF / "presets" / "debug.yaml"), flag])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mhc fit: error: {named} {REFUSAL}")


def test_optimizer_key_in_a_config_file_is_refused(tmp_path, capsys):
    from mhc_lightning.commands import main

    cfg = tmp_path / "opt.yaml"
    cfg.write_text("optimizer:\n  class_path: torch.optim.SGD\n  init_args: {lr: 0.1}\n")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "-c", str(cfg)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.startswith(f"mhc fit: error: `optimizer:` in {cfg} {REFUSAL}")


def test_the_cli_keeps_the_decay_groups_and_the_schedule(tmp_path, monkeypatch):
    """Built from Python (sweeps do), the CLI has no --optimizer at all; the optimizer is LitLM's: two groups, the
    matrices decayed, and the warmup-cosine LambdaLR stepped per optimizer step."""
    import torch

    from mhc_lightning.fit.cli import build_cli
    from mhc_lightning.training.module import LitLM

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError, match="optimizer"):
        build_cli(
            ["-c", str(CONF / "presets" / "debug.yaml"), "--optimizer=Adam", "--trainer.logger=false"],
            run=False,
            exit_on_error=False,
        )
    cli = build_cli(
        [
            "-c",
            str(CONF / "presets" / "debug.yaml"),
            "--trainer.logger=false",
            "--model.arch.n_layers=1",
            "--model.arch.d_model=32",
            "--model.arch.n_heads=2",
        ],
        run=False,
        exit_on_error=False,
    )
    assert type(cli.model).configure_optimizers is LitLM.configure_optimizers
    assert "configure_optimizers" not in vars(cli.model)  # not replaced on the instance either
    cli.trainer.strategy.connect(cli.model)
    cli.model.trainer = cli.trainer
    monkeypatch.setattr(type(cli.trainer), "estimated_stepping_batches", property(lambda self: 100))
    conf = cli.model.configure_optimizers()
    groups = conf["optimizer"].param_groups
    assert [g["weight_decay"] for g in groups] == [cli.model.optim.weight_decay, 0.0]
    assert isinstance(conf["lr_scheduler"]["scheduler"], torch.optim.lr_scheduler.LambdaLR)
    assert conf["lr_scheduler"]["interval"] == "step"
