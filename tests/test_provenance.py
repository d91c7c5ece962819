"""Run provenance (mhc_lightning/provenance.py, callbacks/run_provenance.py): the code, environment, data and settings
every run records, wherever it was started from."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import mlflow
import pytest
from helpers import tiny_fit

from mhc_lightning import provenance
from mhc_lightning.callbacks.run_provenance import RunProvenance, weights_digest
from mhc_lightning.loggers import ResilientMLFlowLogger

REPO = Path(__file__).resolve().parents[1]


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


def _repo(path: Path) -> Path:
    path.mkdir()
    _git(path, "init", "-q")
    (path / "pkg").mkdir()
    (path / "pkg" / "a.py").write_text("x = 1\n")
    (path / ".gitignore").write_text("ignored/\n")
    _git(path, "add", ".")
    _git(path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    return path


def test_code_state_follows_the_checkout_not_the_working_directory(tmp_path, monkeypatch):
    root = _repo(tmp_path / "repo")
    monkeypatch.chdir(tmp_path)  # outside the checkout
    clean = provenance.code_state.__wrapped__(root / "pkg")
    assert clean.commit == _git(root, "rev-parse", "HEAD") and clean.dirty is False and clean.label == clean.commit[:9]
    (root / "ignored").mkdir()
    (root / "ignored" / "out.db").write_text("runs write here")
    assert provenance.code_state.__wrapped__(root / "pkg").dirty is False  # ignored files are not code
    (root / "pkg" / "a.py").write_text("x = 2\n")
    edited = provenance.code_state.__wrapped__(root / "pkg")
    assert edited.dirty and "+x = 2" in edited.diff and edited.label == f"{clean.commit[:9]}+{edited.diff_sha256[:8]}"
    (root / "pkg" / "b.py").write_text("y = 1\n")
    more = provenance.code_state.__wrapped__(root / "pkg")
    assert more.dirty and more.diff_sha256 != edited.diff_sha256 and "# untracked: pkg/b.py" in more.diff
    for secret in (root / ".env", root / "pkg" / ".env.local"):  # not ignored here: still never digested
        secret.write_text("POSTGRES_PASSWORD=hunter2\n")
    assert provenance.code_state.__wrapped__(root / "pkg") == more
    alone = tmp_path / "installed"
    alone.mkdir()
    assert provenance.code_state.__wrapped__(alone) == provenance.CodeState("unknown", None)


def test_params_take_the_names_mhc_fit_takes():
    """The module's and the datamodule's hyperparameters, told apart by name, and old stores' names read alike."""
    import inspect

    from mhc_lightning import ByteTextDataModule, LitLM
    from mhc_lightning.loggers.param_names import DATA_KEYS, MODEL_KEYS, cli_name, cli_params

    assert set(MODEL_KEYS) == set(inspect.signature(LitLM).parameters)
    assert set(DATA_KEYS) == set(inspect.signature(ByteTextDataModule).parameters)
    logged = cli_params({"arch": {"hyper": {"residual_mode": "hc"}}, "corpus": "x", "_instantiator": "i", "seed": 3})
    assert logged == {"model.arch.hyper.residual_mode": "hc", "data.corpus": "x", "data.seed": 3}
    old = ("arch/hyper/residual_mode", "optim/lr", "trainer/max_steps", "data/seed", "seed", "seed_everything")
    assert [cli_name(k) for k in old] == [
        "model.arch.hyper.residual_mode",
        "model.optim.lr",
        "trainer.max_steps",
        "data.seed",
        "data.seed",
        "seed_everything",
    ]
    assert cli_name("model.arch.n_layers") == "model.arch.n_layers"


# What `mhc` and `mlflow ui` write where they run; none of it is code
RUNTIME_SAMPLES = (
    "mlflow.db",
    "mlflow.db-journal",
    "mlflow.db-wal",
    "mlflow.db-shm",
    "sweeps.db-journal",
    "study.journal.log",
    "mlflow_spool/run.jsonl",
    "mlruns/0/meta.yaml",
    "runs/1/0123/checkpoints/last.ckpt",
    "grid_logs/mhc-seed0.log",
    "reports/quickstart/report.md",
)


