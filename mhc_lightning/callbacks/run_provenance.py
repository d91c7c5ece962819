"""RunProvenance: every run (fit, validate, test; each grid point and sweep trial) records what it ran.

- tags `mhc.git.commit`, `mhc.git.dirty`, `mhc.git.diff_sha256` (and MLflow's own `mlflow.source.git.commit`,
  overwritten with the real one), `mhc.code.sha256` (a digest of the package's and the kernels' sources that run),
  `mhc.code` (the label `mhc compare` groups by: the commit, or `src:<digest>` where no checkout tells the code, which
  the run says in one line at its start; `mhc.code.unknown_because` says why; `mhc.build.commit` in the Docker image),
  `mhc.env.*` (Python, library, CUDA and GPU versions), `mhc.data.train_sha256` / `mhc.data.val_sha256` (every
  digest a resumed run read, comma-separated: `mhc fit --data_changed`) / `mhc.data.seed_source`;
- params `seed_everything`, `data.seed` and the trainer settings that change results (`trainer.*`);
- artifacts `provenance/environment.json` and, for a dirty checkout that holds all the code, the
  `provenance/uncommitted-<digest>.diff`;
- at the end of a fit, the tag `mhc.weights_sha256`: a digest of the final weights, so that replicates (same code,
  config and seed) can be checked for bitwise identity from the store alone.

A resumed run (`--ckpt_path last`) may run other code or settings than its first part: MLflow params cannot change,
so a changed one is kept as its first value and the tag `mhc.changed_on_resume.<param>` says `first -> now`; the
code tags list every commit the run ran under, comma-separated, so that `mhc compare` keeps it out of clean pools.
Loggers other than MLflow get the same values as hyperparameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

import torch
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loggers import MLFlowLogger

from ..loggers.tags import DATA_TAGS, SLURM_JOB_TAG
from ..provenance import build_commit, environment, run_code

CODE_TAG = "mhc.code"
COMMIT_TAG = "mhc.git.commit"
DIRTY_TAG = "mhc.git.dirty"
DIFF_TAG = "mhc.git.diff_sha256"
SOURCES_TAG = "mhc.code.sha256"
UNKNOWN_TAG = "mhc.code.unknown_because"
WEIGHTS_TAG = "mhc.weights_sha256"
CHANGED_PREFIX = "mhc.changed_on_resume."


def trainer_settings(trainer) -> dict[str, str]:
    """The Trainer settings that change a result (what is trained, validated, or when), as params; max_time in
    seconds (None: no limit)."""
    timers = [cb for cb in trainer.callbacks if isinstance(cb, Timer)]
    return {
        "trainer.precision": str(trainer.precision),
        "trainer.devices": str(trainer.num_devices),
        "trainer.num_nodes": str(trainer.num_nodes),
        "trainer.strategy": type(trainer.strategy).__name__,
        "trainer.max_steps": str(trainer.max_steps),
        "trainer.max_time": str(timers[0]._duration if timers else None),
        "trainer.accumulate_grad_batches": str(trainer.accumulate_grad_batches),
        "trainer.gradient_clip_val": str(trainer.gradient_clip_val),
        "trainer.gradient_clip_algorithm": str(trainer.gradient_clip_algorithm),
        "trainer.limit_val_batches": str(trainer.limit_val_batches),
        "trainer.val_check_interval": str(trainer.val_check_interval),
        "trainer.log_every_n_steps": str(trainer.log_every_n_steps),
        "trainer.deterministic": str(torch.are_deterministic_algorithms_enabled()),
    }


def full_state(module) -> dict:
    """The module's state dict with FSDP2's sharded tensors (DTensors) gathered whole: a collective, so every rank
    calls it."""
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in module.state_dict().items()}


def weights_digest(module, state: dict = None) -> str:
    """sha256 over every parameter and buffer, by name, in the order of the state dict (dtype and bytes); `state`:
    that state dict, already gathered (full_state)."""
    digest = hashlib.sha256()
    for name, t in (module.state_dict() if state is None else state).items():
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        # flat first: a 0-dim tensor (HC's scalar gates) cannot be viewed as bytes; the bytes are the same
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _merged(old: str, new: str) -> str:
    """A comma-separated history of values, each once, in order."""
    seen = [v for v in old.split(",") if v] if old else []
    return ",".join(seen + [v for v in new.split(",") if v and v not in seen])


class RunProvenance(Callback):
    def setup(self, trainer, pl_module, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        code = run_code()
        params = {"seed_everything": os.environ.get("PL_GLOBAL_SEED", "off"), **trainer_settings(trainer)}
        tags = {
            COMMIT_TAG: code.commit,
            DIRTY_TAG: "unknown" if code.dirty is None else str(code.dirty).lower(),
            DIFF_TAG: code.diff_sha256,
            CODE_TAG: code.label,
            SOURCES_TAG: code.sources_sha256,
        }
        if code.unknown_because:
            tags[UNKNOWN_TAG] = code.unknown_because
            print(
                f"mhc: the code this run runs is not one commit's ({code.unknown_because}): recorded as the digest "
                f"of its sources, {code.label} (tag {SOURCES_TAG})",
                file=sys.stderr,
                flush=True,
            )
        if build_commit():
            tags["mhc.build.commit"] = build_commit()
        if os.environ.get("SLURM_JOB_ID"):
            tags[SLURM_JOB_TAG] = os.environ["SLURM_JOB_ID"]
        dm = trainer.datamodule
        if dm is not None and getattr(dm, "train_sha256", None):
            params["data.seed"] = str(dm.hparams.seed)
            tags.update(
                {
                    DATA_TAGS["train"]: dm.train_sha256,
                    DATA_TAGS["val"]: dm.val_sha256,
                    "mhc.data.seed_source": str(dm.seed_source),
                    # what a token is: val/bpb = val/loss / ln 2 / bytes_per_token; nats per token compare only
                    # between runs of one tokenizer (mhc compare / report say so)
                    "mhc.data.tokenizer": str(getattr(dm, "tokenizer_name", "bytes (raw)")),
                    "mhc.data.tokenizer_sha256": str(
                        (getattr(dm, "meta", None) or {}).get("tokenizer", {}).get("sha256", "")
                    ),
                    "mhc.data.bytes_per_token": f"{getattr(dm, 'bytes_per_token', 1.0):.6f}",
                }
            )
        env = environment(trainer.strategy.root_device)
        tags.update({f"mhc.env.{k}": v for k, v in env.items()})
        for lg in trainer.loggers:
            if isinstance(lg, MLFlowLogger):
                self._to_mlflow(lg, params, tags, env, code)
            else:
                lg.log_hyperparams({**params, **tags})

    def on_fit_end(self, trainer, pl_module) -> None:
        state = full_state(pl_module)  # on every rank: gathering shards is a collective
        if trainer.is_global_zero:
            digest = weights_digest(pl_module, state)
            for lg in trainer.loggers:
                if isinstance(lg, MLFlowLogger):
                    lg.experiment.set_tag(lg.run_id, WEIGHTS_TAG, digest)
                else:
                    lg.log_hyperparams({WEIGHTS_TAG: digest})

    @staticmethod
    def _to_mlflow(lg: MLFlowLogger, params: dict[str, str], tags: dict[str, str], env: dict, code) -> None:
        client, run_id = lg.experiment, lg.run_id
        run = client.get_run(run_id)
        before_params, before_tags = run.data.params, run.data.tags
        for key in (COMMIT_TAG, DIRTY_TAG, DIFF_TAG, CODE_TAG, SOURCES_TAG):  # a resumed run keeps its code history
            if before_tags.get(key) and before_tags[key] != tags[key]:
                tags[key] = (
                    _merged(before_tags[key], tags[key])
                    if key != DIRTY_TAG
                    else ("true" if "true" in (before_tags[key], tags[key]) else tags[key])
                )
        for key in DATA_TAGS.values():  # every data it read, in order, the last one now (`mhc fit --data_changed`)
            seen = before_tags.get(key)
            if seen and key in tags:
                tags[key] = seen if seen.split(",")[-1] == tags[key] else f"{seen},{tags[key]}"
        for key, value in params.items():
            if key in before_params and before_params[key] != value:
                tags[CHANGED_PREFIX + key] = f"{before_params[key]} -> {value}"
                warnings.warn(
                    f"resumed run {run_id}: {key} was {before_params[key]}, now {value} "
                    f"(recorded in the tag {CHANGED_PREFIX}{key})",
                    stacklevel=2,
                )
        new_params = {k: v for k, v in params.items() if k not in before_params}
        if new_params:
            lg.log_hyperparams(new_params)
        if code.commit != "unknown" and not code.unknown_because:
            tags["mlflow.source.git.commit"] = code.commit
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
        client.log_text(run_id, json.dumps(env, indent=1, sort_keys=True), "provenance/environment.json")
        if code.dirty and not code.unknown_because:  # the diff of a checkout whose kernels did not run would mislead
            client.log_text(run_id, code.diff, f"provenance/uncommitted-{code.diff_sha256[:12]}.diff")
