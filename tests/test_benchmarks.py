"""The benchmark scripts still run: each one end to end on the CPU at its smoke size, in its own process, with
its JSON read back (the GPU numbers themselves live in docs/benchmarks.md, not in tests)."""
import json
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def _run(args, tmp_path, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_mhc_smoke_checks_and_times_every_wiring(tmp_path):
    out = _run(["bench/bench_mhc.py", "--smoke", "--shapes", "1", "--iters", "1", "--warmup", "0", "--skip", "recompute",
                "--no-kernels", "--variants", "ours,hc", "--profile-host", "--out", str(tmp_path)], tmp_path)
    data = json.loads((tmp_path / "bench_mhc.json").read_text())
    assert all(c["ok"] for c in data["checks"].values()), data["checks"]
    rows = {r["variant"]: r for r in data["stack"]}
    assert {"residual", "ours (fused)", "ours (per-sublayer ops)", "ours (per-sublayer, dx summed)",
            "hc (fused projection + stream ops)"} == rows.keys()
    for r in rows.values():
        assert r["ms"] > 0 and r["host_ms"] > 0
    assert rows["ours (fused)"]["host_profile"][0]["own_ms"] > 0  # cProfile rows, largest first
    assert "ms/step" in out


def test_bench_host_times_every_wiring(tmp_path):
    path = tmp_path / "host.json"
    _run(["bench/bench_host.py", "--sublayers", "4", "--steps", "3", "--out", str(path)], tmp_path)
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"chain (boundary op)", "one sublayer at a time (mhc_enter + stream_post_res)",
                         "HC (rms_proj + tail in torch + stream ops)"}
    assert all(r["per_sublayer_ms"] > 0 for r in rows.values())
