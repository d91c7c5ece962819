"""The package's public API: `mhc_lightning.__all__` resolves lazily, and docs/api.md's examples run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, make_text


@pytest.mark.slow
def test_every_public_name_resolves_and_import_stays_cheap():
    code = (
        "import sys, mhc_lightning as m\n"
        "print([x for x in ('torch', 'lightning', 'mlflow') if x in sys.modules])\n"
        "print([n for n in m.__all__ if getattr(m, n, None) is None], len(m.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    heavy_on_import, (missing, count) = out.stdout.splitlines()[0], out.stdout.splitlines()[1].rsplit(" ", 1)
    assert heavy_on_import == "[]"  # `import mhc_lightning` imports none of them
    assert missing == "[]" and int(count) >= 20  # every name in __all__ resolves


def test_unknown_attribute_is_an_attribute_error():
    import mhc_lightning

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        mhc_lightning.Nope  # noqa: B018


@pytest.mark.slow
def test_the_api_page_runs_as_written(tmp_path, _mlflow_template):
    """Every ```python block of docs/api.md, in order, in one fresh interpreter (the Trainer example, then the
    comparison of its run)."""
    import shutil

    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "api.md").read_text(), flags=re.S)
    assert len(blocks) == 3
    (tmp_path / "notes.txt").write_text(make_text(60_000, seed=3))
    shutil.copy(_mlflow_template, tmp_path / "mlflow.db")  # a migrated store: migrations cost seconds
    script = tmp_path / "api_example.py"
    script.write_text("\n".join(blocks))
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "| run" in out.stdout and "'h_res'" in out.stdout and "'train_loss'" in out.stdout
    assert out.stdout.rstrip().endswith("True")  # the exported model generates what the checkpoint does
