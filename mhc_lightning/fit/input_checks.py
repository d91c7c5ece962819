"""Input checks `mhc fit|validate|test` run after parsing and before anything is built.

A failed check is a UserError (one line naming the file or key and the fix), raised before the logger,
the Trainer or any folder exists: a bad input leaves no MLflow run, no runs/ folder, no artifacts.
"""

from __future__ import annotations

import math
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..data import ByteTextDataModule
from ..errors import UserError
from ..loggers.tags import CHECKPOINT_RUN_KEY
from ..model.modes import spec
from ..training.checkpoint_io import good_beside, remove_stale_temporaries, verify
from .early_checks import check_checkpoint_exists, check_checkpoint_given, is_checkpoint_file

# How the same weights are computed, not which weights: may differ between training and evaluation
# (e.g. Triton kernels when training on a GPU, the torch reference when evaluating on a CPU).
RUNTIME_ARCH_KEYS = frozenset(
    {
        "hyper.kernel_backend",
        "hyper.fused_pre",
        "hyper.chain_sublayers",
        "hyper.rebuild_branch_input",
        "recompute_block",
        "stream_dtype",
    }
)
# Architecture keys set through another key (CLI links): name the one the user sets
LINKED_FROM = {"context": "data.seq_len", "vocab_size": "data.corpus (its tokenizer's vocabulary)"}
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
HPC_PREFIX = "hpc_ckpt_"  # Lightning's SLURM requeue checkpoints: hpc_ckpt_<n>.ckpt in default_root_dir


@dataclass
class CheckpointInfo:
    path: Path
    source_run_id: Optional[str]  # the MLflow run that wrote the checkpoint, when known
    global_step: Optional[int] = None  # optimizer steps done when it was written
    scheduler: Optional[dict] = None  # its LR scheduler's state (resume.check_resume reads its planned steps)


def as_dict(ns) -> dict:
    return ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)


def check_inputs(subcommand: str, cfg) -> Optional[CheckpointInfo]:
    """Check the corpus and the checkpoint of the parsed `subcommand` config; return what the checkpoint tells."""
    data = ByteTextDataModule(**as_dict(cfg.data))
    data.check_corpus()
    ckpt = cfg.get("ckpt_path")
    check_checkpoint_given(subcommand, ckpt)
    if ckpt is None:
        refuse_foreign_hpc_checkpoint(Path(cfg.trainer.get("default_root_dir") or "."))
    if not is_checkpoint_file(ckpt):
        return None
    # the vocabulary follows the data (a CLI link applied later): compare the checkpoint with the data's
    return check_checkpoint(Path(ckpt), {**as_dict(cfg.model.arch), "vocab_size": data.vocab_size})


