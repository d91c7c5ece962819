"""LightningCLI's `--optimizer` / `--lr_scheduler`, refused with one line that says where the optimizer is set.

LightningCLI would replace LitLM.configure_optimizers with the optimizer it builds from those keys: one parameter
group (weight decay on norms, biases and the HC coefficients too) and no warmup-cosine schedule, with only a warning.
`mhc` builds its CLI without them (auto_configure_optimizers=False); this check turns the parser's "unrecognized
arguments" into the reason and the keys to use instead, for flags and for -c files alike.
"""

from __future__ import annotations

from typing import Optional

import yaml

from ..errors import UserError

REFUSED = ("optimizer", "lr_scheduler")
INSTEAD = (
    "the optimizer is AdamW with weight-decay groups (none on norms, biases, HC coefficients) and a linear "
    "warmup then cosine schedule, set by model.optim.lr, weight_decay, betas, eps, warmup_steps, min_lr_ratio, "
    "fused (README, Config reference)"
)


class RefusedOption(UserError):
    """--optimizer / --lr_scheduler given; the message names the keys that set the optimizer instead."""


def _flag_key(arg: str) -> Optional[str]:
    if not arg.startswith("--"):
        return None
    key = arg[2:].partition("=")[0].split(".")[0].rstrip("+")
    return key if key in REFUSED else None


def _config_key(path: str) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return None  # not a file, or broken YAML: reported elsewhere
    if not isinstance(cfg, dict):
        return None
    for section in (cfg, *(v for k, v in cfg.items() if k in ("fit", "validate", "test") and isinstance(v, dict))):
        for key in REFUSED:
            if key in section:
                return key
    return None


def refuse_optimizer_options(args: list[str]) -> None:
    """Raise RefusedOption if `args` (an `mhc fit|validate|test` command line) set --optimizer or --lr_scheduler,
    as a flag or in a -c file."""
    for i, arg in enumerate(args):
        key = _flag_key(arg)
        if key is not None:
            raise RefusedOption(f"--{key} is not an option of mhc: {INSTEAD}")
        path = (
            args[i + 1]
            if arg in ("-c", "--config") and i + 1 < len(args)
            else (arg.partition("=")[2] if arg.startswith("--config=") else None)
        )
        key = _config_key(path) if path else None
        if key is not None:
            raise RefusedOption(f"`{key}:` in {path} is not an option of mhc: {INSTEAD}")
