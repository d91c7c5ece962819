"""Sweep files (`sweeps/*.yaml`): load and validate them into a `SweepSpec`.

A sweep file is plain YAML; every error names the field (``space.model.optim.lr.low``) and, where
there is a closed set, the allowed values. Nothing here imports torch or Lightning except the
model-config check, which only reads the dataclasses' field names and Literal choices.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import UserError
from ..names import path_name_problem, run_name_problem
from .key_checks import CALLBACK_PREFIX, cli_key_problem, model_field_problem, sinkhorn_key_problem

# sampler / pruner names of a sweep file -> the Optuna class each builds (factories.py)
SAMPLERS = {
    "tpe": "TPESampler",
    "random": "RandomSampler",
    "gp": "GPSampler",
    "nsga2": "NSGAIISampler",
    "nsga3": "NSGAIIISampler",
    "qmc": "QMCSampler",
    "cmaes": "CmaEsSampler",
    "bruteforce": "BruteForceSampler",
}
PRUNERS = {
    "none": "NopPruner",
    "median": "MedianPruner",
    "percentile": "PercentilePruner",
    "successive_halving": "SuccessiveHalvingPruner",
    "hyperband": "HyperbandPruner",
    "threshold": "ThresholdPruner",
    "patient": "PatientPruner",
    "wilcoxon": "WilcoxonPruner",
}
REDUCTIONS = ("last", "min", "max", "mean", "median")
DIRECTIONS = ("minimize", "maximize")
PARAM_TYPES = ("float", "int", "categorical")
LAUNCHERS = ("in_process", "subprocess")  # subprocess: the trial is a child `mhc fit` (e.g. a multi-process DDP run)
TOP_KEYS = (
    "name",
    "description",
    "base",
    "fixed",
    "space",
    "objectives",
    "sampler",
    "pruner",
    "budget",
    "storage",
    "mlflow",
    "enqueue",
    "trial",
)


class SpecError(UserError, ValueError):
    """A sweep file that cannot run; the message names the file and the field."""


@dataclass
class Param:
    key: str  # CLI key, e.g. model.arch.hyper.sinkhorn_iters, or callbacks.SinkhornScheduler.intensity
    type: str
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: Optional[list] = None
    when: dict[str, list] = field(default_factory=dict)  # sample only if these params took these values
    optional: bool = False  # for callbacks.*: drop the parameter if the callback class does not exist

    @property
    def is_callback(self) -> bool:
        return self.key.startswith(CALLBACK_PREFIX)

    def callback_parts(self) -> tuple[str, str]:
        cls, _, arg = self.key[len(CALLBACK_PREFIX) :].rpartition(".")
        return cls, arg


@dataclass
class Objective:
    metric: str
    direction: str = "minimize"
    reduce: str = "last"  # over the values seen during the trial (val/* at validation ends, others per step)

    @property
    def label(self) -> str:
        return self.metric if self.reduce == "last" else f"{self.metric}:{self.reduce}"


@dataclass
class SweepSpec:
    name: str
    path: Optional[Path]
    base: list[Path]
    fixed: dict[str, Any]
    space: list[Param]
    objectives: list[Objective]
    sampler: dict[str, Any]
    pruner: dict[str, Any]
    n_trials: int
    timeout_s: Optional[float]
    max_failed: int
    storage: dict[str, Any]
    mlflow: dict[str, Any]
    enqueue: list[dict[str, Any]]
    trial: dict[str, Any] = field(default_factory=lambda: {"launcher": "in_process", "args": [], "timeout_s": None})
    description: str = ""
    skipped: dict[str, str] = field(default_factory=dict)  # param key -> why it was dropped
    raw_text: str = ""

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.objectives]

    @property
    def multi_objective(self) -> bool:
        return len(self.objectives) > 1

    @property
    def pruning(self) -> bool:
        return self.pruner["name"] != "none"


# ---- loading ----------------------------------------------------------------------------------
def _err(where: str, msg: str) -> SpecError:
    return SpecError(f"{where}: {msg}")


def _raise_at(where: str, problem) -> None:
    """Raise a key check's problem (key_checks.py): a message, or (field under `where`, message)."""
    if isinstance(problem, tuple):
        raise _err(f"{where}.{problem[0]}", problem[1])
    if problem:
        raise _err(where, problem)