def test_the_platforms_own_runtime_files_never_make_a_run_dirty(tmp_path):
    """A clean checkout whose .gitignore knows none of them, with a store another process is writing: not dirty."""
    root = _repo(tmp_path / "repo")
    for name in RUNTIME_SAMPLES:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"written at run time")
    state = provenance.code_state.__wrapped__(root / "pkg")
    assert state.dirty is False and state.diff_sha256 == "" and state.label == state.commit[:9]
    (root / "pkg" / "reports").mkdir()
    (root / "pkg" / "reports" / "plots.py").write_text("code = True\n")  # code, though in a folder named reports
    assert provenance.code_state.__wrapped__(root / "pkg").diff.endswith("# untracked: pkg/reports/plots.py\n")
    ignored = _git(REPO, "check-ignore", "--no-index", *RUNTIME_SAMPLES).splitlines()
    assert ignored == list(RUNTIME_SAMPLES)  # and this checkout's .gitignore keeps them out of `git add -A`


def test_environment_names_the_libraries():
    env = provenance.environment()
    assert env["torch"] != "absent" and env["lightning"] != "absent" and env["gpu"] == "none"
    assert set(provenance.LIBRARIES) <= set(env)


def _run(uri: str, run_id: str):
    return mlflow.MlflowClient(uri).get_run(run_id)


def test_weights_digest_takes_scalar_parameters():
    """HC's s_alpha / s_beta are 0-dim: every HC fit crashed at its end on `view(torch.uint8)`."""
    import torch

    from mhc_lightning.model import GPTConfig, HyperConfig
    from mhc_lightning.model.gpt import GPT

    model = GPT(GPTConfig(n_layers=1, d_model=16, n_heads=2, context=8, hyper=HyperConfig(residual_mode="hc")))
    assert any(p.dim() == 0 for p in model.parameters())
    digest = weights_digest(model)
    with torch.no_grad():
        next(p for p in model.parameters() if p.dim() == 0).add_(1.0)
    assert weights_digest(model) != digest


def test_every_run_records_code_environment_data_and_settings(tiny_corpus, mlflow_uri, tmp_path):
    provenance.code_state.cache_clear()  # read the checkout now: it may have changed since this process read it
    provenance.run_code.cache_clear()
    logger = ResilientMLFlowLogger(experiment_name="prov", tracking_uri=mlflow_uri)
    trainer, module = tiny_fit(
        tiny_corpus,
        [RunProvenance()],
        steps=2,
        logger=logger,
        seed=3,
        data_seed=None,
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
        precision="32-true",
        default_root_dir=tmp_path,
    )
    run = _run(mlflow_uri, logger.run_id)
    tags, params = run.data.tags, run.data.params
    code = provenance.run_code()
    assert tags["mhc.git.commit"] == code.commit
    assert tags["mhc.code.sha256"] == code.sources_sha256 and len(code.sources_sha256) == 64
    assert tags["mhc.git.dirty"] == str(code.dirty).lower() and tags["mhc.code"] == code.label
    assert tags["mhc.weights_sha256"] == weights_digest(module)
    if code.commit != "unknown" and (REPO / ".git").exists():
        assert code.commit == _git(REPO, "rev-parse", "HEAD")
        assert code.dirty == bool(_git(REPO, "status", "--porcelain"))
    for lib in ("python", "torch", "triton", "lightning", "mlflow", "cuda", "gpu"):
        assert tags[f"mhc.env.{lib}"]
    dm = trainer.datamodule
    train = tiny_corpus.read_bytes()[: dm.train_bytes]
    assert tags["mhc.data.train_sha256"] == hashlib.sha256(train).hexdigest()
    assert tags["mhc.data.seed_source"] == "seed_everything"
    assert params["seed_everything"] == "3" and params["data.seed"] == "3"
    assert params["trainer.precision"] == "32-true" and params["trainer.accumulate_grad_batches"] == "2"
    assert params["trainer.gradient_clip_val"] == "0.5" and params["trainer.max_steps"] == "2"
    assert params["trainer.devices"] == "1" and params["trainer.strategy"] == "SingleDeviceStrategy"
    assert params["trainer.log_every_n_steps"] and params["trainer.max_time"] == "None"
    assert params["trainer.limit_val_batches"] and params["trainer.val_check_interval"]
    # the module's and datamodule's hyperparameters under their `mhc fit` names, without LightningCLI's internals
    assert params["model.arch.n_layers"] and params["data.batch_size"] and params["model.optim.lr"]
    assert not any(k.startswith(("arch/", "_")) or "/" in k for k in params)
    artifacts = {a.path for a in mlflow.MlflowClient(mlflow_uri).list_artifacts(logger.run_id, "provenance")}
    assert "provenance/environment.json" in artifacts
    assert any(p.endswith(".diff") for p in artifacts) == bool(code.dirty and not code.unknown_because)


