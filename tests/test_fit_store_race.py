"""Several `mhc fit` processes started together on a SQLite MLflow store that does not exist yet: the first client
to open a new store migrates it, and two migrations at once collide in alembic (crashes, a store left unusable)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_fit_args
from mlflow import MlflowClient

MHC = str(Path(sys.executable).with_name("mhc"))


@pytest.mark.slow
def test_fits_started_together_on_a_new_sqlite_store_all_finish(tiny_corpus, tmp_path):
    """Two `mhc fit` processes (enough for two migrations at once), same folder, same new `mlflow.db`, started at the
    same moment: both exit 0, each has its FINISHED run, and the store stays usable for the next client. No
    diagnostics: their figures cost seconds and have nothing to do with the store."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_ENABLE_ASYNC_LOGGING": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                MHC,
                *tiny_fit_args(tiny_corpus, uri, tmp_path / "runs", steps=2, run_name=f"fit{i}"),
                "--model.diagnostics_every=0",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    took = time.monotonic() - t0
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], "\n\n".join(o[-2500:] for o in outs)
    assert not any("Traceback" in o for o in outs), "\n\n".join(o[-2500:] for o in outs)

    client = MlflowClient(uri)
    (exp,) = [e for e in client.search_experiments() if e.name == "tests"]
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["fit0", "fit1"]
    assert {r.info.status for r in runs} == {"FINISHED"}
    client.create_run(exp.experiment_id)  # usable afterwards
    print(f"[figures] 2 fits at once on a new SQLite store: exit codes {codes}, {took:.1f} s")
