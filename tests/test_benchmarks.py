"""The benchmark scripts still run: each one end to end on the CPU at its smoke size, in its own process, with
its JSON read back (the GPU numbers themselves live in docs/benchmarks.md, not in tests)."""
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.slow


def _run(args, tmp_path, timeout=600, env=None):
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_mhc_smoke_checks_and_times_every_wiring(tmp_path):
    out = _run(["bench/bench_mhc.py", "--smoke", "--shapes", "1", "--iters", "1", "--warmup", "0", "--skip", "recompute",
                "--no-kernels", "--variants", "ours,hc", "--profile-host", "--out", str(tmp_path)], tmp_path)
    data = json.loads((tmp_path / "bench_mhc.json").read_text())
    assert all(c["ok"] for c in data["checks"].values()), data["checks"]
    rows = {r["variant"]: r for r in data["stack"]}
    assert {"residual", "ours (fused)", "ours (per-sublayer ops)", "ours (per-sublayer, dx summed)",
            "hc (hc_enter + write-back)"} == rows.keys()
    for r in rows.values():
        assert r["ms"] > 0 and r["host_ms"] > 0
    assert rows["ours (fused)"]["host_profile"][0]["own_ms"] > 0  # cProfile rows, largest first
    assert "ms/step" in out


def test_bench_host_times_every_wiring(tmp_path):
    path = tmp_path / "host.json"
    _run(["bench/bench_host.py", "--sublayers", "4", "--steps", "3", "--out", str(path)], tmp_path)
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"chain (boundary op)", "one sublayer at a time (mhc_enter + stream_post_res)",
                         "HC (hc_enter + stream_post_res)",
                         "HC, hc_coef + stream_pre + stream_post_res (round 7's wiring; A/B)",
                         "HC, parameter operands built outside the step (bound for folding them into the op)"}
    assert all(r["per_sublayer_ms"] > 0 for r in rows.values())


def test_bench_ddp_repeats_alternate_runs_kernel_config_variants_and_profiles(tmp_path):
    """--repeat: each variant runs that many times and the table takes the run with the median mean step (the lower
    middle one of two); --kernel-config adds MODE@NAME, whose runs (and only those) see MHC_KERNEL_CONFIG; an override
    in bench_ddp's own environment reaches every run and the JSON; --profile adds a profiled run per variant."""
    override, split = '{"coef_fwd": {"BC": 16}}', '{"coef_fwd": {"phi_split": true}}'
    _run(["bench/bench_ddp.py", "--smoke", "--gpus", "1", "--no-check", "--repeat", "2", "--modes", "residual",
          "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")], tmp_path,
         env=dict(os.environ, MHC_KERNEL_CONFIG=override))
    data = json.loads((tmp_path / "out" / "bench_ddp.json").read_text())
    head = data["bench"]["residual-1"]
    means = [r["step_ms_mean"] for r in head["repeats"]]
    assert len(means) == 2 and head["step_ms_mean"] == min(means)
    assert data["summary"]["x_residual"]["residual"]["1"] == 1.0
    assert data["environment"]["mhc_kernel_config"] == override == head["kernel_config"]
    assert {p.name for p in (tmp_path / "work").glob("residual-1-r*.log")} == {"residual-1-r0.log", "residual-1-r1.log"}

    _run(["bench/bench_ddp.py", "--smoke", "--gpus", "1", "--no-check", "--modes", "residual,mhc",
          "--kernel-config", f"split={split}", "--profile", "2", "--out", str(tmp_path / "ab"),
          "--work", str(tmp_path / "ab_work")], tmp_path)
    data = json.loads((tmp_path / "ab" / "bench_ddp.json").read_text())
    assert set(data["bench"]) == {"residual-1", "mhc-1", "mhc@split-1"}
    assert data["bench"]["mhc@split-1"]["kernel_config"] == split
    assert data["bench"]["mhc-1"]["kernel_config"] is None and data["bench"]["residual-1"]["kernel_config"] is None
    assert data["bench"]["mhc@split-1"]["mode"] == "mhc"
    assert set(data["summary"]["x_residual"]) == {"residual", "mhc", "mhc@split"}
    # --profile: one more run per variant, its ops' own time per step (host time on this CPU) beside the wall time
    assert set(data["profile"]) == {"residual", "mhc", "mhc@split"}
    for rec in data["profile"].values():
        assert rec["steps"] == 2 and rec["device_time"] is False and rec["top"]
        assert 0 < rec["busy_us_per_step"] and 0 < rec["wall_us_per_step"]
        assert rec["top"][0]["us_per_step"] >= rec["top"][-1]["us_per_step"]
