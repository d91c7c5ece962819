"""`mhc fit <same arguments> --ckpt_path last`: continue the run the same command started, from its last checkpoint,
in the same MLflow run.

Lightning's own `ckpt_path="last"` looks in the new run's checkpoint folder (runs/<experiment id>/<new run id>/...),
which is empty, and starts from scratch in a new MLflow run. Here, before the logger and the trainer are built, `last`
becomes the newest earlier training run of the same experiment and run name (or the run given as
`trainer.logger.init_args.run_id`), its last checkpoint (the local folder, else downloaded from the run's artifacts
when `log_model: true` moved it there), and that run's id for the logger. The logger then continues the MLflow run
without logging a metric step twice (loggers/resilient.py); the train loader continues where the checkpoint stopped
(a stateful loader, saved in the checkpoint by Lightning).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError
from ..loggers.mlflow_runs import mlflow_logger_configs
from ..loggers.tags import DATA_TAGS, SLURM_JOB_TAG, STAGE_TAG
from .child_processes import mhc_command

LAST = "last"
LOCAL_LAST = "last.ckpt"
ARTIFACT_LAST = "last/last.ckpt"  # where Lightning's MLFlowLogger uploads last.ckpt (artifact folder = file stem)


class NoCheckpointToResume(UserError):
    """`--ckpt_path last` found no earlier run with a checkpoint; the message says where it looked."""


def _get(ns: Any, key: str, default=None):
    return ns.get(key, default) if hasattr(ns, "get") else getattr(ns, key, default)


def _checkpoint_dirpath(trainer_cfg) -> Optional[str]:
    """A ModelCheckpoint `dirpath` set in the config (then checkpoints are not per run)."""
    for cb in _get(trainer_cfg, "callbacks") or []:
        if "ModelCheckpoint" in str(_get(cb, "class_path", "")):
            dirpath = _get(_get(cb, "init_args", {}), "dirpath")
            if dirpath:
                return str(dirpath)
    return None


def resolve_last(config, subcommand: Optional[str]) -> Optional[str]:
    """If the command asks for `--ckpt_path last` with an MLflow logger, point it at the previous run's checkpoint and
    that run; returns the run, in words, or None when there is nothing to resolve. Raises NoCheckpointToResume."""
    cfg = config[subcommand] if subcommand else config
    if _get(cfg, "ckpt_path") != LAST:
        return None
    loggers = mlflow_logger_configs(_get(cfg.trainer, "logger"))
    if not loggers:
        return None  # Lightning's own `last` (a checkpoint folder it knows)
    logger = loggers[0]
    init = logger.init_args
    uri, experiment, name = init.tracking_uri, init.experiment_name, _get(init, "run_name")
    run_id, ckpt = find_checkpoint(
        uri,
        experiment,
        name,
        _get(init, "run_id"),
        Path(cfg.trainer.default_root_dir or "."),
        _checkpoint_dirpath(cfg.trainer),
    )
    init.run_id = run_id
    cfg.ckpt_path = str(ckpt)
    return f"MLflow run {run_id} ({name or 'unnamed'}, experiment {experiment!r})"


def requeue_wanted(trainer_cfg) -> bool:
    """Whether this fit requeues its SLURM job on the requeue signal and, requeued, continues its run: under SLURM,
    unless a plugin says otherwise (Lightning's SLURMEnvironment with auto_requeue false, as `mhc grid --launcher
    slurm` jobs pass: submitit requeues those; or another cluster environment)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return False
    plugins = _get(trainer_cfg, "plugins") or []
    for plugin in plugins if isinstance(plugins, list) else [plugins]:
        path = str(_get(plugin, "class_path", ""))
        if path.endswith("SLURMEnvironment"):
            return _get(_get(plugin, "init_args", {}) or {}, "auto_requeue", True) is not False
        if path.endswith("Environment"):
            return False
    return True


def resolve_requeued(config, subcommand: Optional[str]) -> Optional[str]:
    """A SLURM job that was requeued (SLURM_RESTART_COUNT >= 1) and given no checkpoint continues the MLflow run its
    first start tagged with its job id (SLURM_JOB_TAG), from that run's last checkpoint; returns the run, in words, or
    None (a new run: no such run, or it left no checkpoint). Only ever its own run: another job, even one sharing the
    default_root_dir and run name, has another id."""
    cfg = config[subcommand] if subcommand else config
    job, restarts = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_RESTART_COUNT", "0")
    loggers = mlflow_logger_configs(_get(cfg.trainer, "logger"))
    if subcommand != "fit" or _get(cfg, "ckpt_path") is not None or not job or not restarts.isdigit():
        return None
    if int(restarts) < 1 or not loggers or _get(loggers[0].init_args, "run_id") or not requeue_wanted(cfg.trainer):
        return None
    from mlflow import MlflowClient

    from ..loggers.filters import equals
    from ..loggers.store import default_tracking_uri, sqlite_path

    init = loggers[0].init_args
    uri = init.tracking_uri or default_tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # no store yet: nothing to continue (opening it would create it)
        return None
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(init.experiment_name)
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], equals(f"tags.`{SLURM_JOB_TAG}`", job), order_by=["attributes.start_time DESC"]
    )  # fmt: skip
    name = _get(init, "run_name")  # a batch script may run several fits: this one's
    runs = [
        r
        for r in runs
        if r.info.status != "FINISHED"
        and r.data.tags.get(STAGE_TAG, "fit") == "fit"
        and (not name or r.info.run_name == name)
    ]
    if not runs:
        return None
    try:
        run_id, ckpt = find_checkpoint(
            uri, init.experiment_name, None, runs[0].info.run_id, Path(cfg.trainer.default_root_dir or "."),
            _checkpoint_dirpath(cfg.trainer),
        )  # fmt: skip
    except NoCheckpointToResume:
        return None
    init.run_id, cfg.ckpt_path = run_id, str(ckpt)
    return f"SLURM job {job} (requeued {restarts}x): MLflow run {run_id} ({name or 'unnamed'})"


def check_resume(cfg, checkpoint, run: Optional[str]) -> None:
    """`mhc fit` from a checkpoint, before anything is written: refuse a step budget other than the one the checkpoint's
    schedule was planned for unless `--extend` says to continue it (training/schedule.py), then say where training
    restarts. `checkpoint`: input_checks.CheckpointInfo; `run`: what resolve_last resumes."""
    lambdas = (checkpoint.scheduler or {}).get("lr_lambdas") or [None]
    planned = lambdas[0].get("total") if isinstance(lambdas[0], dict) else None  # None: not a WarmupCosine
    step, max_steps = checkpoint.global_step, int(_get(cfg.trainer, "max_steps") or -1)
    if planned is not None and max_steps > 0 and max_steps != planned:
        sched, nan = checkpoint.scheduler, float("nan")
        lr, lr_min = (sched.get("_last_lr") or [nan])[0], (sched.get("base_lrs") or [nan])[0] * lambdas[0]["min_ratio"]
        state = "finished" if step is not None and step >= planned else f"at step {step}"
        then = (
            f"the lr stays at the minimum it reached, {lr:.3g}"
            if lr <= lr_min * (1 + 1e-6)
            else f"the cosine goes on from the lr it reached, {lr:.3g}, to its minimum {lr_min:.3g} at step {max_steps}"
        )
        if not _get(cfg, "extend"):
            raise UserError(
                f"--ckpt_path {checkpoint.path}: that run was planned for trainer.max_steps={planned} ({state}) and "
                f"this command asks for trainer.max_steps={max_steps}, which would change its learning-rate schedule; "
                f"add --extend to continue it to step {max_steps} ({then}), or resume with "
                f"--trainer.max_steps={planned}"
            )
        if step is not None and max_steps <= step:
            raise UserError(
                f"--extend: trainer.max_steps={max_steps} is not beyond the checkpoint's step {step}; "
                "pass a larger trainer.max_steps"
            )
    check_same_data(cfg)
    where = f"{run} from {checkpoint.path}" if run else str(checkpoint.path)
    total = f" of {max_steps}" if max_steps > 0 else ""
    print(f"resuming {where}: it restarts at step {step}{total}", file=sys.stderr, flush=True)


def _continued_run(cfg) -> Optional[tuple[str, dict]]:
    """(run id, tags) of the MLflow run this fit continues (`--ckpt_path last`, or a run_id given); None for a new run
    or a store that cannot tell (the logger then says what is wrong with it)."""
    loggers = mlflow_logger_configs(_get(cfg.trainer, "logger"))
    init = loggers[0].init_args if loggers else {}
    run_id = _get(init, "run_id")
    if not run_id:
        return None
    from mlflow import MlflowClient

    from ..loggers.store import default_tracking_uri, sqlite_path

    uri = _get(init, "tracking_uri") or default_tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # opening it would create the store
        return None
    try:
        return run_id, MlflowClient(uri).get_run(run_id).data.tags
    except Exception:
        return None


def data_digests(data_cfg) -> dict[str, str]:
    """{split: sha256} of the data `data_cfg` reads, as the run's tags record them (ByteTextDataModule.setup)."""
    from ..data import ByteTextDataModule
    from ..data.shards import data_digest
    from .input_checks import as_dict

    data = ByteTextDataModule(**as_dict(data_cfg))
    if data.meta:  # prepared shards: from their metadata, without reading them
        return {split: data_digest(data.meta, split) for split in DATA_TAGS}
    data.setup("fit")
    return {"train": data.train_sha256, "val": data.val_sha256}


def check_same_data(cfg) -> None:
    """A fit that continues an MLflow run must read the data the run trained on: refuse other data (one line, both
    digests) unless `--data_changed` says so; then say it, and the run's tags keep both (run_provenance.py)."""
    continued = _continued_run(cfg)
    if continued is None:
        return
    run_id, tags = continued
    recorded = {split: tags[tag].split(",")[-1] for split, tag in DATA_TAGS.items() if tags.get(tag)}
    if not recorded:
        return
    now = data_digests(cfg.data)
    changed = [split for split in recorded if recorded[split] != now[split]]
    if not changed:
        return
    said = "; ".join(
        f"its {split} split has sha256 {now[split]}, run {run_id} trained on {recorded[split]} (tag {DATA_TAGS[split]})"
        for split in changed
    )
    corpus = _get(cfg.data, "corpus")
    if not _get(cfg, "data_changed"):
        raise UserError(
            f"data.corpus {corpus} changed since the run this fit continues read it: {said}. Restore that data, or add "
            "--data_changed to continue the run on this data on purpose (its tags then keep both digests)"
        )
    print(
        f"mhc fit: data.corpus {corpus} changed on purpose (--data_changed): {said}; the run's tags keep both",
        file=sys.stderr,
        flush=True,
    )


def find_checkpoint(
    uri: Optional[str],
    experiment: str,
    run_name: Optional[str],
    run_id: Optional[str],
    root: Path,
    dirpath: Optional[str],
) -> tuple[str, Path]:
    from mlflow import MlflowClient

    from ..loggers.filters import equals
    from ..loggers.store import check_tracking, default_tracking_uri, sqlite_path

    uri = uri or default_tracking_uri()
    db = sqlite_path(uri)
    if db is not None and not db.is_file():  # checking the store would create it: nothing may be written here
        raise NoCheckpointToResume(
            f"--ckpt_path last: no MLflow store at {db}, so no earlier run to resume; run the "
            "same command without --ckpt_path to start it, or pass a checkpoint file"
        )
    check_tracking(uri)
    client = MlflowClient(uri)
    if run_id:
        candidates = [client.get_run(run_id)]
        what = f"run {run_id}"
    else:
        exp = client.get_experiment_by_name(experiment)
        flt = equals("attributes.run_name", run_name) if run_name else ""
        candidates = (
            []
            if exp is None
            else [
                r
                for r in client.search_runs([exp.experiment_id], flt, order_by=["attributes.start_time DESC"])
                if r.data.tags.get(STAGE_TAG, "fit") == "fit" and (not run_name or r.info.run_name == run_name)
            ]
        )
        what = f"an earlier training run named {run_name!r} in experiment {experiment!r}"
    looked = []
    for run in candidates:
        folder = Path(dirpath) if dirpath else root / run.info.experiment_id / run.info.run_id / "checkpoints"
        local = folder / LOCAL_LAST
        newest = newest_last(folder)
        if newest is not None:
            return run.info.run_id, newest
        looked.append(str(local))
        if any(a.path == ARTIFACT_LAST for a in client.list_artifacts(run.info.run_id, "last")):
            folder.mkdir(parents=True, exist_ok=True)
            got = Path(client.download_artifacts(run.info.run_id, ARTIFACT_LAST, str(folder)))
            if got != local:
                got.replace(local)
                if got.parent != folder and not any(got.parent.iterdir()):
                    got.parent.rmdir()
            return run.info.run_id, local
    where = f" (looked for {', '.join(looked[:3])} and the runs' MLflow artifact {ARTIFACT_LAST})" if looked else ""
    raise NoCheckpointToResume(
        f"--ckpt_path last: no checkpoint of {what} at {uri}{where}; run the same command without --ckpt_path to "
        "start it, or pass a checkpoint file"
    )


def newest_last(folder: Path) -> Optional[Path]:
    """The folder's last.ckpt, or a versioned last-vN.ckpt beside it where that holds a later step: Lightning wrote one
    when a resumed checkpoint named no last file, leaving last.ckpt at the resumed step. Without either (its write
    failed: a full disk, a read-only folder), the newest good checkpoint there."""
    from ..training.checkpoint_io import checkpoint_step, last_good

    local = folder / LOCAL_LAST
    versioned = [p for p in folder.glob(f"{Path(LOCAL_LAST).stem}-v*.ckpt") if p.is_file()]
    if not versioned:
        good = None if local.is_file() else last_good(folder)
        return local if local.is_file() else good[0] if good else None

    found = [(checkpoint_step(p) or -1, p.stat().st_mtime_ns, p) for p in [local, *versioned] if p.is_file()]
    return max(found)[2]


def resume_command(args: list[str]) -> str:
    """`mhc <args> --ckpt_path last`, shell-quoted: the command that continues the run `args` started (an earlier
    --ckpt_path is replaced), with this environment's `mhc` by its full path, as the end-of-fit line names `mlflow`:
    it runs without the venv activated."""
    kept, i = [], 0
    while i < len(args):
        if args[i] == "--ckpt_path":
            i += 2  # the flag and its value
            continue
        if not args[i].startswith("--ckpt_path="):
            kept.append(args[i])
        i += 1
    return shlex.join([*mhc_command(), *kept, "--ckpt_path", LAST])
