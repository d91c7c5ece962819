"""The Lightning trainer's step: residual against mHC / HC through real `mhc fit` runs, on one GPU or DDP on several.

    python -m bench trainer [--modes residual,mhc,hc] [--steps 40] [--fit-args="--model.compile=true"]
    python -m bench trainer --gpus 2                # DDP: scaling efficiency = tok/s(2) / (2 x tok/s(1))
    python -m bench trainer --smoke                 # CPU, tiny shapes: checks the benchmark, not speed

Every run is `python -m mhc_lightning.fit.cli fit` composed from the repo's presets (conf/base.yaml,
conf/model/MODE.yaml, conf/machine/gpu.yaml for one GPU, ddp.yaml for several), bf16-mixed, C = 1024, 12 blocks, B = 8
per GPU, T = 2048, generated text (no downloads), diagnostics off. Step times come from CUDA events at every step end
after the warm-up, with no synchronisation inside the timed window; each row also has the host's and the device's time
per phase of the step (forward, backward, optimizer, between steps), peak memory, and Python's garbage collections in
the timed steps.
x_residual and x_residual_median: the step's mean and median against the residual's on as many devices.
A/Bs inside one call: --kernel-config NAME=JSON runs MODE@NAME with MHC_KERNEL_CONFIG=JSON (launch-config overrides,
docs/kernels.md), --variant-args NAME=ARGS with more `mhc fit` arguments, --repeat N alternates the variants N times
(a row keeps its median run). --profile STEPS: one more run per variant under torch.profiler, device time per kernel
and the gaps where the GPU waited on the host (`python -m bench traffic` reads it).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from bench import harness
from bench.profiling import print_rows

CONF = harness.REPO / "conf"
COLUMNS = [
    ("variant", "variant", ""),
    ("devices", "devices", "d"),
    ("step_ms_mean", "step ms", ".1f"),
    ("step_ms_median", "median ms", ".1f"),
    ("x_residual", "x resid", ".3f"),
    ("x_residual_median", "x resid (median)", ".3f"),
    ("tokens_per_s", "tok/s", ",.0f"),
    ("scaling_efficiency", "scaling", ".3f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("exit", "exit", ""),
]


def _cb(cls: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": cls, "init_args": init_args})


def _env(smoke: bool, kernel_config: Optional[str] = None) -> dict:
    env = dict(os.environ)  # keeps the machine's NCCL settings (e.g. NCCL_NVLS_ENABLE=0)
    if kernel_config is not None:
        env["MHC_KERNEL_CONFIG"] = kernel_config
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1" if smoke else "4")
    env.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_fit(
    name: str, args: list[str], work: Path, smoke: bool, timeout: int, kernel_config: Optional[str] = None
) -> tuple[int, float]:
    log = work / f"{name}.log"
    t0 = time.time()
    cmd = [sys.executable, "-m", "mhc_lightning.fit.cli", "fit", *args]
    try:
        with log.open("w") as f:
            f.write(" ".join(cmd) + "\n\n")
            f.flush()
            rc = subprocess.run(
                cmd, cwd=work, env=_env(smoke, kernel_config), stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    dt = time.time() - t0
    print(f"  {name}: exit {rc} in {dt:.0f} s" + ("" if rc == 0 else f"\n{log.read_text()[-3000:]}"), flush=True)
    return rc, dt


def machine_args(smoke: bool, devices: int) -> list[str]:
    if smoke:
        if devices == 1:
            return ["-c", str(CONF / "machine" / "cpu.yaml")]
        return ["-c", str(CONF / "machine" / "ddp-cpu.yaml"), f"--trainer.devices={devices}"]
    if devices == 1:
        return ["-c", str(CONF / "machine" / "gpu.yaml")]
    return ["-c", str(CONF / "machine" / "ddp.yaml"), f"--trainer.devices={devices}"]


def fit_args(args, work: Path, corpus: Path, variant: str, devices: int, steps: int, callback: str) -> list[str]:
    """`mhc fit` arguments of one run of MODE or MODE@NAME: the mode's preset at the benchmark's shape, no logger, the
    probe callback, --fit-args, then NAME's --variant-args."""
    mode, _, name = variant.partition("@")
    return [
        "-c",
        str(CONF / "base.yaml"),
        "-c",
        str(CONF / "model" / f"{mode}.yaml"),
        *machine_args(args.smoke, devices),
        "--seed_everything=1234",
        f"--data.corpus={corpus}",
        f"--data.seq_len={args.seq}",
        f"--data.batch_size={args.batch}",
        "--data.val_fraction=0.02",
        f"--model.arch.d_model={args.d_model}",
        f"--model.arch.n_layers={args.layers}",
        f"--model.arch.n_heads={args.heads}",
        f"--model.diagnostics_every={args.diagnostics_every}",
        "--model.optim.lr=1e-3",
        "--model.optim.warmup_steps=5",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.val_check_interval=null",
        "--trainer.check_val_every_n_epoch=null",
        "--trainer.enable_checkpointing=false",
        "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.log_every_n_steps=10",
        f"--trainer.default_root_dir={work / 'root'}",
        f"--trainer.precision={'32-true' if args.smoke else 'bf16-mixed'}",
        "--trainer.logger=false",
        callback,
        *shlex.split(args.fit_args),
        *shlex.split(args.variant_args.get(name, "")),
    ]