def _expect(where: str, value, types, what: str):
    types = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):  # True is an int
        raise _err(where, f"must be {what}, got {value!r}")
    return value


def _mapping(where: str, value, allowed: tuple[str, ...]) -> dict:
    value = {} if value is None else value
    _expect(where, value, dict, "a mapping")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise _err(where, f"unknown key(s) {unknown}; allowed keys: {list(allowed)}")
    return value


def _resolve_config(where: str, raw: str, spec_path: Optional[Path]) -> Path:
    """Relative paths: the current directory first, then the folder above the sweep file (the repo root for sweeps/)."""
    p = Path(os.path.expandvars(str(raw))).expanduser()
    candidates = [p] if p.is_absolute() else [Path.cwd() / p] + ([spec_path.parent.parent / p] if spec_path else [])
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise _err(where, f"config file {raw!r} not found (looked in: {', '.join(str(c) for c in candidates)})")


def load_spec(path, overrides: Optional[dict[str, Any]] = None) -> SweepSpec:
    """Read and validate a sweep file. `overrides` are extra fixed CLI values (`--set key=value`)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"sweep file {str(path)!r} not found")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from err
    spec = parse_spec(data, path, overrides)
    spec.raw_text = text
    return spec


def parse_spec(data: Any, path: Optional[Path] = None, overrides: Optional[dict[str, Any]] = None) -> SweepSpec:
    src = str(path) if path else "<sweep>"
    data = _mapping(src, data, TOP_KEYS)
    at = lambda key: f"{src}: {key}"  # noqa: E731

    name = data.get("name")
    check_study_name(at("name"), name)

    base_raw = data.get("base")
    if isinstance(base_raw, str):
        base_raw = [base_raw]
    if not isinstance(base_raw, list) or not base_raw:
        raise _err(at("base"), f"must be a list of config files from conf/ (at least one), got {base_raw!r}")
    base = [_resolve_config(at(f"base[{i}]"), b, path) for i, b in enumerate(base_raw)]

    fixed = dict(_expect(at("fixed"), data.get("fixed") or {}, dict, "a mapping of CLI keys to values"))
    fixed.update(overrides or {})
    for key in fixed:
        if not str(key).startswith(CALLBACK_PREFIX):  # fixed init args of a swept callback are fine too
            _raise_at(at(f"fixed.{key}"), cli_key_problem(key))

    space = _parse_space(at("space"), data.get("space"))
    _raise_at(at("space"), sinkhorn_key_problem(space, fixed, base))
    objectives = _parse_objectives(at("objectives"), data.get("objectives"))
    sampler = _parse_choice_block(
        at("sampler"), data.get("sampler") or {"name": "tpe"}, SAMPLERS, ("name", "seed", "options")
    )
    pruner = _parse_choice_block(at("pruner"), data.get("pruner") or {"name": "none"}, PRUNERS, ("name", "options"))
    if sampler.get("seed") is not None:
        _expect(at("sampler.seed"), sampler["seed"], int, "an integer (each worker adds its index) or null")
    if len(objectives) > 1 and pruner["name"] != "none":
        raise _err(
            at("pruner.name"),
            f"must be 'none' for a multi-objective study ({len(objectives)} objectives): "
            "Optuna does not prune multi-objective trials",
        )

    budget = _mapping(at("budget"), data.get("budget"), ("n_trials", "timeout_s", "max_failed"))
    n_trials = budget.get("n_trials", 20)
    _expect(at("budget.n_trials"), n_trials, int, "an integer >= 1 (COMPLETE + PRUNED trials in the whole study)")
    if n_trials < 1:
        raise _err(at("budget.n_trials"), f"must be >= 1, got {n_trials}")
    timeout_s = budget.get("timeout_s")
    if timeout_s is not None:
        _expect(at("budget.timeout_s"), timeout_s, (int, float), "a number of seconds per worker, or null")
        if timeout_s <= 0:
            raise _err(at("budget.timeout_s"), f"must be a number of seconds > 0 per worker, or null, got {timeout_s}")
    max_failed = budget.get("max_failed", max(3, n_trials // 2))
    _expect(at("budget.max_failed"), max_failed, int, "an integer >= 0")
    if max_failed < 0:
        raise _err(at("budget.max_failed"), f"must be an integer >= 0 (failed trials per launch), got {max_failed}")

    storage = _mapping(at("storage"), data.get("storage"), ("url", "heartbeat_interval", "grace_period", "max_retry"))
    storage = {"url": None, "heartbeat_interval": 30, "grace_period": 90, "max_retry": 2, **storage}
    for key in ("heartbeat_interval", "grace_period"):
        v = storage[key]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _err(at(f"storage.{key}"), f"must be an integer number of seconds >= 1, or null, got {v!r}")
    mlflow = _mapping(at("mlflow"), data.get("mlflow"), ("tracking_uri", "experiment", "log_model"))
    mlflow = {"tracking_uri": None, "experiment": name, "log_model": False, **mlflow}
    if mlflow["log_model"] not in (True, False, "all"):
        raise _err(at("mlflow.log_model"), f"must be one of [true, false, 'all'], got {mlflow['log_model']!r}")

    enqueue = data.get("enqueue") or []
    _expect(at("enqueue"), enqueue, list, "a list of {param: value} mappings")
    keys = {p.key: p for p in space}
    for i, point in enumerate(enqueue):
        _expect(at(f"enqueue[{i}]"), point, dict, "a mapping of space keys to values")
        for k, v in point.items():
            if k not in keys:
                raise _err(at(f"enqueue[{i}].{k}"), f"not a key of space; space keys: {sorted(keys)}")
            p = keys[k]
            if p.type == "categorical" and v not in p.choices:
                raise _err(at(f"enqueue[{i}].{k}"), f"{v!r} is not one of the choices {p.choices}")

    return SweepSpec(
        name=name,
        path=path,
        base=base,
        fixed=fixed,
        space=space,
        objectives=objectives,
        sampler=sampler,
        pruner=pruner,
        n_trials=n_trials,
        timeout_s=timeout_s,
        max_failed=max_failed,
        storage=storage,
        mlflow=mlflow,
        enqueue=enqueue,
        trial=_parse_trial(at("trial"), data.get("trial"), path),
        description=str(data.get("description") or ""),
    )


def check_study_name(where: str, name) -> None:
    """The study name names the workers' log folder (sweep_logs/<study>/): no spaces, nothing that leaves the folder."""
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
        raise _err(where, f"must be a non-empty string without spaces (the Optuna study name), got {name!r}")
    problem = path_name_problem(name)
    if problem:
        raise _err(where, f"{problem}: it names the folder of the workers' logs")
    problem = run_name_problem(f"{name}-t0000", " (its trials' runs are named <study>-tNNNN)")
    if problem:
        raise _err(where, problem)


