"""A training loss that stops being finite (callbacks/divergence.py): under every config the fit ends FAILED, tagged
mhc.diverged / mhc.diverged_step, with one line naming the step and what to try, and exit status 3; a NaN the
stability callbacks skipped does not end it."""

from __future__ import annotations

import re

import lightning as L
import pytest
from helpers import CONF, fast_first, one_thread, tiny_fit, tiny_fit_args
from mlflow import MlflowClient

from mhc_lightning.callbacks import InstabilityDetector
from mhc_lightning.callbacks.divergence import EXIT_DIVERGED, DivergenceGuard, TrainingDiverged
from mhc_lightning.fit.cli import main


class NaNLossAt(L.Callback):
    """Fault: the logits of the batch at optimizer step k are NaN, so its loss is."""

    def __init__(self, step: int):
        self.step, self._hook = step, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            self._hook = pl_module.model.register_forward_hook(lambda mod, args, out: out * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


@fast_first("preset", ["default", "stability"])
def test_a_diverging_fit_ends_failed_and_tagged_with_one_line(preset, tiny_corpus, mlflow_uri, tmp_path, capsys):
    """lr 1e6 makes the loss NaN within a few steps. Checked every 4th step (log_every_n_steps) and at validations
    (none before step 30 here): the default config ends at the first check after the NaN; under the stability preset,
    which skips those updates, after 3 checks that still see it."""
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", steps=30)
    args += ["--model.optim.lr=1e6", "--trainer.log_every_n_steps=4", "--trainer.val_check_interval=30"]
    if preset == "stability":
        args += ["-c", str(CONF / "presets" / "stability.yaml")]
    with one_thread(), pytest.raises(SystemExit) as ended:
        main(args)
    assert ended.value.code == EXIT_DIVERGED
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "diverged" in ln]
    assert line.startswith("mhc fit: error: training diverged at step ")
    assert "model.optim.lr (now 1e+06)" in line and "conf/presets/stability.yaml" in line
    assert "Traceback" not in err and "Downloading artifacts" not in err
    step = int(re.search(r"at step (\d+)", line).group(1))
    assert step == (3 if preset == "default" else 11)  # checks at global steps 4, 8, 12: the first, or the third
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.run_id in line
    assert run.info.status == "FAILED"
    assert run.data.tags["mhc.diverged"] == "true" and run.data.tags["mhc.diverged_step"] == str(step)


def test_a_skipped_nan_goes_on_and_an_applied_one_ends_the_fit(tiny_corpus):
    """The same NaN loss at step 6: skipped by the InstabilityDetector, the fit finishes; with nothing to skip it, the
    update is applied and the fit ends there (checked every step)."""
    trainer, _ = tiny_fit(
        tiny_corpus, [NaNLossAt(6), InstabilityDetector(), DivergenceGuard()], steps=10, log_every_n_steps=1
    )
    assert trainer.global_step == 10
    with pytest.raises(TrainingDiverged) as ended:
        tiny_fit(tiny_corpus, [NaNLossAt(6), DivergenceGuard()], steps=10, log_every_n_steps=1)
    assert ended.value.step == 6 and "the update of that step was applied" in str(ended.value)