def with_config_variants(modes: list[str], names: dict) -> list[str]:
    """modes plus MODE@NAME for each NAME (--kernel-config / --variant-args) and each mode but residual, unless --modes
    already names a variant of NAME: then those are NAME's only runs."""
    named = {m.partition("@")[2] for m in modes if "@" in m}
    return modes + [
        f"{m}@{name}" for name in names if name not in named for m in modes if m != "residual" and "@" not in m
    ]


def headline(runs: list[dict]) -> dict:
    """Of repeated runs of one variant, the one with the median mean step (the lower middle one for an even count),
    with every run's times beside it: on a shared host a process's step time varies by 10 % or more."""
    ok = sorted((r for r in runs if "step_ms_mean" in r), key=lambda r: r["step_ms_mean"])
    head = dict(ok[(len(ok) - 1) // 2]) if ok else dict(runs[-1])
    if len(runs) > 1:
        head["repeats"] = [
            {
                k: r.get(k)
                for k in (
                    "step_ms_mean",
                    "step_ms_median",
                    "exit",
                    "seconds",
                    "phases",
                    "preempted_per_step",
                    "step_ms",
                    "phase_steps",
                    "gc",
                )
                if k in r
            }
            for r in runs
        ]
        for k in ("step_ms", "phase_steps", "gc"):  # kept once, with the run they belong to
            head.pop(k, None)
    return head


def add_ratios(rows: list[dict], gpus: int) -> None:
    """x_residual (by mean step), x_residual_median, and the scaling efficiency of each variant on `gpus` devices."""
    by = {(r["variant"], r["devices"]): r for r in rows}
    for r in rows:
        base = by.get(("residual", r["devices"]), {})
        for key, stat in (("x_residual", "step_ms_mean"), ("x_residual_median", "step_ms_median")):
            if stat in r and stat in base:
                r[key] = r[stat] / base[stat]
        one = by.get((r["variant"], 1), {})
        if r["devices"] > 1 and "tokens_per_s" in r and "tokens_per_s" in one:
            r["scaling_efficiency"] = r["tokens_per_s"] / (gpus * one["tokens_per_s"])


def print_run(rec: dict) -> None:
    if "tokens_per_s" not in rec:
        return
    print(
        f"    {rec['tokens_per_s']:,.0f} tok/s, step {rec['step_ms_mean']:.1f} ms mean / {rec['step_ms_median']:.1f} "
        f"median, peak {rec['peak_gib'] or 0:.1f} GiB",
        flush=True,
    )
    print(
        "    host / device ms: "
        + ", ".join(
            f"{k} {v['host_ms'] or 0:.1f} (cpu {v['host_cpu_ms'] or 0:.1f}) / {v['device_ms'] or 0:.1f}"
            for k, v in rec["phases"].items()
        )
        + f"; preempted {rec.get('preempted_per_step')} per step; gc "
        f"{rec['gc']['collections']} in {sum(rec['gc']['ms'].values()):.1f} ms (longest {rec['gc']['longest_ms']:.1f})",
        flush=True,
    )


def print_profile(variant: str, rec: dict) -> None:
    busy, wall = rec["busy_us_per_step"], rec["wall_us_per_step"]
    print(
        f"  {variant}: {wall / 1e3:.1f} ms per profiled step, kernels {busy / 1e3:.1f} ms ({100 * busy / wall:.0f} %)",
        flush=True,
    )
    print_rows(rec["top"], busy, top=15)
    if "idle" in rec:
        idle = rec["idle"]
        print(
            f"  idle: {idle['host_us_per_step'] / 1e3:.1f} ms per step waiting on the host "
            f"({idle['gaps_per_step']:.0f} gaps), {idle['queued_us_per_step'] / 1e3:.1f} ms on queued work; by the "
            "host ops that launched the next work:",
            flush=True,
        )
        for r in idle["by_outer_ops"][:12]:
            print(f"    {r['us_per_step']:9.0f} us  {r['name']}", flush=True)
        for r in rec["syncs"][:4]:
            print(f"  synchronizing call, {r['per_step']:.1f} per step, from:\n{r['stack']}", flush=True)


def run_all(args, work: Path, corpus: Path, report: harness.Report, save_logs) -> None:
    counts = " and ".join(map(str, sorted({1, args.gpus})))
    print(
        f"trainer: {args.modes} on {counts} device(s), C={args.d_model}, {args.layers} blocks, "
        f"B={args.batch}/device, T={args.seq}, {args.warmup} warm-up + {args.steps} timed steps"
        + (f", each {args.repeat} times, alternating" if args.repeat > 1 else ""),
        flush=True,
    )
    for devices in sorted({1, args.gpus}):
        runs: dict = {}
        for rep in range(args.repeat):
            for variant in args.modes:
                name = f"{variant}-{devices}" + (f"-r{rep}" if args.repeat > 1 else "")
                out = work / f"{name}.json"
                a = fit_args(
                    args,
                    work,
                    corpus,
                    variant,
                    devices,
                    args.warmup + args.steps,
                    _cb("bench.trainer_probes.Throughput", warmup=args.warmup, out=str(out)),
                )
                rc, dt = run_fit(
                    name, a, work, args.smoke, args.timeout, args.kernel_configs.get(variant.partition("@")[2])
                )
                rec = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
                rec.update(exit=rc, seconds=round(dt, 1))
                runs.setdefault(variant, []).append(rec)
                print_run(rec)
        for variant, recs in runs.items():
            name = variant.partition("@")[2]
            compiled = "--model.compile=true" in f"{args.fit_args} {args.variant_args.get(name, '')}"
            report.add(
                dict(
                    variant=variant,
                    devices=devices,
                    compiled=compiled,
                    kernel_config=args.kernel_configs.get(name),
                    **headline(recs),
                )
            )
            save_logs()
    if args.profile:
        print(f"profile: {args.profile} steps after {args.warmup} warm-up steps, one more run per variant", flush=True)
        rows = {r["variant"]: r for r in report.rows if r["devices"] == 1}
        for variant in args.modes:
            out = work / f"{variant}-profile.json"
            a = fit_args(
                args,
                work,
                corpus,
                variant,
                1,
                args.warmup + args.profile,
                _cb("bench.trainer_probes.ProfileSteps", warmup=args.warmup, steps=args.profile, out=str(out)),
            )
            rc, _ = run_fit(
                f"{variant}-profile",
                a,
                work,
                args.smoke,
                args.timeout,
                args.kernel_configs.get(variant.partition("@")[2]),
            )
            rec = json.loads(out.read_text()) if rc == 0 and out.exists() else {"exit": rc}
            rows[variant]["profile"] = rec
            report.save()
            save_logs()
            if "top" in rec:
                print_profile(variant, rec)


def named_items(p, flag: str, items: list[str], check=None) -> dict:
    """NAME=VALUE items of a repeatable flag; NAME is letters, digits and _ (it becomes MODE@NAME)."""
    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name or "@" in name or "-" in name:
            p.error(f"{flag}: expected NAME=VALUE with a NAME of letters, digits and _, got {item!r}")
        if check:
            check(name, text)
        out[name] = text
    return out


def main(argv=None) -> int:
    p = harness.parser("trainer", __doc__)
    p.add_argument("--smoke", action="store_true", help="CPU (gloo for DDP), tiny shapes: checks the benchmark")
    p.add_argument("--gpus", type=int, default=1, help="devices of the DDP rows (one-device rows always run)")
    p.add_argument("--modes", default="residual,mhc", help="comma-separated: residual, mhc, hc, ... or MODE@NAME")
    p.add_argument("--d-model", type=int, default=None, help="width C (default 1024; --smoke: 64)")
    p.add_argument("--layers", type=int, default=None, help="blocks, each an attention and an MLP sublayer (12; 2)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (16; 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (2048; 64)")
    p.add_argument("--batch", type=int, default=None, help="sequences per device (8; 4)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40, help="timed steps")
    p.add_argument("--diagnostics-every", type=int, default=0, help="0: pure training throughput")
    p.add_argument("--timeout", type=int, default=240, help="seconds per `mhc fit`")
    p.add_argument("--repeat", type=int, default=1, help="run each variant this many times, the variants alternating")
    p.add_argument(
        "--kernel-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more variant of every mode but residual, MODE@NAME, run with MHC_KERNEL_CONFIG=JSON, "
        'e.g. wide=\'{"coef_fwd": {"BT": 128}}\'; naming MODE@NAME in --modes runs only those',
    )
    p.add_argument(
        "--variant-args",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="more `mhc fit` arguments for MODE@NAME only, e.g. chain='--model.arch.hyper.chain_sublayers=true'",
    )
    p.add_argument("--profile", type=int, default=0, metavar="STEPS", help="one more run per variant, profiled")
    p.add_argument("--fit-args", default="", help="more `mhc fit` arguments for every run")
    p.add_argument("--work", default=None, help="folder for the runs and their logs (default: a new temporary one)")
    args = p.parse_args(argv)

    def json_config(name, text):
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            p.error(f"--kernel-config {name}: not JSON ({exc.msg})")

    args.kernel_configs = named_items(p, "--kernel-config", args.kernel_config, json_config)
    args.variant_args = named_items(p, "--variant-args", args.variant_args)
    names = {**dict.fromkeys(args.kernel_configs), **dict.fromkeys(args.variant_args)}
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:  # a variant named in --modes must be defined (else it would run the default)
        if "@" in mode and mode.partition("@")[2] not in names:
            p.error(
                f"--modes {mode}: {mode.partition('@')[2]!r} is no --kernel-config or --variant-args NAME; "
                f"allowed: {', '.join(names) or 'none given'}"
            )
    args.modes = with_config_variants(modes, names)
    # the shape: what was given, else the trainer's (C = 1024, 12 blocks, B 8, T 2048) or --smoke's tiny one
    for key, full, tiny in (
        ("d_model", 1024, 64),
        ("layers", 12, 2),
        ("heads", 16, 2),
        ("seq", 2048, 64),
        ("batch", 8, 4),
    ):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.smoke else full)
    if args.smoke:
        args.warmup, args.steps, args.timeout = min(args.warmup, 3), min(args.steps, 5), min(args.timeout, 300)
    elif torch.cuda.device_count() < args.gpus:
        p.error(f"needs {args.gpus} CUDA devices, found {torch.cuda.device_count()} (--smoke runs on the CPU)")
    report = harness.Report("trainer", args, argv or [], "cpu" if args.smoke else "cuda")
    if args.gpus > 1 and torch.cuda.is_available():
        report.env["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True).stdout
    # runs, logs and the corpus stay outside the JSON's folder: only the JSON and one log file go back from a GPU host
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    from mhc_lightning.data.synthetic import english_like_text

    # enough windows for the longest run: every device its own batches, plus the validation split
    need = int((args.warmup + args.steps + args.profile + 8) * args.batch * args.gpus * (args.seq + 1) * 1.2)
    corpus.write_text(english_like_text(400_000 if args.smoke else need + 2_000_000))
    logs = report.path.with_name(report.path.stem + "_logs.txt")

    def save_logs() -> None:  # the runs' logs in one file (few files travel back from a GPU host)
        logs.parent.mkdir(parents=True, exist_ok=True)
        with open(logs, "w") as f:
            for log in sorted(work.glob("*.log"), key=lambda q: q.stat().st_mtime):
                f.write(f"==== {log.name}\n{log.read_text()[-20000:]}\n")

    run_all(args, work, corpus, report, save_logs)
    add_ratios(report.rows, args.gpus)
    print()
    harness.print_table(report.rows, COLUMNS)
    print(f"wrote {report.save()} and {logs}")
    return 0 if all(r.get("exit") == 0 for r in report.rows) else 1