def _parse_trial(where: str, raw, spec_path: Optional[Path]) -> dict[str, Any]:
    """How a trial runs: `launcher`, extra `mhc fit` `args` (after the base configs), and a `timeout_s` for a child."""
    trial = {
        "launcher": "in_process",
        "args": [],
        "timeout_s": None,
        **_mapping(where, raw, ("launcher", "args", "timeout_s")),
    }
    if trial["launcher"] not in LAUNCHERS:
        raise _err(f"{where}.launcher", f"{trial['launcher']!r} is not allowed; allowed values: {list(LAUNCHERS)}")
    args = trial["args"] or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise _err(f"{where}.args", f"must be a list of `mhc fit` arguments (strings), got {args!r}")
    # config files after -c / --config resolve like base: the current directory, else the repo root
    trial["args"] = [
        str(_resolve_config(f"{where}.args[{i}]", a, spec_path)) if i and args[i - 1] in ("-c", "--config") else a
        for i, a in enumerate(args)
    ]
    t = trial["timeout_s"]
    if t is not None:
        _expect(f"{where}.timeout_s", t, (int, float), "a number of seconds, or null")
        if t <= 0:
            raise _err(f"{where}.timeout_s", f"must be > 0, got {t}")
        if trial["launcher"] != "subprocess":
            raise _err(f"{where}.timeout_s", "only for launcher: subprocess (an in-process trial cannot be stopped)")
    return trial


