"""The experiment grid runner: expansion of variants x axes into `mhc fit` argument lists."""
import json
from pathlib import Path

import pytest

from helpers import CONF, REPO
from mhc_lightning.cli import build_cli
from mhc_lightning.grid import GridError, expand, load_grid


def test_stability_grid_expands_to_45_distinct_runs():
    spec = load_grid(CONF / "experiments" / "stability_grid.yaml")
    runs = expand(spec, REPO, [])
    assert len(runs) == 5 * 3 * 3
    names = [r[0] for r in runs]
    assert len(set(names)) == len(names)
    name, tags, argv = next(r for r in runs if r[0] == "hc_noclip-L24-s3")
    assert tags == {"grid": "stability", "variant": "hc_noclip", "model.arch.n_layers": "24", "seed_everything": "3"}
    assert "--trainer.gradient_clip_val=null" in argv and "--model.arch.n_layers=24" in argv


def test_grid_argv_is_what_the_cli_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_grid(CONF / "experiments" / "stability_grid.yaml")
    name, tags, argv = next(r for r in expand(spec, REPO, ["--trainer.accelerator=cpu", "--trainer.precision=32-true"])
                            if r[0] == "hc_noclip-L12-s2")
    cli = build_cli(argv[1:], run=False)  # without the subcommand, as run=False expects
    assert cli.model.arch.hyper.residual_mode == "hc" and cli.model.arch.n_layers == 12
    assert cli.trainer.gradient_clip_val is None
    assert cli.trainer.logger._run_name == name


def test_bad_grid_file_names_the_missing_key(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text(json.dumps({"experiment": "x", "configs": []}))
    with pytest.raises(GridError, match="variants"):
        load_grid(bad)
