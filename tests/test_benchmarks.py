"""Every benchmark of `python -m bench` runs its CPU path at tiny sizes and writes the one JSON layout; the GPU-only
ones are checked for their arguments here and run by the `gpu`-marked smokes. The GPU numbers themselves live in
docs/benchmarks.md, not in tests."""

import argparse
import importlib
import io
import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, fast_first

sys.path.insert(0, str(REPO))  # `bench` is the repo's top-level folder, not an installed package
from bench import __main__ as entry  # noqa: E402
from bench import callbacks, curve, data, diagnostics, harness, host, recompute, resources, stack, traffic, trainer  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the trainer's eager profile of the residual and mHC on an H200, as docs/benchmarks.md cites it
EAGER_PROFILE = REPO / "docs" / "benchmarks" / "2026-12-04-h200-trainer-eager-profile.json"


def _layout(path):
    data = json.loads(path.read_text())
    assert set(data) == {"benchmark", "env", "args", "rows"}, set(data)
    assert {
        "date",
        "host",
        "device",
        "python",
        "torch",
        "triton",
        "lightning",
        "git_commit",
        "git_dirty",
        "command",
    } <= set(data["env"])
    return data


def _refused(main, argv, capsys) -> str:
    """The last line a benchmark's parser printed when it refused argv (exit 2, before any work)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _run(main, argv, out) -> dict:
    """Run a benchmark with argv and `--out out`; it must exit 0. Returns the JSON it wrote, checked for the layout."""
    assert main([*argv, "--out", str(out)]) == 0
    return _layout(out)


# ---- the entry point and the harness ---------------------------------------------------------------------------
def test_help_lists_every_benchmark_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert set(listed) == set(entry.BENCHMARKS)
    for name in entry.BENCHMARKS:
        module = importlib.import_module(f"bench.{name}")
        assert callable(module.main) and module.__doc__.splitlines()[0] in listed[name]


def test_an_unknown_benchmark_is_refused_with_the_list(capsys):
    assert entry.main(["nope"]) == 2
    assert "unknown benchmark 'nope'; allowed: trainer, curve, stack" in capsys.readouterr().err


def test_report_writes_the_one_layout_and_the_table_prints_missing_values(tmp_path):
    assert harness.median_ms(lambda: sum(range(1000)), iters=3, warmup=1, device="cpu") > 0
    args = argparse.Namespace(out=str(tmp_path / "x.json"), n=1, where=tmp_path)
    report = harness.Report("stack", args, ["--n", "1"], "cpu")
    report.add({"name": "a", "ms": 1.5})
    data = _layout(tmp_path / "x.json")
    assert data["benchmark"] == "stack" and data["env"]["command"] == "python -m bench stack --n 1"
    assert data["args"]["where"] == str(tmp_path) and data["rows"] == [{"name": "a", "ms": 1.5}]
    out = io.StringIO()
    harness.print_table([{"name": "a", "ms": 1.5}, {"name": "bb"}], [("name", "name", ""), ("ms", "ms", ".2f")], out)
    assert out.getvalue().splitlines() == ["name    ms", "a     1.50", "bb       -"]


def test_the_json_goes_under_out_when_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert harness.out_path("host", None) == tmp_path / "host.json"
    assert harness.out_path("host", "x.json") == harness.Path("x.json")


# ---- stack -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_stack_smoke_times_each_variant_against_the_residual(tmp_path):
    argv = ["--smoke", "--shapes", "1024", "--iters", "1", "--warmup", "0", "--variants", "mhc chained,hc"]
    rows = {r["variant"]: r for r in _run(stack.main, argv, tmp_path / "stack.json")["rows"]}
    assert set(rows) == {"residual", "mhc chained", "hc"}
    assert all(r["ms"] > 0 and r["host_ms"] > 0 and r["C"] == 64 for r in rows.values())
    assert rows["residual"]["x_residual"] == 1.0 and rows["hc"]["x_residual"] > 0


def test_stack_selects_variants_by_substring_and_keeps_the_residual():
    names = [
        "residual",
        "mhc chained",
        "residual+compile",
        "mhc per-sublayer+cudagraph",
        "hc",
        "liger",
        "mhc chained+compile",
    ]
    assert stack.selected(names, None, None, False) == names[:-1]  # the chained compile only when named
    assert stack.selected(names, ["chained"], None, False) == ["residual", "mhc chained", "mhc chained+compile"]
    assert stack.selected(names, ["hc"], None, False) == ["residual", "hc"]  # a whole name picks that variant alone
    assert stack.selected(names, None, ["compile", "liger"], False) == [
        "residual",
        "mhc chained",
        "mhc per-sublayer+cudagraph",
        "hc",
    ]
    # --smoke: no compile, CUDA graphs or peers
    assert stack.selected(names, None, None, True) == ["residual", "mhc chained", "hc"]


def test_stack_refuses_an_unknown_shape(capsys):
    assert _refused(stack.main, ["--smoke", "--shapes", "4096"], capsys).endswith("--shapes: 4096; allowed: 1024, 2048")


@pytest.mark.gpu
@needs_gpu
def test_stack_on_the_gpu(tmp_path):
    argv = ["--shapes", "1024", "--variants", "mhc chained", "--iters", "1", "--warmup", "0"]
    data = _run(stack.main, argv, tmp_path / "stack.json")
    assert data["env"]["copy_tb_s"] > 0 and all(r["peak_gib"] > 0 for r in data["rows"])


# ---- trainer ---------------------------------------------------------------------------------------------------
def test_trainer_variants_get_their_fit_arguments_and_kernel_config(tmp_path):
    args = argparse.Namespace(
        smoke=True,
        d_model=64,
        layers=2,
        heads=2,
        seq=64,
        batch=4,
        diagnostics_every=0,
        fit_args="--trainer.max_steps=3",
        variant_args={"chain": "--model.arch.hyper.chain_sublayers=true"},
    )
    chained = trainer.fit_args(args, tmp_path, tmp_path / "corpus.txt", "mhc@chain", 1, 5, "--trainer.callbacks=[]")
    plain = trainer.fit_args(args, tmp_path, tmp_path / "corpus.txt", "mhc", 1, 5, "--trainer.callbacks=[]")
    assert chained == plain + ["--model.arch.hyper.chain_sublayers=true"]  # last: it wins over --fit-args
    assert plain[-1] == "--trainer.max_steps=3" and "model/mhc.yaml" in " ".join(plain)
    assert trainer.with_config_variants(["residual", "mhc", "hc"], {"a": None, "b": None}) == [
        "residual",
        "mhc",
        "hc",
        "mhc@a",
        "hc@a",
        "mhc@b",
        "hc@b",
    ]
    assert trainer.with_config_variants(["residual", "mhc", "hc", "mhc@a"], {"a": None}) == [
        "residual",
        "mhc",
        "hc",
        "mhc@a",
    ]  # a variant named in --modes: NAME's only runs
    env = trainer._env(False, '{"coef_fwd": {"BT": 128}}')
    assert env["MHC_KERNEL_CONFIG"] == '{"coef_fwd": {"BT": 128}}' and str(REPO) in env["PYTHONPATH"]


@fast_first(
    "argv,line",
    [
        (
            ["--modes", "residual,mhc@nope", "--kernel-config", "old={}"],
            "--modes mhc@nope: 'nope' is no --kernel-config or --variant-args NAME; allowed: old",
        ),
        (["--variant-args", "a-b=--x"], "--variant-args: expected NAME=VALUE with a NAME of letters, digits and _"),
        (["--kernel-config", "a={x"], "--kernel-config a: not JSON"),
    ],
)
def test_trainer_refuses_a_variant_it_cannot_run_before_any_fit(tmp_path, capsys, argv, line):
    assert line in _refused(trainer.main, ["--smoke", *argv, "--out", str(tmp_path / "t.json")], capsys)
    assert not (tmp_path / "t.json").exists()


def test_trainer_headline_takes_the_median_run_and_ratios_pair_devices():
    runs = [{"step_ms_mean": m, "step_ms_median": m, "step_ms": [m], "gc": {}} for m in (12.0, 10.0, 11.0)]
    head = trainer.headline(runs)
    assert head["step_ms_mean"] == 11.0 and len(head["repeats"]) == 3 and "step_ms" not in head
    rows = [
        dict(variant="residual", devices=1, step_ms_mean=10.0, step_ms_median=9.0, tokens_per_s=100.0),
        dict(variant="mhc", devices=1, step_ms_mean=12.0, step_ms_median=9.9, tokens_per_s=80.0),
        dict(variant="mhc", devices=2, step_ms_mean=13.0, step_ms_median=13.0, tokens_per_s=150.0),
    ]
    trainer.add_ratios(rows, 2)
    assert rows[1]["x_residual"] == 1.2 and rows[1]["x_residual_median"] == pytest.approx(1.1)
    assert rows[2]["scaling_efficiency"] == 150.0 / 160.0 and "x_residual" not in rows[2]  # no residual on 2


@pytest.mark.slow
def test_trainer_smoke_runs_one_fit(tmp_path):
    argv = ["--smoke", "--modes", "residual", "--work", str(tmp_path / "w")]
    (row,) = _run(trainer.main, argv, tmp_path / "trainer.json")["rows"]
    assert row["variant"] == "residual" and row["devices"] == 1 and row["exit"] == 0 and row["x_residual"] == 1.0
    assert set(row["phases"]) == {"forward", "backward", "optimizer", "between_steps"}
    assert all(p["host_ms"] > 0 and p["device_ms"] is None for p in row["phases"].values())  # no device on the CPU
    assert len(row["step_ms"]) == row["timed_steps"] > 1 and row["gc"]["longest_ms"] >= 0
    assert (tmp_path / "trainer_logs.txt").read_text().startswith("==== residual-1.log")


@pytest.mark.slow
def test_trainer_repeats_alternate_and_a_profiled_run_follows(tmp_path):
    argv = ["--smoke", "--modes", "residual", "--repeat", "2", "--profile", "2", "--work", str(tmp_path / "w")]
    (row,) = _run(trainer.main, argv, tmp_path / "trainer.json")["rows"]
    means = [r["step_ms_mean"] for r in row["repeats"]]
    assert len(means) == 2 and row["step_ms_mean"] == min(means)  # the lower middle one of two
    for r in row["repeats"]:  # every run's steps one by one: a step's phases end at the next step's start
        assert all(len(r["phase_steps"][k]["host_ms"]) == len(r["step_ms"]) - 1 for k in row["phases"])
        assert sum(r["gc"]["ms"].values()) == pytest.approx(sum(r["gc"]["ms_per_step"]))
    profile = row["profile"]
    assert profile["steps"] == 2 and profile["device_time"] is False and profile["top"]
    assert profile["top"][0]["us_per_step"] >= profile["top"][-1]["us_per_step"] > 0


# ---- traffic ---------------------------------------------------------------------------------------------------
def test_traffic_tabulates_a_committed_trainer_profile(tmp_path):
    data = _run(traffic.main, [str(EAGER_PROFILE), "--copy-tbps", "4.17"], tmp_path / "traffic.json")
    rows = {(r["variant"], r["kernel"]): r for r in data["rows"]}
    assert {v for v, _ in rows} == {"mhc"}  # the residual's profile has no fused kernel
    post = rows["mhc", "_post_fwd"]  # x [4C] and f [C] read, x_next [4C] written (bf16), h_post and H^res (fp32)
    assert post["mb_per_call"] == 18512 * 16384 / 1e6 and post["floor_us"] == pytest.approx(18512 * 16384 / 4.17e6)
    assert post["calls_per_step"] == 24 and rows["mhc", "_pre_fwd"]["u_bytes"] == 4  # eager bf16-mixed: fp32 u
    assert post["op"] == "stream_post_res" and rows["mhc", "_coef_fwd"]["op"] == "mhc_coefficients"
    assert rows["mhc", "all"]["pct_copy"] == pytest.approx(87, abs=1)
    assert rows["mhc", "all"]["ms_per_step"] == pytest.approx(
        sum(r["ms_per_step"] for (v, k), r in rows.items() if v == "mhc" and k != "all")
    )


def test_traffic_reads_the_trainer_benchmarks_rows_and_u_in_the_streams_dtype_when_compiled(tmp_path):
    profile = {"top": [{"name": "_pre_fwd", "us_per_step": 480.0, "calls_per_step": 12}]}
    run = dict(variant="mhc", devices=1, precision="bf16-mixed", tokens_per_step=1024, d_model=256, profile=profile)
    src = tmp_path / "trainer.json"
    src.write_text(json.dumps({"rows": [dict(run, compiled=True), dict(run, variant="mhc@eager", compiled=False)]}))
    data = _run(traffic.main, [str(src), "--copy-tbps", "2"], tmp_path / "t.json")
    rows = {r["variant"]: r for r in data["rows"] if r["kernel"] == "_pre_fwd"}
    assert rows["mhc"]["u_bytes"] == 2 and rows["mhc@eager"]["u_bytes"] == 4
    assert rows["mhc"]["mb_per_call"] == (4 * 256 * 2 + 4 * 4 + 256 * 2) * 1024 / 1e6 and rows["mhc"]["us"] == 40.0


@fast_first(
    "extra,line",
    [
        (["--copy-tbps", "0"], "--copy-tbps: 0.0; allowed: a bandwidth above 0 (TB/s)"),
        (["--copy-tbps", "4", "--variant", "x"], "--variant: x not profiled; allowed: residual, mhc"),
    ],
)
def test_traffic_refuses_bad_input_with_one_line(capsys, extra, line):
    assert _refused(traffic.main, [str(EAGER_PROFILE), *extra], capsys).endswith(line)


# ---- host ------------------------------------------------------------------------------------------------------
def test_host_times_each_wiring_with_the_launches_stubbed(tmp_path):
    out = tmp_path / "host.json"
    data = _run(host.main, ["--sublayers", "2", "--steps", "2"], out)
    assert data["env"]["launches"] == "stubbed" and [r["wiring"] for r in data["rows"]] == list(host.WIRINGS)
    assert all(r["per_sublayer_us"] > 0 and r["forward_only"] is False for r in data["rows"])
    data = _run(host.main, ["--sublayers", "2", "--steps", "2", "--forward", "--bf16"], out)
    assert all(r["forward_only"] and r["stream_dtype"] == "bfloat16" for r in data["rows"])


def test_host_stubs_only_inside_its_block():
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    with host.launches("cpu"):
        assert InterpretedFunction.run is not run and InterpretedFunction.run(None, grid=(1,), warmup=False) is None
    assert InterpretedFunction.run is run


def test_host_model_lists_mhcs_extra_host_functions(tmp_path):
    data = _run(host.main, ["--model", "--sublayers", "2", "--steps", "1", "--top", "40"], tmp_path / "model.json")
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"residual", "mhc"} and all(r["forward_ms"] > 0 for r in rows.values())
    # the fused ops' own Python is mHC's alone
    assert any(f["mhc_ms"] > 0 == f["residual_ms"] for f in rows["mhc"]["extra_functions"])


@pytest.mark.slow
def test_host_model_compiled_runs_the_fused_ops_as_custom_ops(tmp_path):
    argv = ["--model", "--compile", "--sublayers", "2", "--steps", "1", "--top", "80"]
    rows = {r["mode"]: r for r in _run(host.main, argv, tmp_path / "model.json")["rows"]}
    assert set(rows) == {"residual", "mhc", host.LIBRARY_PATH}
    assert all(r["compiled"] and r["forward_cpu_ms"] > 0 and r["first_call_s"] > 0 for r in rows.values())
    # the compiled graph's op calls reach the bodies through the fused ops' own autograd kernel
    assert any(f["function"] == "custom_ops.py:autograd_kernel" for f in rows["mhc"]["extra_functions"])


def test_host_times_each_fused_op_against_its_body(tmp_path):
    rows = {
        r["op"]: r
        for r in _run(host.main, ["--ops", "--sublayers", "2", "--steps", "1"], tmp_path / "ops.json")["rows"]
    }
    # what the compiled chain, the compiled sublayer and HC call, forward and backward
    assert {"mhc_enter", "mhc_boundary", "mhc_boundary_bwd", "stream_post_res", "hc_enter_routed"} <= set(rows)
    assert all(r["dispatched_us"] > 0 and r["custom_op_us"] > 0 and r["body_us"] > 0 for r in rows.values())


@pytest.mark.parametrize(
    "argv,line",
    [(["--compile"], "add --model"), (["--ops", "--model"], "leave out --model"), (["--threads", "0"], "at least 1")],
)
def test_host_refuses_bad_input_with_one_line(capsys, argv, line):
    assert line in _refused(host.main, argv, capsys)


# ---- resources -------------------------------------------------------------------------------------------------
def test_resources_reads_cuobjdumps_resource_usage_and_checks_its_arguments(capsys):
    text = "Resource usage:\n Function _coef_fwd:\n  REG:92 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:540 TEXTURE:0\n"
    assert resources.resource_usage(text) == dict(registers=92, stack_bytes=0, local_bytes=8)
    assert _refused(resources.main, ["--modes", "mhc,nope"], capsys).endswith(
        "--modes: nope; allowed: mhc, mhc-rebuilt, mhc-per-sublayer, hc"
    )
    if not torch.cuda.is_available():
        assert "needs a CUDA device" in _refused(resources.main, [], capsys)


@pytest.mark.gpu
@needs_gpu
def test_resources_on_the_gpu(tmp_path):
    argv = ["--c", "128", "--batch", "1", "--seq", "64", "--modes", "mhc,hc"]
    rows = _run(resources.main, argv, tmp_path / "resources.json")["rows"]
    assert any(r["kernel"] == "_coef_fwd" for r in rows) and all(r["registers"] > 0 for r in rows)


# ---- callbacks, diagnostics, recompute -------------------------------------------------------------------------
TINY_MODEL = ["--layers", "1", "--width", "32", "--seq", "16", "--batch", "2"]


def test_callbacks_pairs_blocks_per_configuration(tmp_path):
    argv = [*TINY_MODEL, "--heads", "2", "--threads", "1", "--block", "2", "--pairs", "2", "--warmup", "2"]
    data = _run(callbacks.main, [*argv, "--configs", "stability,sinkhorn"], tmp_path / "callbacks.json")
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"stability", "sinkhorn"} and all(r["pairs"] == 2 for r in rows.values())
    assert rows["stability"]["snapshot_ms"] > 0 and "snapshot_ms" not in rows["sinkhorn"]


def test_diagnostics_times_off_every_step_and_every_k(tmp_path):
    argv = [*TINY_MODEL, "--threads", "1", "--steps", "4", "--warmup", "1", "--k", "2"]
    rows = _run(diagnostics.main, argv, tmp_path / "diagnostics.json")["rows"]
    assert [r["every"] for r in rows] == [0, 1, 2] and all(r["median_ms"] > 0 for r in rows)
    assert "overhead_at_k" in rows[2]


def test_recompute_counts_the_bytes_each_block_size_keeps(tmp_path):
    argv = ["--device", "cpu", "--layers", "2", "--width", "32", "--heads", "2", "--seq", "16", "--batch", "2"]
    rows = _run(recompute.main, [*argv, "--blocks", "1,auto", "--steps", "0"], tmp_path / "recompute.json")["rows"]
    assert [r["recompute_block"] for r in rows] == ["0", "1", "auto"]
    assert rows[0]["bytes_per_token"] == pytest.approx(rows[0]["saved_tensors_hooks_bytes_per_token"], rel=1e-3)
    assert all(r["bytes_per_token"] < rows[0]["bytes_per_token"] for r in rows[1:])


# ---- where a step's time goes ----------------------------------------------------------------------------------
def test_idle_gaps_charges_each_gap_to_the_host_ops_that_launched_the_work_after_it():
    """A hand-made Kineto trace: two kernels launched late from inside an autograd node (host-bound gaps of 30 and
    50 us), one launched before its gap opened (a queued wait, not the host's), and overlapping work on two streams
    (no gap)."""
    from bench.profiling import idle_gaps

    def x(cat, name, ts, dur, tid=1, corr=None):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "tid": tid,
            "args": {} if corr is None else {"correlation": corr},
        }

    events = [
        x("user_annotation", "Optimizer.step#AdamW.step", 0, 20),
        x("cuda_runtime", "cudaLaunchKernel", 5, 2, corr=1),
        x("kernel", "adam", 10, 10, tid=7, corr=1),
        x("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 40, 100, tid=2),
        x("cpu_op", "aten::mul", 45, 10, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 48, 2, tid=2, corr=2),
        x("kernel", "mul", 50, 40, tid=7, corr=2),  # gap 20 -> 50: 30 us, host (launched at 48)
        x("cuda_runtime", "cudaLaunchKernel", 60, 2, tid=2, corr=3),
        x("kernel", "other_stream", 70, 30, tid=8, corr=3),  # overlaps: busy until 100
        x("cpu_op", "aten::add", 140, 20, tid=2),
        x("cuda_runtime", "cudaLaunchKernel", 148, 2, tid=2, corr=4),
        x("kernel", "add", 150, 10, tid=7, corr=4),  # gap 100 -> 150: 50 us, host
        x("cuda_runtime", "cudaLaunchKernel", 152, 2, tid=2, corr=5),
        x("kernel", "late_queued", 200, 10, tid=7, corr=5),  # gap 160 -> 200, launched at 152: queued
    ]
    got = idle_gaps({"traceEvents": events}, steps=2)
    assert got["gaps_per_step"] == 1.5
    assert got["host_us_per_step"] == 40.0 and got["queued_us_per_step"] == 20.0
    inner = {r["name"]: r["us_per_step"] for r in got["by_inner_op"]}
    assert inner == {"aten::mul": 15.0, "aten::add": 25.0}
    outer = {r["name"]: r["us_per_step"] for r in got["by_outer_ops"]}
    assert outer == {"autograd::engine::evaluate_function: MulBackward0 > aten::mul": 15.0, "aten::add": 25.0}
    assert got["by_inner_op"][0]["name"] == "aten::add"  # largest first


def test_curve_draws_the_ratio_against_the_width_from_point_jsons(tmp_path):
    for width, ratio in ((1024, 1.4), (4096, 1.1)):
        for kind in ("eager", "compiled"):
            rows = [
                {"variant": "residual", "devices": 1, "tokens_per_s": 1e5, "peak_gib": 10.0, "step_ms_median": 50.0},
                {
                    "variant": "mhc",
                    "devices": 1,
                    "tokens_per_s": 1e5 / ratio,
                    "peak_gib": 13.0,
                    "step_ms_median": 50.0 * ratio,
                    "x_residual_median": ratio,
                },
            ]
            curve.point_path(tmp_path, width, kind).write_text(json.dumps({"args": {"layers": 12}, "rows": rows}))
    assert curve.main(["--draw", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "curve.json").read_text())
    mhc = [r for r in data["rows"] if r["variant"] == "mhc" and r["kind"] == "eager"]
    assert [(r["width"], r["x_residual_median"], r["peak_x_residual"]) for r in mhc] == [
        (1024, 1.4, 1.3),
        (4096, 1.1, 1.3),
    ]
    assert (tmp_path / "curve.png").stat().st_size > 5000


@pytest.mark.slow
def test_curve_smoke_runs_a_trainer_call_per_point(tmp_path):
    out = tmp_path / "curve" / "curve.json"
    assert (
        curve.main(["--smoke", "--kinds", "eager", "--modes", "residual,mhc", "--widths", "64", "--out", str(out)]) == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["width"] for r in rows] == [64, 64] and all(r["tokens_per_s"] for r in rows)
    assert all(r["x_residual_median"] for r in rows if r["variant"] == "mhc")


@pytest.mark.slow
def test_data_smoke_measures_memory_and_the_loader(tmp_path):
    """The loader part (prepare's rate needs a corpus worth timing; its code is tests/test_prepare.py's)."""
    out = tmp_path / "data.json"
    args = ["--sizes", "0.01", "--batches", "5", "--skip", "prepare", "--out", str(out), "--workdir", str(tmp_path)]
    assert data.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["measure"], r["workers"]) for r in rows] == [("loader", 0), ("loader", 2)]
    assert all(r["tokens_per_s"] > 0 and r["anon_mib"] > 0 for r in rows)