def refuse_foreign_hpc_checkpoint(root: Path) -> None:
    """Under SLURM, Lightning restores the newest hpc_ckpt_<n>.ckpt in default_root_dir into any fit or evaluation
    given no checkpoint, without a word: in a folder jobs share, another job's weights in a new run. `mhc` turns its
    requeue off (cli.py), so such a file is never this run's: refuse and say how to use it on purpose."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    versions = {p: p.stem[len(HPC_PREFIX) :] for p in root.glob(f"{HPC_PREFIX}*.ckpt")}
    numbered = [(int(v), p) for p, v in versions.items() if v.isdigit()]
    if not numbered or not SLURMEnvironment.detect():
        return
    newest = max(numbered)[1]
    raise UserError(
        f"trainer.default_root_dir {root} holds {newest.name}, a checkpoint of Lightning's SLURM requeue (not this "
        f"run's), which Lightning would restore into this new run without a word; give this fit a "
        f"trainer.default_root_dir of its own, or pass --ckpt_path {newest} to start from it on purpose"
    )


def schedule_warnings(max_steps: int, warmup_steps: int, diagnostics_every: int, residual_mode: str) -> list[str]:
    """What a new fit's step budget silently spoils, one line each: a run that is all warm-up (the learning rate never
    reaches model.optim.lr), and diagnostics taken at step 0 only (`mhc compare` would show the initial H_res)."""
    if max_steps <= 0:
        return []
    said = []
    if warmup_steps >= max_steps:
        said.append(
            f"model.optim.warmup_steps={warmup_steps} >= trainer.max_steps={max_steps}: the whole run is warm-up, "
            f"the learning rate never reaches model.optim.lr; lower warmup_steps below {max_steps}"
        )
    if spec(residual_mode).multi_stream and diagnostics_every >= max_steps:
        said.append(
            f"model.diagnostics_every={diagnostics_every} >= trainer.max_steps={max_steps}: diagnostics are taken at "
            f"step 0 only, so the run's H_res figures show its initialisation; lower diagnostics_every below "
            f"{max_steps}"
        )
    return said


def check_checkpoint(path: Path, arch: dict) -> CheckpointInfo:
    """Refuse a missing or unreadable checkpoint, or one trained with another architecture than ``arch``."""
    check_checkpoint_exists(path)
    for tmp in remove_stale_temporaries(path.parent):
        print(f"mhc: removed {tmp.name}, left in {tmp.parent} by a checkpoint write that was killed", file=sys.stderr)
    verify(path, _run_id_from_layout(path))  # CorruptCheckpoint names the newest good checkpoint beside it
    ckpt = _load(path)
    trained = (ckpt.get("hyper_parameters") or {}).get("arch")
    if not isinstance(trained, dict):
        raise UserError(
            f"checkpoint {path} holds no model.arch hyperparameters, so it was not written by mhc fit; "
            "pass a checkpoint of an mhc fit run."
        )
    mismatches = arch_mismatches(arch, trained)
    if mismatches:
        said = "; ".join(
            f"{key} is {_show(mine)} here but {_show(theirs)} in the checkpoint" for key, mine, theirs in mismatches
        )
        flags = " ".join(f"--{key}={_show(theirs)}" for key, _, theirs in mismatches)
        raise UserError(
            f"checkpoint {path} was trained with another architecture: {said}. Use the config it was "
            f"trained with (its MLflow run keeps it as config.yaml), or add: {flags}"
        )
    run = ckpt.get(CHECKPOINT_RUN_KEY) or {}
    schedulers = ckpt.get("lr_schedulers") or [None]
    return CheckpointInfo(path, run.get("run_id") or _run_id_from_layout(path), ckpt.get("global_step"), schedulers[0])


def _load(path: Path) -> dict:
    """The checkpoint's contents; a file that is not a whole torch.save archive (cut short, or not a checkpoint) is a
    UserError naming the newest good checkpoint beside it."""
    instead = good_beside(path, _run_id_from_layout(path), otherwise="pass a .ckpt file written by mhc fit.")
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since torch 1.6
        raise UserError(
            f"checkpoint {path} is not a whole torch.save archive (cut short, or not a checkpoint); {instead}"
        )
    # mmap: the hyperparameters are needed, not the weights; weights_only as Lightning itself loads it.
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises many types for a file that is not a checkpoint
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {path} cannot be read ({first}); {instead}") from err


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return a == b


def arch_mismatches(config: dict, trained: dict) -> list[tuple[str, Any, Any]]:
    """(CLI key, config value, checkpoint value) for each architecture key on which they differ."""
    mine, theirs = _flatten(config), _flatten(trained)
    out = []
    for key, value in theirs.items():
        if key in RUNTIME_ARCH_KEYS or key not in mine or mine[key] is None or _same(mine[key], value):
            continue
        out.append((LINKED_FROM.get(key, f"model.arch.{key}"), mine[key], value))
    return out


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value)


def _run_id_from_layout(path: Path) -> Optional[str]:
    # Lightning's checkpoint folder under an MLflow logger: <root>/<experiment id>/<run id>/checkpoints/
    run_dir = path.parent.parent
    return run_dir.name if path.parent.name == "checkpoints" and _RUN_ID.match(run_dir.name) else None