def _parse_choice_block(where: str, block, allowed, keys: tuple[str, ...]) -> dict:
    if isinstance(block, str):
        block = {"name": block}
    block = dict(_mapping(where, block, keys))
    name = block.get("name")
    if name not in allowed:
        raise _err(f"{where}.name", f"{name!r} is not supported; allowed values: {list(allowed)}")
    block.setdefault("options", {})
    _expect(f"{where}.options", block["options"], dict, "a mapping of keyword arguments")
    return block


def _parse_objectives(where: str, raw) -> list[Objective]:
    raw = raw or [{"metric": "val/loss"}]
    _expect(where, raw, list, "a list of {metric, direction, reduce}")
    out = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        if isinstance(item, str):
            item = {"metric": item}
        item = _mapping(w, item, ("metric", "direction", "reduce"))
        if not isinstance(item.get("metric"), str):
            raise _err(
                f"{w}.metric",
                "required: a metric the LightningModule logs, e.g. val/loss, "
                "train/tokens_per_sec, amax/composite_fwd_max",
            )
        obj = Objective(
            item["metric"],
            item.get("direction", "minimize"),
            item.get("reduce", "last" if item["metric"].startswith("val/") else "median"),
        )
        if obj.direction not in DIRECTIONS:
            raise _err(f"{w}.direction", f"{obj.direction!r} is not allowed; allowed values: {list(DIRECTIONS)}")
        if obj.reduce not in REDUCTIONS:
            raise _err(f"{w}.reduce", f"{obj.reduce!r} is not allowed; allowed values: {list(REDUCTIONS)}")
        out.append(obj)
    labels = [o.label for o in out]
    if len(set(labels)) != len(labels):
        raise _err(where, f"duplicate objectives {labels}")
    return out


