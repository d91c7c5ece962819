"""Fixtures shared across the test suite."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before triton is first
# imported; under xdist any test module (torch.compile, Lightning) may import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import make_text, write_documents  # noqa: E402

os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")

# Under `pytest -n N` the N workers share the machine's cores: one torch thread each (and in the processes they start),
# instead of N x cores threads fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture
def tiny_corpus(tmp_path: Path) -> Path:
    """A generated text file large enough for a few tiny batches and validation windows."""
    p = tmp_path / "tiny_corpus.txt"
    p.write_text(make_text(60_000, seed=7))
    return p


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """One migrated SQLite store per session: creating one runs all of alembic's migrations, which is slow."""
    import mlflow

    path = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path: Path, _mlflow_template: Path, monkeypatch) -> str:
    """A fresh MLflow SQLite store for this test; artifacts land under tmp_path."""
    db = tmp_path / "mlflow.db"
    shutil.copy(_mlflow_template, db)
    monkeypatch.chdir(tmp_path)  # sqlite stores without a server put artifacts under ./mlruns
    return f"sqlite:///{db}"


@pytest.fixture(scope="session")
def prepared_shards(tmp_path_factory) -> tuple[Path, list[str]]:
    """Token shards of write_documents(n=90) (bytes tokenizer, val fraction 0.2) and the documents: prepared once per
    test run for all xdist workers, since a preparation starts litdata's worker processes (seconds). Read-only: copy
    the folder before changing it."""
    from filelock import FileLock

    from mhc_lightning.commands import main
    from mhc_lightning.data.shards import META

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "prepared_shards"  # this run's
    docs = write_documents(tmp_path_factory.mktemp("documents"), n=90)
    with FileLock(f"{root}.lock"):
        if not (root / "out" / META).is_file():
            write_documents(root / "src", n=90)
            with pytest.raises(SystemExit) as done:
                main(["prepare", str(root / "src"), "--out", str(root / "out"), "--val-fraction=0.2", "--workers=1"])
            assert done.value.code == 0
    return root / "out", docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A generated text file shared by a module's tests (those that start servers and processes)."""
    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    p.write_text(make_text(60_000, seed=7))
    return p
