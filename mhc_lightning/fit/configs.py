"""Where the shipped configs are, and how they stack.

conf/base.yaml holds what every run shares (trainer, logger, checkpointing, data, model size); `mhc fit/validate/test`
read it as the parser's default config file, so every other config (quickstart.yaml, experiments/*, presets, machines)
holds only what it changes, and `mhc fit -c conf/quickstart.yaml` means base + quickstart. Passing `-c conf/base.yaml`
explicitly, as older commands do, changes nothing. An installed (non-editable) package carries a copy of conf/.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # mhc_lightning/


def conf_dir() -> Optional[Path]:
    """conf/ of the source tree this package runs from (editable install), else ./conf (e.g. the Docker image), else the
    copy an installed package carries (package data: pyproject.toml)."""
    for root in (PACKAGE_DIR.parent, Path.cwd(), PACKAGE_DIR):
        if (root / "conf" / "base.yaml").is_file():
            return root / "conf"
    return None


def default_config_files() -> list[str]:
    conf = conf_dir()
    return [str(conf / "base.yaml")] if conf is not None else []


def parser_kwargs(common: dict, run: bool, subcommands: Iterable[str]) -> dict:
    """LightningCLI parser_kwargs with base.yaml as the default config: per subcommand when the CLI has
    subcommands (run=True), else for the single parser."""
    defaults = {"default_config_files": default_config_files()}
    if not run:
        return {**common, **defaults}
    return {**common, **{sub: {**common, **defaults} for sub in subcommands}}