def _parse_space(where: str, raw) -> list[Param]:
    _expect(where, raw, dict, "a mapping of CLI keys (or callbacks.<Class>.<arg>) to distributions")
    if not raw:
        raise _err(where, "is empty: a sweep needs at least one parameter")
    params = []
    for key, d in raw.items():
        w = f"{where}.{key}"
        d = _mapping(w, d, ("type", "low", "high", "log", "step", "choices", "when", "optional"))
        t = d.get("type")
        if t not in PARAM_TYPES:
            raise _err(f"{w}.type", f"{t!r} is not allowed; allowed values: {list(PARAM_TYPES)}")
        for flag in ("log", "optional"):
            if flag in d:
                _expect(f"{w}.{flag}", d[flag], bool, "true or false")
        p = Param(
            key=key,
            type=t,
            log=d.get("log", False),
            step=d.get("step"),
            choices=d.get("choices"),
            when=d.get("when") or {},
            optional=d.get("optional", False),
        )
        if p.is_callback:
            cls, arg = p.callback_parts()
            if not cls or not arg or not all(part.isidentifier() for part in cls.split(".")) or not arg.isidentifier():
                raise _err(
                    w,
                    "callback parameters are written callbacks.<ClassName or dotted.class.Path>.<init_arg>, "
                    "e.g. callbacks.SinkhornScheduler.intensity",
                )
        else:
            _raise_at(w, cli_key_problem(key))
            if p.optional:
                raise _err(f"{w}.optional", "only callbacks.<Class>.<arg> parameters can be optional")
        if t == "categorical":
            if not isinstance(p.choices, list) or not p.choices:
                raise _err(
                    f"{w}.choices", f"a categorical parameter needs a non-empty list of choices, got {p.choices!r}"
                )
            for extra in ("low", "high", "step", "log"):
                if d.get(extra) not in (None, False):
                    raise _err(f"{w}.{extra}", "not used by a categorical parameter (give choices)")
            bad = [c for c in p.choices if c is not None and not isinstance(c, (bool, int, float, str))]
            if bad:
                raise _err(f"{w}.choices", f"{bad} not allowed: each choice must be a string, number, boolean or null")
        else:
            _check_numeric(w, t, d, p)
        _expect(f"{w}.when", p.when, dict, "a mapping of other space keys to lists of values")
        params.append(p)
    keys = {p.key: p for p in params}
    for p in params:
        for k, vals in p.when.items():
            w = f"{where}.{p.key}.when.{k}"
            if k not in keys or k == p.key:
                raise _err(w, f"must name another key of space; space keys: {sorted(keys)}")
            if not isinstance(vals, list):
                p.when[k] = vals = [vals]
            if keys[k].type == "categorical":
                bad = [v for v in vals if v not in keys[k].choices]
                if bad:
                    raise _err(w, f"{bad} not among the choices of {k}: {keys[k].choices}")
    # conditions must refer to parameters sampled earlier (define-by-run order = file order)
    order = [p.key for p in params]
    for p in params:
        for k in p.when:
            if order.index(k) > order.index(p.key):
                raise _err(f"{where}.{p.key}.when.{k}", f"{k} must be listed before {p.key} in space")
    _raise_at(where, model_field_problem(params))
    return params


def _check_numeric(w: str, t: str, d: dict, p: Param) -> None:
    """A float or int range as Optuna accepts it, so that no trial fails on its distribution: a sweep whose every
    trial raised in `suggest_*` used to run until killed."""
    integer = t == "int"
    num = (int,) if integer else (int, float)
    for bound in ("low", "high"):
        _expect(f"{w}.{bound}", d.get(bound), num, "an integer" if integer else "a finite number")
        if not math.isfinite(d[bound]):
            raise _err(f"{w}.{bound}", f"must be a finite number, got {d[bound]!r}")
    p.low, p.high = d["low"], d["high"]
    if not p.low <= p.high:
        raise _err(f"{w}.low", f"must be <= high, got low={p.low}, high={p.high}")
    if p.log and (p.low < 1 if integer else p.low <= 0):
        raise _err(f"{w}.low", f"must be {'>= 1' if integer else '> 0'} with log: true, got {p.low}")
    if p.step is not None:
        if p.log:
            raise _err(f"{w}.step", "cannot be combined with log: true")
        _expect(f"{w}.step", p.step, num, "an integer >= 1" if integer else "a number > 0")
        if not math.isfinite(p.step) or p.step <= 0:
            raise _err(f"{w}.step", f"must be {'an integer >= 1' if integer else 'a number > 0'}, got {p.step!r}")
    if p.choices is not None:
        raise _err(f"{w}.choices", f"only for categorical parameters (type is {t})")
    from optuna.distributions import FloatDistribution, IntDistribution

    try:  # the rules above are Optuna's; this catches any it adds
        if integer:
            IntDistribution(p.low, p.high, log=p.log, step=p.step or 1)
        else:
            FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    except ValueError as err:
        raise _err(w, f"Optuna rejects this distribution: {err}") from None
