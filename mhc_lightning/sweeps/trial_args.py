"""A trial's values: sampled from the spec's space, and turned into the `mhc fit` arguments of the trial.

`callbacks.<Class>.<arg>` parameters become one appended callback per class (`--trainer.callbacks+=`), resolved
against mhc_lightning.callbacks (or a dotted class path); `check_callbacks` decides before any trial which of them
exist, so that every worker samples the same space.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

from .spec import CALLBACK_PREFIX, SpecError, SweepSpec


def sample(trial, spec: SweepSpec) -> dict[str, Any]:
    """Define-by-run sampling in file order; conditional parameters are skipped when their condition fails."""
    values: dict[str, Any] = {}
    for p in spec.space:
        if p.key in spec.skipped:
            continue
        if any(k not in values or values[k] not in allowed for k, allowed in p.when.items()):
            continue
        if p.type == "categorical":
            values[p.key] = trial.suggest_categorical(p.key, p.choices)
        elif p.type == "int":
            values[p.key] = trial.suggest_int(p.key, p.low, p.high, step=p.step or 1, log=p.log)
        else:
            values[p.key] = trial.suggest_float(p.key, p.low, p.high, step=p.step, log=p.log)
    return values


def cli_value(v: Any) -> str:
    """Render a value the way jsonargparse reads it back (strings raw, everything else as JSON)."""
    if isinstance(v, str):
        return v
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        raise ValueError(f"cannot pass {v} on the command line")
    return json.dumps(v)


def resolve_callback_class(name: str):
    """`SinkhornScheduler` -> mhc_lightning.callbacks.SinkhornScheduler (or a dotted class path); None if absent."""
    import importlib

    module, _, cls = name.rpartition(".") if "." in name else ("mhc_lightning.callbacks", "", name)
    try:
        return getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None


def check_callbacks(spec: SweepSpec) -> list[str]:
    """Resolve callbacks.<Class>.<arg> parameters; optional ones whose class is missing are skipped.

    Returns warnings to show the user. Raises SpecError for a missing class that is not optional, an
    argument the class does not take, or a class already present in the base configs (it would run twice).
    """
    import inspect

    warnings = []
    base_text = "\n".join(p.read_text() for p in spec.base)
    for p in spec.space:
        if not p.is_callback:
            continue
        cls_name, arg = p.callback_parts()
        cls = resolve_callback_class(cls_name)
        where = f"{spec.path or '<sweep>'}: space.{p.key}"
        if cls is None:
            if p.optional:
                spec.skipped[p.key] = f"{cls_name} not found in mhc_lightning.callbacks"
                warnings.append(f"skipping {p.key}: {spec.skipped[p.key]} (optional: true)")
                continue
            raise SpecError(
                f"{where}: callback class {cls_name!r} not found in mhc_lightning.callbacks; "
                "write a dotted class path, or add `optional: true` to skip it when absent"
            )
        params = inspect.signature(cls.__init__).parameters
        if arg not in params and not any(q.kind is q.VAR_KEYWORD for q in params.values()):
            raise SpecError(
                f"{where}: {cls.__name__} takes no argument {arg!r}; its arguments: "
                f"{[n for n in params if n != 'self']}"
            )
        if f"{cls.__name__}" in base_text:
            raise SpecError(
                f"{where}: {cls.__name__} already appears in the base configs; the sweep adds it "
                "to each trial with the sampled arguments, so remove it from the base configs"
            )
    return warnings


def trial_args(spec: SweepSpec, values: dict[str, Any], logger: Optional[dict] = None) -> list[str]:
    """`mhc fit` arguments (without the `fit` subcommand) for one trial: base configs, trial.args, fixed values,
    sampled values, one appended callback per callbacks.<Class> group, and the per-trial logger."""
    args: list[str] = []
    for p in spec.base:
        args += ["--config", str(p)]
    args += spec.trial["args"]  # e.g. a machine preset: later than the base configs, earlier than the sweep's values
    # Many trials share a terminal or a log file: no progress bars unless the sweep file asks for them.
    quiet = {"trainer.enable_progress_bar": False, "trainer.enable_model_summary": False}
    args += [f"--{k}={cli_value(v)}" for k, v in quiet.items() if k not in spec.fixed]
    cb_args: dict[str, dict[str, Any]] = {}
    for key, v in {**spec.fixed, **values}.items():
        if key.startswith(CALLBACK_PREFIX):
            cls, _, arg = key[len(CALLBACK_PREFIX) :].rpartition(".")
            cb_args.setdefault(cls, {})[arg] = v
        else:
            args.append(f"--{key}={cli_value(v)}")
    for cls_name, init in cb_args.items():
        cls = resolve_callback_class(cls_name)
        path = f"{cls.__module__}.{cls.__qualname__}" if cls is not None else cls_name
        args.append("--trainer.callbacks+=" + json.dumps({"class_path": path, "init_args": init}))
    if logger is not None:
        args.append("--trainer.logger=" + json.dumps(logger))
    return args
