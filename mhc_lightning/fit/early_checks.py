"""The checks of `mhc fit|validate|test` arguments that need neither torch nor Lightning, run by the `mhc` dispatcher
before it imports them (seconds, up to a minute on a small machine): a misspelt flag or config key, a missing or broken
`-c` file, a missing corpus file or folder (or one that is not text), a missing checkpoint, an evaluation without one.

The keys `mhc fit` knows are read from the source of the classes its parser is built from (Lightning's Trainer, LitLM
and its config dataclasses, the data module, the Utilization callback), with `ast`, not by importing them. The check
is never stricter than the parser: anything below a Trainer argument (loggers, callbacks, strategies) and
abbreviations of long options (argparse accepts them) pass here and are left to it. What the parser would refuse for
another reason (a value's type, a cross-field rule) is found after the imports, as before.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import yaml

from ..errors import UserError, one_line
from .configs import default_config_files
from .optimizer_options import refuse_optimizer_options

EVAL_COMMANDS = ("validate", "test")
# ckpt_path values that Lightning resolves itself at run time rather than paths to a file
CKPT_KEYWORDS = ("last", "best", "hpc")
CONFIG_FLAGS = ("-c", "--config")
PACKAGE = Path(__file__).resolve().parents[1]  # mhc_lightning/
# The parser's groups: the class each is built from, and that class's source under this package
GROUPS = {"model": "LitLM", "data": "ByteTextDataModule", "utilization": "Utilization"}
SOURCES = ("training/module.py", "model/config.py", "data/datamodule.py", "callbacks/utilization.py")
# Options LightningCLI and cli.py add besides the Trainer method's own arguments and the groups
TOP_LEVEL = (
    "help",
    "config",
    "print_config",
    "seed_everything",
    "trainer",
    "extend",
    "no_extend",
    "data_changed",
    "no_data_changed",
)
# The Trainer method's arguments LightningCLI fills itself (the model, the data)
FILLED = ("model", "datamodule", "dataloaders", "train_dataloaders", "val_dataloaders")
# Keys of a class given by path (jsonargparse): what follows is the parser's to check
CLASS_KEYS = ("class_path", "init_args", "dict_kwargs", "__path__")


class Keys:
    """The dotted keys of one subcommand's parser: `full` every key (groups included); `open` the keys whose value
    may hold further keys this check does not know (Trainer arguments: loggers, callbacks, strategies ...)."""

    def __init__(self, full: set[str], open_keys: set[str]):
        self.full, self.open = full, open_keys

    def known(self, key: str, abbreviated: bool) -> bool:
        key = key.rstrip("+")  # --trainer.callbacks+=...: appends to a list
        if key in self.full or any(key.startswith(f"{o}.") for o in self.open):
            return True
        return abbreviated and any(k.startswith(key) for k in self.full)  # argparse takes a unique prefix

    def closest(self, key: str) -> Optional[str]:
        close = difflib.get_close_matches(key.rstrip("+"), sorted(self.full), n=1, cutoff=0.75)
        return close[0] if close else None


def _type_name(annotation: Optional[ast.expr]) -> Optional[str]:
    if isinstance(annotation, ast.Name):
        return annotation.id
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value
    return None


def _params(cls: ast.ClassDef, method: str = "__init__") -> dict[str, Optional[str]]:
    """A method's parameters (a dataclass without `__init__`: its fields), each with its annotation's class name."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            args = node.args
            return {a.arg: _type_name(a.annotation) for a in [*args.args, *args.kwonlyargs] if a.arg != "self"}
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    return {n.target.id: _type_name(n.annotation) for n in fields if "ClassVar" not in ast.unparse(n.annotation)}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(path.read_text(encoding="utf-8")).body if isinstance(n, ast.ClassDef)}


