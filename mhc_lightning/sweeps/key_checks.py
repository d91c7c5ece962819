"""A sweep's keys against what they name: `mhc fit`'s CLI, the model's config dataclasses, and the Sinkhorn
dimensions that only mHC has. Each check returns the problem (a message, or the field and a message) or None;
spec.py turns it into a SpecError naming the field."""

from __future__ import annotations

import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional, Union

import yaml

CALLBACK_PREFIX = "callbacks."  # space keys "callbacks.<Class>.<init arg>" become a trial callback
CLI_ROOTS = ("model.", "data.", "trainer.", "seed_everything", "optimizer", "lr_scheduler", "ckpt_path")
Problem = Optional[Union[str, tuple[str, str]]]
SINKHORN_KEY = "sinkhorn_"  # the HyperConfig fields sinkhorn_*, and the SinkhornScheduler's arguments


def cli_key_problem(key) -> Problem:
    if not isinstance(key, str) or not key.startswith(CLI_ROOTS):
        return (
            f"{key!r} is not a `mhc fit` key; keys start with one of {list(CLI_ROOTS)} "
            "(or callbacks.<Class>.<arg> in space)"
        )
    return None


def sinkhorn_key_problem(params: list, fixed: dict[str, Any], base: list[Path]) -> Problem:
    """A Sinkhorn dimension (model.arch.hyper.sinkhorn_*, the SinkhornScheduler's arguments) that a trial of an
    exactly doubly stochastic mode would sample: those modes have no Sinkhorn, so the dimension would be noise."""
    from ..model.modes import warning_modes

    key = "model.arch.hyper.residual_mode"
    swept = next((p for p in params if p.key == key), None)
    mode = fixed.get(key, base_residual_mode(base))
    for p in params:
        if not p.key.startswith(("model.arch.hyper.sinkhorn_", f"{CALLBACK_PREFIX}SinkhornScheduler.")):
            continue
        reach = p.when.get(key, swept.choices) if swept is not None else [mode]
        exact = [m for m in reach if m in warning_modes(SINKHORN_KEY)]
        if exact:
            return p.key, (
                f"residual_mode {exact} has no Sinkhorn (H_res exactly doubly stochastic): sample it only "
                f"for mhc, when: {{{key}: [mhc]}}"
            )
    return None


def base_residual_mode(base: list[Path]) -> str:
    """model.arch.hyper.residual_mode as the base configs set it (the last one that does wins), else the default."""
    from ..model.modes import DEFAULT_MODE

    mode = DEFAULT_MODE
    for path in base:
        cfg = yaml.safe_load(path.read_text())
        for part in ("model", "arch", "hyper"):
            cfg = cfg.get(part) if isinstance(cfg, dict) else None
        if isinstance(cfg, dict) and "residual_mode" in cfg:
            mode = cfg["residual_mode"]
    return mode


def _literal_choices(tp) -> Optional[tuple]:
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else None


def model_field_problem(params: list) -> Problem:
    """Typos and impossible choices for model.arch(.hyper) keys, caught before any trial runs."""
    from ..model.config import GPTConfig, HyperConfig

    sections = {"model.arch.hyper.": HyperConfig, "model.arch.": GPTConfig}
    for p in params:
        for prefix, cls in sections.items():
            if not p.key.startswith(prefix):
                continue
            name = p.key[len(prefix) :]
            if "." in name:
                break
            hints = typing.get_type_hints(cls)
            known = [f.name for f in fields(cls)]
            if name not in known:
                return p.key, f"{cls.__name__} has no field {name!r}; fields: {known}"
            allowed = _literal_choices(hints[name])
            if allowed and p.type == "categorical":
                bad = [c for c in p.choices if c not in allowed]
                if bad:
                    return f"{p.key}.choices", f"{bad} not allowed; allowed values: {list(allowed)}"
            elif allowed:
                return f"{p.key}.type", f"must be categorical (allowed values: {list(allowed)})"
            break
    return None
