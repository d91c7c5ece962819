"""The benchmark scripts still run: each one end to end on the CPU at its smoke size, in its own process, with
its JSON read back (the GPU numbers themselves live in docs/benchmarks.md, not in tests)."""
import argparse
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


@pytest.mark.parametrize("argv,message", [
    (["--sweep-only", "coef_bwd_x"], "--sweep-only needs --sweep and no --quick"),
    (["--sweep", "--sweep-only", "coef_bwd_x,nope"], "--sweep-only: nope not in the sweep table; allowed: coef_bwd_x,"),
])
def test_bench_mhc_refuses_a_sweep_it_cannot_run_before_any_work(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, "bench/bench_mhc.py", "--smoke", *argv, "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_bench_mhc_smoke_checks_and_times_every_wiring(tmp_path):
    out = _run(["bench/bench_mhc.py", "--smoke", "--shapes", "1", "--iters", "1", "--warmup", "0", "--skip", "recompute",
                "--no-kernels", "--variants", "ours,hc", "--profile-host", "ours (fused)", "--out", str(tmp_path)], tmp_path)
    data = json.loads((tmp_path / "bench_mhc.json").read_text())
    assert all(c["ok"] for c in data["checks"].values()), data["checks"]
    rows = {r["variant"]: r for r in data["stack"]}
    assert {"residual", "ours (fused)", "ours (per-sublayer ops)", "ours (per-sublayer, dx summed)", "ours (u rebuilt)",
            "hc (hc_enter + write-back)"} == rows.keys()
    for r in rows.values():
        assert r["ms"] > 0 and r["host_ms"] > 0
    assert rows["ours (fused)"]["host_profile"][0]["own_ms"] > 0  # cProfile rows, largest first
    assert all("host_profile" not in r for v, r in rows.items() if v != "ours (fused)")  # only the variant named
    assert "ms/step" in out


def test_bench_host_times_every_wiring(tmp_path):
    path = tmp_path / "host.json"
    _run(["bench/bench_host.py", "--sublayers", "4", "--steps", "3", "--out", str(path)], tmp_path)
    rows = json.loads(path.read_text())["rows"]
    assert set(rows) == {"chain (boundary op)", "one sublayer at a time (mhc_enter + stream_post_res)",
                         "one sublayer at a time, by Function.apply (c_apply false; A/B)",
                         "HC (hc_enter + stream_post_res)",
                         "HC, operands by torch ops outside the op (hc_operands fold false; A/B)",
                         "HC, hc_coef + stream_pre + stream_post_res (round 7's wiring; A/B)",
                         "HC, parameter operands built outside the step (bound for folding them into the op)"}
    assert all(r["per_sublayer_ms"] > 0 for r in rows.values())
    # every kernel the ops launch is stubbed, the parameter passes too (they ran under the interpreter before round 11)
    stubbed = json.loads(path.read_text())["info"]["stubbed_kernels"]
    assert {"_coef_fwd", "_coef_bwd_x", "_post_bwd_2d", "_phi_pairs", "_param_grad_sum", "_hc_operands",
            "_hc_operand_grads"} <= set(stubbed)
    # the forward alone: the same rows, together cheaper than forward + backward (the two runs are separate processes
    # on a shared machine: a single row's order can flip, the sum over seven wirings, each backward ~2x its forward, not)
    fwd_path = tmp_path / "host_forward.json"
    _run(["bench/bench_host.py", "--sublayers", "4", "--steps", "5", "--forward", "--out", str(fwd_path)], tmp_path)
    fwd = json.loads(fwd_path.read_text())
    assert fwd["info"]["forward_only"] is True and set(fwd["rows"]) == set(rows)
    assert all(r["per_sublayer_ms"] > 0 for r in fwd["rows"].values())
    assert sum(r["per_sublayer_ms"] for r in fwd["rows"].values()) < sum(r["per_sublayer_ms"] for r in rows.values())
    # --dispatch: each op of mHC's sublayer as the compiled graph calls it (its custom op) and as eager does (its body),
    # forward and backward, the routed enter op too
    disp_path = tmp_path / "host_dispatch.json"
    _run(["bench/bench_host.py", "--sublayers", "2", "--steps", "2", "--dispatch", "--out", str(disp_path)], tmp_path)
    disp = json.loads(disp_path.read_text())["dispatch"]
    assert set(disp) == {"mhc_pre_fwd", "mhc_enter_fwd", "mhc_pre_bwd", "post_fwd", "post_bwd"}
    assert all(r["custom_op_us"] > 0 and r["body_us"] > 0 for r in disp.values())


def test_bench_host_model_times_both_forwards_and_names_mhcs_functions(tmp_path):
    """--model: the whole GPT's forward per mode, and mHC's extra host time by function: the fused ops' Python is
    among them (a profile of the residual alone, or of nothing, would list none of it)."""
    path = tmp_path / "model.json"
    _run(["bench/bench_host.py", "--model", "--steps", "2", "--top", "40", "--out", str(path)], tmp_path)
    data = json.loads(path.read_text())
    assert set(data["rows"]) == {"residual", "mhc"} and all(r["forward_ms"] > 0 for r in data["rows"].values())
    top = {r["function"]: r for r in data["own_ms_top"]}
    assert "ops.py:_fwd" in top and top["ops.py:_fwd"]["mhc"] > 0 == top["ops.py:_fwd"]["residual"]
    # --compile: both compiled; mHC's fused ops then run as custom ops, whose wrappers are among mHC's extra functions;
    # --chain: mHC's sublayers chained under compile too, through the boundary op
    for chain in ([], ["--chain"]):
        path = tmp_path / f"model_compiled{len(chain)}.json"
        _run(["bench/bench_host.py", "--model", "--compile", *chain, "--sublayers", "2", "--steps", "2", "--top", "80",
              "--out", str(path)], tmp_path)
        data = json.loads(path.read_text())
        assert data["compiled"] is True and data["chained"] is bool(chain) and data["shape"]["blocks"] == 1
        assert all(r["first_call_s"] > 0 for r in data["rows"].values())
        top = {r["function"]: r for r in data["own_ms_top"]}
        assert "ops.py:_fwd" in top and any(name.startswith("custom_ops.py:") for name in top)  # torch.library's
        assert ("ops.py:_bnd_fwd_body" in top) is bool(chain)


def test_bench_host_real_needs_a_gpu(tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present: --real would run")
    proc = subprocess.run([sys.executable, "bench/bench_host.py", "--real"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1] == "--real needs a CUDA device"


def test_bench_ddp_repeats_alternate_runs_kernel_config_variants_and_profiles(tmp_path):
    """--repeat: each variant runs that many times and the table takes the run with the median mean step (the lower
    middle one of two); --profile adds one profiled run per variant, not per repeat; --kernel-config adds MODE@NAME,
    whose runs (and only those) see MHC_KERNEL_CONFIG; an override in bench_ddp's own environment reaches every run
    and the JSON. (Five `mhc fit` processes in all: each costs CI its start-up.)"""
    override, split = '{"coef_fwd": {"BC": 16}}', '{"coef_fwd": {"BK": 64}}'
    _run(["bench/bench_ddp.py", "--smoke", "--gpus", "1", "--no-check", "--repeat", "2", "--modes", "residual",
          "--profile", "2", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")], tmp_path,
         env=dict(os.environ, MHC_KERNEL_CONFIG=override))
    data = json.loads((tmp_path / "out" / "bench_ddp.json").read_text())
    head = data["bench"]["residual-1"]
    means = [r["step_ms_mean"] for r in head["repeats"]]
    assert len(means) == 2 and head["step_ms_mean"] == min(means)
    assert data["summary"]["x_residual"]["residual"]["1"] == 1.0
    # host time per phase of the step (device time only on CUDA)
    assert set(head["phases"]) == {"forward", "backward", "optimizer", "between_steps"}
    assert all(p["host_ms"] > 0 and p["device_ms"] is None for p in head["phases"].values())
    # the main thread's CPU time per phase (at most its wall time, give or take the clocks' resolution), its
    # preemptions (counted on Linux) and no launcher misses (no fused kernels in the residual)
    assert all(0 < p["host_cpu_ms"] <= p["host_ms"] + 1.0 for p in head["phases"].values())
    assert head["preempted_per_step"] >= 0 and head["launcher_misses"] == 0
    assert all(set(r["phases"]) == set(head["phases"]) for r in head["repeats"])  # every run's, not only the headline's
    # and every run's steps one by one: step times, phases per step, garbage collections (count, ms, per step)
    for r in head["repeats"]:
        steps = len(r["step_ms"])  # a step's phases end at the next step's start: one fewer of them
        assert steps > 1 and all(len(r["phase_steps"][k]["host_ms"]) == steps - 1 for k in head["phases"])
        assert len(r["gc"]["ms_per_step"]) == steps and r["gc"]["longest_ms"] >= 0
        assert sum(r["gc"]["ms"].values()) == pytest.approx(sum(r["gc"]["ms_per_step"]))
    assert "step_ms" not in head and "gc" not in head  # kept once, with their run
    assert data["environment"]["mhc_kernel_config"] == override == head["kernel_config"]
    assert {p.name for p in (tmp_path / "work").glob("residual-1-r*.log")} == {"residual-1-r0.log", "residual-1-r1.log"}
    # --profile: one more run, its ops' own time per step (host time on this CPU) beside the wall time
    assert set(data["profile"]) == {"residual"}
    rec = data["profile"]["residual"]
    assert rec["steps"] == 2 and rec["device_time"] is False and rec["top"]
    assert 0 < rec["busy_us_per_step"] and 0 < rec["wall_us_per_step"]
    assert rec["top"][0]["us_per_step"] >= rec["top"][-1]["us_per_step"]

    # the variant alone (named in --modes, without plain mhc): two runs, not three
    _run(["bench/bench_ddp.py", "--smoke", "--gpus", "1", "--no-check", "--modes", "residual,mhc@split",
          "--kernel-config", f"split={split}", "--out", str(tmp_path / "ab"), "--work", str(tmp_path / "ab_work")],
         tmp_path)
    data = json.loads((tmp_path / "ab" / "bench_ddp.json").read_text())
    assert set(data["bench"]) == {"residual-1", "mhc@split-1"}
    assert data["bench"]["mhc@split-1"]["kernel_config"] == split
    assert data["bench"]["residual-1"]["kernel_config"] is None
    assert data["bench"]["mhc@split-1"]["mode"] == "mhc"
    assert set(data["summary"]["x_residual"]) == set(data["summary"]["x_residual_median"]) == {"residual", "mhc@split"}
    by_median = data["bench"]["mhc@split-1"]["step_ms_median"] / data["bench"]["residual-1"]["step_ms_median"]
    assert data["summary"]["x_residual_median"]["mhc@split"]["1"] == pytest.approx(by_median)
    assert {p.name for p in (tmp_path / "ab_work").glob("*.log")} == {"residual-1.log", "mhc@split-1.log"}


def test_bench_ddp_refuses_a_variant_without_its_kernel_config(tmp_path):
    """MODE@NAME in --modes whose NAME no --kernel-config defines would run the default config under the variant's
    name (round 12: `--modes mhc@old` beside `--kernel-config old=...` also ran mhc@old@old): one line, nothing run."""
    proc = subprocess.run([sys.executable, "bench/bench_ddp.py", "--smoke", "--gpus", "1", "--no-check",
                           "--modes", "residual,mhc@nope", "--kernel-config", 'old={"coef_fwd": {"BC": 16}}',
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert ("--modes mhc@nope: 'nope' is no --kernel-config or --variant-args NAME; allowed: old"
            in proc.stderr.strip().splitlines()[-1])


def test_bench_ddp_variant_args_reach_only_their_variant(tmp_path, monkeypatch):
    """--variant-args NAME=ARGS adds MODE@NAME like a --kernel-config (the two may share a NAME), and its `mhc fit`
    arguments come last, after --fit-args, in that variant's runs only (a model option A/B in one call)."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    from bench_ddp import bench_fit_args, with_config_variants
    args = argparse.Namespace(smoke=True, d_model=64, layers=2, heads=2, seq=64, batch=4, diagnostics_every=0,
                              fit_args="--trainer.max_steps=3",
                              variant_args={"chain": "--model.arch.hyper.chain_sublayers=true"})
    chained = bench_fit_args(args, tmp_path, tmp_path / "corpus.txt", "mhc@chain", 1, 5, "--trainer.callbacks=[]")
    plain = bench_fit_args(args, tmp_path, tmp_path / "corpus.txt", "mhc", 1, 5, "--trainer.callbacks=[]")
    assert chained == plain + ["--model.arch.hyper.chain_sublayers=true"]
    assert plain[-1] == "--trainer.max_steps=3" and str(tmp_path) in " ".join(plain)
    assert "model/mhc.yaml" in " ".join(chained)
    assert with_config_variants(["residual", "mhc"], {"chain": None, "split": None}) == [
        "residual", "mhc", "mhc@chain", "mhc@split"]
    proc = subprocess.run([sys.executable, "bench/bench_ddp.py", "--smoke", "--gpus", "1", "--variant-args", "a-b=--x",
                           "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert "--variant-args: expected NAME=ARGS" in proc.stderr.strip().splitlines()[-1]


def test_bench_ddp_kernel_config_variants_default_to_every_mode_or_to_those_named():
    """A --kernel-config adds MODE@NAME for every mode but residual, unless --modes names a variant of it: then only
    those run (round 14 ran HC's default launch a second time as hc@r13, for a config of mHC's kernels only)."""
    sys.path.insert(0, str(REPO / "bench"))
    from bench_ddp import with_config_variants

    configs = {"r13": "{}", "cap": "{}"}
    assert with_config_variants(["residual", "mhc", "hc"], configs) == [
        "residual", "mhc", "hc", "mhc@r13", "hc@r13", "mhc@cap", "hc@cap"]
    assert with_config_variants(["residual", "mhc", "hc", "mhc@r13"], configs) == [
        "residual", "mhc", "hc", "mhc@r13", "mhc@cap", "hc@cap"]
    assert with_config_variants(["residual"], configs) == ["residual"]


PROFILED_AB = REPO / "docs" / "benchmarks" / "2026-12-01-h200-bench_ddp-round14-profiled-ab.json"


def test_trainer_traffic_tabulates_a_profiled_trainer_run_against_its_bytes(tmp_path):
    """bench/trainer_traffic.py on round 14's committed H200 profile: each fused kernel's bytes at the run's shape, its
    floor at the given copy bandwidth, its measured time per call and share of copy; variants without the kernels
    (residual) are left out."""
    out = tmp_path / "traffic.json"
    proc = subprocess.run([sys.executable, "bench/trainer_traffic.py", str(PROFILED_AB), "--copy-tbps", "4.17",
                           "--u-bytes", "2", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())["variants"]
    assert set(data) == {"mhc", "mhc@tok0", "mhc@r13"}
    rows = {r["kernel"]: r for r in data["mhc@tok0"]["rows"]}
    assert set(rows) == {"_post_fwd", "_coef_fwd", "_pre_fwd", "_post_bwd_2d", "_coef_bwd_tok", "_coef_bwd_x"}
    # x [4C] and f [C] read, x_next [4C] written (bf16), h_post and H^res (fp32): 18512 bytes per token
    assert rows["_post_fwd"]["mb_per_call"] == 18512 * 16384 / 1e6
    assert abs(rows["_post_fwd"]["floor_us"] - 18512 * 16384 / 4.17e6) < 1e-9
    assert abs(rows["_post_fwd"]["us"] - 1818.3 / 24) < 0.1 and 95 < rows["_post_fwd"]["pct_copy"] < 97
    assert all(r["calls_per_step"] == 24 for r in rows.values())  # one call per sublayer, 24 sublayers
    total = data["mhc@tok0"]
    assert abs(total["floor_ms_per_step"] - sum(r["floor_ms_per_step"] for r in rows.values())) < 1e-12
    assert 9.8 < total["floor_ms_per_step"] < 9.9 and 12.9 < total["ms_per_step"] < 13.1
    assert "mhc@tok0: 16384 tokens, C = 1024, n = 4" in proc.stdout


U_AB = REPO / "docs" / "benchmarks" / "2026-12-04-h200-bench_ddp-round28-call2-u-ab-tok-bc128.json"


def test_trainer_traffic_takes_each_runs_u_width(tmp_path):
    """Round 28's A/B: the default run hands the branch u in fp32 (wide u written, wide du read and its bf16 copy
    written), the `cast` variant (kernel config "u" branch_dtype false) u in bf16; --u-bytes overrides every run."""
    def rows(*extra):
        out = tmp_path / "traffic.json"
        proc = subprocess.run([sys.executable, "bench/trainer_traffic.py", str(U_AB), "--copy-tbps", "4.17", "--out",
                               str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        variants = json.loads(out.read_text())["variants"]
        return {v: ({r["kernel"]: r["mb_per_call"] for r in d["rows"]}, d["u_bytes"]) for v, d in variants.items()}

    tokens, c = 16384, 1024
    got = rows()
    assert got["mhc"][1] == got["mhc@bc128"][1] == 4 and got["mhc@cast"][1] == 2
    wide, cast = got["mhc"][0], got["mhc@cast"][0]
    assert abs(wide["_pre_fwd"] - cast["_pre_fwd"] - 2 * c * tokens / 1e6) < 1e-9  # u: 2 more bytes per element
    assert abs(wide["_coef_bwd_tok"] - cast["_coef_bwd_tok"] - 4 * c * tokens / 1e6) < 1e-9  # du wide + its copy
    assert wide["_coef_bwd_x"] == cast["_coef_bwd_x"]  # the x pass reads the bf16 copy
    assert {v: b for v, (_, b) in rows("--u-bytes", "2").items()} == {"mhc": 2, "mhc@cast": 2, "mhc@bc128": 2}


@pytest.mark.parametrize("extra,line", [
    (["--copy-tbps", "0"], "--copy-tbps: 0.0; allowed: a bandwidth above 0 (TB/s)"),
    (["--copy-tbps", "4", "--variant", "hc"], "--variant: hc not profiled; allowed: residual, mhc, mhc@tok0, mhc@r13"),
])
def test_trainer_traffic_refuses_bad_input_with_one_line(extra, line):
    proc = subprocess.run([sys.executable, "bench/trainer_traffic.py", str(PROFILED_AB), *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(line), proc.stderr


def test_idle_gaps_charges_each_gap_to_the_host_ops_that_launched_the_work_after_it():
    """A hand-made Kineto trace: two kernels launched late from inside an autograd node (host-bound gaps of 30 and
    50 us), one launched before its gap opened (a queued wait, not the host's), and overlapping work on two streams
    (no gap)."""
    sys.path.insert(0, str(REPO / "bench"))
    from profiling import idle_gaps

    def x(cat, name, ts, dur, tid=1, corr=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
                "args": {} if corr is None else {"correlation": corr}}

    events = [
        x("user_annotation", "Optimizer.step#AdamW.step", 0, 20),
        x("cuda_runtime", "cudaLaunchKernel", 5, 2, corr=1),
        x("kernel", "adam", 10, 10, tid=7, corr=1),
        x("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 40, 100, tid=2),
        x("cpu_op", "aten::mul", 45, 10, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 48, 2, tid=2, corr=2),
        x("kernel", "mul", 50, 40, tid=7, corr=2),            # gap 20 -> 50: 30 us, host (launched at 48)
        x("cuda_runtime", "cudaLaunchKernel", 60, 2, tid=2, corr=3),
        x("kernel", "other_stream", 70, 30, tid=8, corr=3),   # overlaps: busy until 100
        x("cpu_op", "aten::add", 140, 20, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 148, 2, tid=2, corr=4),
        x("kernel", "add", 150, 10, tid=7, corr=4),           # gap 100 -> 150: 50 us, host
        x("cuda_runtime", "cudaLaunchKernel", 152, 2, tid=2, corr=5),
        x("kernel", "late_queued", 200, 10, tid=7, corr=5),   # gap 160 -> 200, launched at 152: queued
    ]
    got = idle_gaps({"traceEvents": events}, steps=2)
    assert got["gaps_per_step"] == 1.5
    assert got["host_us_per_step"] == 40.0 and got["queued_us_per_step"] == 20.0
    inner = {r["name"]: r["us_per_step"] for r in got["by_inner_op"]}
    assert inner == {"aten::mul": 15.0, "aten::add": 25.0}
    outer = {r["name"]: r["us_per_step"] for r in got["by_outer_ops"]}
    assert outer == {"autograd::engine::evaluate_function: MulBackward0 > aten::mul": 15.0, "aten::add": 25.0}
    assert got["by_inner_op"][0]["name"] == "aten::add"  # largest first


def test_kernel_resources_compiles_with_the_launchs_divisibility():
    """bench/kernel_resources.py gives the AOT compile what a launch gives it: 16-divisible pointers and specialised
    integers (not do_not_specialize ones, not phi's row stride M = 24). Without them it compiled scalar code whose
    registers matched nothing on the GPU (round 11). In its own process: the compiler, not the interpreter."""
    script = """
import sys
sys.path.insert(0, "bench")
import kernel_resources as kr
from mhc_lightning.kernels.fused.projection import _coef_bwd_x
from mhc_lightning.kernels.fused.read_out import _pre_fwd
args = kr.divisible_args(_pre_fwd, dict(NS=4, BT=4, BC=512))
assert set(args) == {"x_ptr", "h_ptr", "u_ptr", "C", "stride_xt", "stride_xn"}, args  # N: do_not_specialize
xpass = kr.divisible_args(_coef_bwd_x, kr.xpass("coef_bwd_x"))
assert "stride_phi" not in xpass and "N" not in xpass and "tok_per_split" not in xpass and "K" in xpass, xpass
r = kr.compile_one(_pre_fwd, dict(NS=4, BT=4, BC=512), {"x_ptr", "u_ptr"}, dict(num_warps=4), 90)
assert 0 < r["registers"] <= 255 and r["stack_bytes"] == 0 and r["ctas_per_sm_by_registers"] >= 1, r
assert r["shared_bytes"] == 0 and r["ctas_per_sm_by_shared"] == 228, r  # no shared memory: the 1 KiB reserved per CTA
print("ok", r["registers"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]