def test_a_resumed_run_keeps_the_history_of_its_code_and_settings(
    tiny_corpus, mlflow_uri, tmp_path, monkeypatch, capsys
):
    """The second part runs code no checkout tells (the Docker image: no git): it says so in one line and is labelled
    by the digest of its sources, never as a bare "unknown" that would pool with other such runs."""
    first = ResilientMLFlowLogger(experiment_name="prov", tracking_uri=mlflow_uri)
    tiny_fit(tiny_corpus, [RunProvenance()], steps=1, logger=first, default_root_dir=tmp_path)
    other = provenance.CodeState("unknown", None, sources_sha256="e" * 64, unknown_because="no git checkout around /x")
    monkeypatch.setattr("mhc_lightning.callbacks.run_provenance.run_code", lambda: other)
    again = ResilientMLFlowLogger(experiment_name="prov", tracking_uri=mlflow_uri, run_id=first.run_id)
    capsys.readouterr()
    with pytest.warns(UserWarning, match="trainer.max_steps was 1, now 2"):
        tiny_fit(tiny_corpus, [RunProvenance()], steps=2, logger=again, default_root_dir=tmp_path)
    said = [ln for ln in capsys.readouterr().err.splitlines() if "not one commit's" in ln]
    assert len(said) == 1 and "no git checkout around /x" in said[0] and "src:eeeeeeeeeeee" in said[0]
    tags, params = (lambda r: (r.data.tags, r.data.params))(_run(mlflow_uri, first.run_id))
    before = provenance.run_code()
    assert tags["mhc.git.commit"] == f"{before.commit},unknown" and other.label == "src:" + "e" * 12
    assert tags["mhc.code"] == f"{before.label},{other.label}"
    assert tags["mhc.code.sha256"] == f"{before.sources_sha256},{'e' * 64}"
    assert tags["mhc.code.unknown_because"] == "no git checkout around /x"
    assert params["trainer.max_steps"] == "1" and tags["mhc.changed_on_resume.trainer.max_steps"] == "1 -> 2"


def test_code_without_one_checkout_is_named_by_its_sources(tmp_path, monkeypatch):
    """No git (an installed copy, the Docker image), or kernels from another tree than the package: the code is the
    digest of the files imported, which follows every byte of either tree."""
    pkg, kernels = tmp_path / "pkg", tmp_path / "kernels"
    for folder in (pkg, kernels):
        folder.mkdir()
        (folder / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(provenance, "PACKAGE_DIR", pkg)
    monkeypatch.setattr(provenance, "kernels_dir", lambda: kernels)
    read_checkout = provenance.code_state.__wrapped__
    monkeypatch.setattr(provenance, "code_state", lambda: provenance.CodeState("unknown", None))
    built = tmp_path / "COMMIT"
    built.write_text("abcdef1234567890\n")
    monkeypatch.setenv(provenance.BUILD_COMMIT_ENV, str(built))
    code = provenance.run_code.__wrapped__()
    assert code.label == f"src:{code.sources_sha256[:12]}" and "image built from commit abcdef123456" in (
        code.unknown_because
    )
    (kernels / "a.py").write_text("x = 2\n")
    assert provenance.run_code.__wrapped__().sources_sha256 != code.sources_sha256
    root = _repo(tmp_path / "repo")  # a clean checkout whose kernels are not the ones imported
    monkeypatch.setattr(provenance, "code_state", lambda: read_checkout(root / "pkg"))
    split = provenance.run_code.__wrapped__()
    assert split.commit == _git(root, "rev-parse", "HEAD") and "outside the checkout" in split.unknown_because
    assert split.label.startswith("src:")