@functools.cache
def parser_keys(subcommand: str) -> Optional[Keys]:
    """The keys `mhc <subcommand>` accepts; None where a source cannot be read (then only the parser checks)."""
    spec = importlib.util.find_spec("lightning")  # finds the package without importing it
    try:
        trainer = _classes(Path(spec.submodule_search_locations[0]) / "pytorch" / "trainer" / "trainer.py")["Trainer"]
        ours: dict[str, ast.ClassDef] = {}
        for source in SOURCES:
            ours.update(_classes(PACKAGE / source))
        groups = {group: ours[cls] for group, cls in GROUPS.items()}
    except (AttributeError, TypeError, OSError, SyntaxError, KeyError):
        return None
    full = {*TOP_LEVEL, *(name for name in _params(trainer, subcommand) if name not in FILLED)}
    open_keys = {f"trainer.{name}" for name in _params(trainer)}
    full |= open_keys

    def add(prefix: str, cls: ast.ClassDef) -> None:
        full.add(prefix)
        for name, type_name in _params(cls).items():
            key = f"{prefix}.{name}"
            add(key, ours[type_name]) if type_name in ours else full.add(key)

    for group, cls in groups.items():
        add(group, cls)
    return Keys(full, open_keys)


def _flags(args: list[str]) -> Iterator[tuple[str, Optional[str], str]]:
    """(key, value, the argument as given) for each `--key=value` / `--key value` / `-c FILE`; value None: a flag
    given without one."""
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in CONFIG_FLAGS or (arg.startswith("--") and "=" not in arg):
            takes = i < len(args) and (arg in CONFIG_FLAGS or not args[i].startswith(("--", "-c", "-h")))
            value = args[i] if takes else None
            i += takes
            yield ("config" if arg in CONFIG_FLAGS else arg[2:]), value, arg
        elif arg.startswith("--"):
            key, _, value = arg[2:].partition("=")
            yield key, value, arg


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def _set(into: dict, key: str, value: Any) -> None:
    *parents, last = key.rstrip("+").split(".")
    for part in parents:
        if not isinstance(into.get(part), dict):
            into[part] = {}
        into = into[part]
    if isinstance(value, dict) and isinstance(into.get(last), dict):
        _merge(into[last], value)
    else:
        into[last] = value


