"""A non-editable install gets the defaults a checkout has: the wheel carries conf/ as package data, and an installed
package reads its own copy of conf/base.yaml where neither a checkout nor the current folder has one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from helpers import REPO

import mhc_lightning.fit.configs as configs


def test_the_wheel_carries_the_shipped_configs(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("mhc_lightning", "kernels", "conf"):  # a copy: the build writes build/ beside the sources
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"mhc_lightning/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    assert "mhc_lightning/conf/base.yaml" in names and shipped <= names


def test_an_installed_package_reads_its_own_conf(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "mhc_lightning"
    (package / "conf").mkdir(parents=True)
    (package / "conf" / "base.yaml").write_text("trainer: {max_steps: 5000}\n")
    monkeypatch.setattr(configs, "PACKAGE_DIR", package)
    monkeypatch.chdir(tmp_path)
    assert configs.default_config_files() == [str(package / "conf" / "base.yaml")]
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "base.yaml").write_text("trainer: {max_steps: 10}\n")  # the current folder's comes first
    assert configs.default_config_files() == [str(tmp_path / "conf" / "base.yaml")]
