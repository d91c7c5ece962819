"""What a run ran: the code (commit, dirty flag, a digest of the uncommitted change), the software and hardware, and
the settings that change results. Read once per process; `callbacks/run_provenance.py` writes it into every run.

The code is located from this package's own files, not from the command line or the working directory: MLflow's
guess (`mlflow.source.git.commit`, from `sys.argv[0]`) records nothing when the `mhc` entry point lives in a venv
outside the checkout, in Docker or in conda, and a wrong commit when the checkout holds uncommitted code. Where no
one checkout holds the code that runs (no git: an installed copy, the Docker image; or the kernels imported from
another tree than the package), the run is labelled by a digest of the package's and the kernels' own source files
instead, so that such runs are never pooled as one "unknown" code state.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

PACKAGE_DIR = Path(__file__).resolve().parent
UNKNOWN = "unknown"
# The Docker image writes the commit it was built from into this file (Dockerfile, build arg GIT_COMMIT).
BUILD_COMMIT_ENV = "MHC_BUILD_COMMIT_FILE"
# The libraries whose versions can change a result; a missing one is recorded as absent.
LIBRARIES = ("torch", "triton", "lightning", "mlflow", "optuna", "numpy")
# What the platform writes where it runs (stores and their SQLite journals, the spool, checkpoints, logs, reports) is
# not code: it never makes a checkout dirty, whatever the checkout's .gitignore says (another process writing
# mlflow.db-journal would give each run a random diff digest). Git pathspec globs from the checkout's top.
RUNTIME_FILES = (
    "**/*.db",
    "**/*.db-journal",
    "**/*.db-wal",
    "**/*.db-shm",
    "**/*.journal.log*",
    "**/mlflow_spool/**",
    "**/mlruns/**",
    "**/mlartifacts/**",
    "**/runs/**",
    "**/lightning_logs/**",
    "**/checkpoints/**",
    "**/grid_logs/**",
    "reports/**",
)
_NOT_RUNTIME = (".", *(f":(exclude,glob){pattern}" for pattern in RUNTIME_FILES))


# Files that hold secrets (docker compose's .env): never in the digest or the diff artifact, tracked or not, ignored
# or not (a digest of a password file invites offline guessing).
SECRET_FILES = (":(glob,exclude)**/.env*",)


@dataclass(frozen=True)
class CodeState:
    """commit: HEAD of the checkout this package is imported from (UNKNOWN for an installed copy or without git);
    dirty: whether tracked files differ from it or untracked, non-ignored files exist, RUNTIME_FILES aside (None:
    unknown);
    diff_sha256: digest of that difference (the `git diff HEAD` bytes, then each untracked file's name and bytes);
    diff: the difference as text, kept with the run so that the code can be rebuilt."""

    commit: str
    dirty: Optional[bool]
    diff_sha256: str = ""
    diff: str = ""
    checkout: str = ""
    sources_sha256: str = ""  # the package's and the kernels' .py files (source_digest)
    unknown_because: str = ""  # set when the checkout does not tell the code that runs

    @property
    def label(self) -> str:
        """commit[:9], with '+<digest[:8]>' when dirty: two runs of one label ran the same code. Where no checkout
        tells the code, 'src:' and the sources' digest."""
        if self.commit == UNKNOWN or self.unknown_because:
            return f"src:{self.sources_sha256[:12]}" if self.sources_sha256 else UNKNOWN
        return self.commit[:9] + (f"+{self.diff_sha256[:8]}" if self.dirty else "")


def _git(root: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=True, timeout=60).stdout


@functools.cache
def code_state(start: Path = PACKAGE_DIR) -> CodeState:
    """The code behind `start` (this package by default); cached: one read per process."""
    if shutil.which("git") is None:
        return CodeState(UNKNOWN, None)
    try:
        root = Path(_git(start, "rev-parse", "--show-toplevel").decode().strip())
        commit = _git(root, "rev-parse", "HEAD").decode().strip()
    except (subprocess.SubprocessError, OSError):
        return CodeState(UNKNOWN, None)  # an installed copy: no checkout around it
    try:
        diff = _git(root, "diff", "HEAD", "--binary", "--", *_NOT_RUNTIME, *SECRET_FILES)
        listed = _git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", *_NOT_RUNTIME, *SECRET_FILES)
        untracked = [p for p in listed.split(b"\0") if p]
    except (subprocess.SubprocessError, OSError):
        return CodeState(commit, None, checkout=str(root))
    digest = hashlib.sha256(diff)
    listing = []
    for name in sorted(untracked):
        path = root / name.decode(errors="surrogateescape")
        digest.update(b"\0untracked\0" + name + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            pass  # vanished or unreadable: its name still counts
        listing.append(name.decode(errors="replace"))
    dirty = bool(diff) or bool(untracked)
    text = diff.decode(errors="replace")
    if listing:
        text += "".join(f"# untracked: {name}\n" for name in listing)
    return CodeState(commit, dirty, digest.hexdigest() if dirty else "", text if dirty else "", str(root))


def kernels_dir() -> Path:
    """Where `mhc_lightning.kernels` is imported from (the top-level kernels/ folder of an install, mapped in)."""
    spec = importlib.util.find_spec("mhc_lightning.kernels")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def source_digest(dirs: tuple[tuple[str, Path], ...]) -> str:
    """sha256 over every .py file under each (name, folder): its name under `name`, then its bytes."""
    digest = hashlib.sha256()
    for name, folder in dirs:
        for path in sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts):
            digest.update(f"\0{name}/{path.relative_to(folder).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def build_commit() -> str:
    """The commit the Docker image was built from ('' outside the image or when the build did not say)."""
    path = os.environ.get(BUILD_COMMIT_ENV)
    try:
        commit = Path(path).read_text().strip() if path else ""
    except OSError:
        return ""
    return "" if commit in ("", UNKNOWN) else commit


@functools.cache
def run_code() -> CodeState:
    """The code this process runs: the package's checkout (code_state), with the digest of the sources that are
    imported, and why that checkout does not tell the code where it does not (no git; kernels from another tree,
    whose changes the checkout's diff would misstate)."""
    code, kernels = code_state(), kernels_dir()
    sources = source_digest((("mhc_lightning", PACKAGE_DIR), ("mhc_lightning.kernels", kernels)))
    why = ""
    if code.commit == UNKNOWN:
        built = build_commit()
        why = f"no git checkout around {PACKAGE_DIR}" + (f" (image built from commit {built[:12]})" if built else "")
    elif not kernels.is_relative_to(Path(code.checkout).resolve()):
        why = f"the kernels are imported from {kernels}, outside the checkout {code.checkout}"
    return replace(code, sources_sha256=sources, unknown_because=why)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def environment(device: Optional[torch.device] = None) -> dict[str, str]:
    """Versions of Python and the libraries in LIBRARIES, the mhc_lightning install, CUDA, and the GPU in use."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "mhc_lightning": _version("mhc-lightning"),
        **{name: _version(name) for name in LIBRARIES},
        "torch_build": torch.__version__,
    }
    env["cuda"] = torch.version.cuda or "none"
    if device is not None and device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_count"] = str(torch.cuda.device_count())
        env["cudnn"] = str(torch.backends.cudnn.version())
    else:
        env["gpu"] = "none"
    return env