def load_config(path: str) -> Any:
    """A -c file's YAML; UserError naming the file, line and column where it is not valid YAML (jsonargparse reports
    a YAML error without saying which of the -c files it is in)."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as err:
        mark, started = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or one_line(err)
        if started and getattr(err, "context", None):
            problem += f", {err.context} that starts at line {started.line + 1}, column {started.column + 1}"
        raise UserError(f"config file {path}{where}: not valid YAML ({problem}); fix the file.") from err


def _config(value: str) -> dict:
    """A -c value: a YAML file, else inline YAML (as jsonargparse reads it); UserError for a file that is missing."""
    if Path(value).is_file():
        loaded = load_config(value)
        return loaded if isinstance(loaded, dict) else {}
    try:
        inline = yaml.safe_load(value)
    except yaml.YAMLError:
        inline = None
    if isinstance(inline, dict):
        return inline
    path = Path(value)
    siblings = sorted(p.name for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.75)
    hint = f" (did you mean {path.parent / close[0]}?)" if close else ""
    raise UserError(f"config file {value} does not exist{hint}; pass -c with the path of a YAML file (see conf/).")


def _config_keys(cfg: dict, prefix: str = "") -> Iterator[str]:
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not any(c in v for c in CLASS_KEYS):
            yield from _config_keys(v, f"{key}.") if v else [key]
        else:
            yield key


def check_checkpoint_given(subcommand: str, ckpt: Any) -> None:
    """validate / test evaluate a checkpoint: refuse them without --ckpt_path."""
    if ckpt is None and subcommand in EVAL_COMMANDS:
        raise UserError(
            f"{subcommand} evaluates a checkpoint: pass --ckpt_path <file.ckpt> "
            "(fit writes runs/<experiment id>/<run id>/checkpoints/last.ckpt)."
        )


def is_checkpoint_file(ckpt: Any) -> bool:
    """Whether a ckpt_path value names a local file (not Lightning's `last` / `best` / `hpc`, a registry or a URL)."""
    text = str(ckpt)
    return ckpt is not None and text not in CKPT_KEYWORDS and not text.startswith("registry") and "://" not in text


def check_checkpoint_keyword(ckpt: Any, root: Any) -> None:
    """Lightning's `best` names the best checkpoint of a fit that ran in the same process (never the case in `mhc`), and
    `hpc` its SLURM requeue checkpoint in default_root_dir: refuse them where there is none (not its traceback)."""
    if ckpt == "best":
        raise UserError(
            "--ckpt_path best: Lightning's best checkpoint of a fit run in the same process, which `mhc` never has; "
            "pass a checkpoint file (runs/<experiment id>/<run id>/checkpoints/...), or --ckpt_path last to continue "
            "the run the same command started"
        )
    folder = Path(str(root or "."))
    if ckpt == "hpc" and not any(folder.glob("hpc_ckpt_*.ckpt")):
        raise UserError(
            f"--ckpt_path hpc: no hpc_ckpt_<n>.ckpt (Lightning's SLURM requeue checkpoint) in trainer.default_root_dir "
            f"{folder}; pass a checkpoint file, or --ckpt_path last to continue the run the same command started"
        )


def check_checkpoint_exists(path: Path) -> None:
    if not path.exists():
        raise UserError(
            f"checkpoint {path} does not exist; pass --ckpt_path with the path of a .ckpt file "
            "(fit writes runs/<experiment id>/<run id>/checkpoints/last.ckpt)."
        )
    if not path.is_file():
        raise UserError(f"checkpoint {path} is a folder; pass --ckpt_path with a .ckpt file in it.")


def _resolved(cfg: dict, key: str) -> Any:
    for part in key.split("."):
        cfg = cfg.get(part) if isinstance(cfg, dict) else None
    return None if isinstance(cfg, str) and "${" in cfg else cfg  # an interpolation: the parser resolves it


def check_arguments(subcommand: str, args: list[str]) -> None:
    """Raise UserError for the first problem in `mhc <subcommand> ARGS` found without torch or Lightning."""
    if any(a in ("-h", "--help") for a in args):
        return
    refuse_optimizer_options(args)  # its own reason, before "unrecognized arguments"
    keys = parser_keys(subcommand)
    given: dict = {}
    for path in default_config_files():
        _merge(given, load_config(path) or {})
    for key, value, arg in _flags(args):
        if key == "config":
            cfg = _config(value) if value is not None else {}
            unknown = [k for k in _config_keys(cfg) if keys is not None and not keys.known(k, abbreviated=False)]
            if unknown:
                close = keys.closest(unknown[0])
                raise UserError(
                    f"config file {value}: unknown key {unknown[0]}{f' (did you mean {close}?)' if close else ''}; "
                    f"the keys: `mhc {subcommand} --help`"
                )
            _merge(given, cfg)
            continue
        if keys is not None and not keys.known(key, abbreviated=True):
            close = keys.closest(key)
            raise UserError(
                f"unrecognized arguments: {arg}{f' (did you mean --{close}?)' if close else ''} "
                f"(options: `mhc {subcommand} --help`)"
            )
        try:
            _set(given, key, yaml.safe_load(value) if value is not None else True)
        except yaml.YAMLError:
            _set(given, key, value)
    corpus = _resolved(given, "data.corpus")
    if isinstance(corpus, str):
        from ..data.corpus import SHAKESPEARE, corpus_files
        from ..data.shards import is_prepared

        if corpus != SHAKESPEARE["name"] and not is_prepared(corpus):  # shards: checked with their metadata later
            corpus_files(Path(corpus).expanduser(), bool(_resolved(given, "data.allow_binary")))
    ckpt = _resolved(given, "ckpt_path")
    check_checkpoint_given(subcommand, ckpt)
    check_checkpoint_keyword(ckpt, _resolved(given, "trainer.default_root_dir"))
    if is_checkpoint_file(ckpt):
        check_checkpoint_exists(Path(str(ckpt)))
