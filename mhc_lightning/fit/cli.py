"""`mhc fit|validate|test`: the LightningCLI. The `mhc` command itself (help, the tools) is mhc_lightning/commands.py,
which imports this module only for these three commands: Lightning costs seconds to import.

A problem the user can fix (a UserError, a parser error, a broken YAML file) is printed as one line,
`mhc <command>: error: ...`, with exit status 2 and no traceback.
"""

import signal
import sys
import warnings
from argparse import ArgumentError
from typing import Optional

from jsonargparse import ActionYesNo, set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.environments import SLURMEnvironment

from ..callbacks.divergence import EXIT_DIVERGED, DivergenceGuard, TrainingDiverged
from ..callbacks.final_validation import FinalValidation
from ..callbacks.graceful_stop import GracefulStop
from ..callbacks.per_layer_artifacts import PerLayerArtifacts
from ..callbacks.progress_lines import ProgressLines
from ..callbacks.run_provenance import RunProvenance
from ..callbacks.system_metrics import SystemMetrics
from ..callbacks.utilization import Utilization
from ..commands import TOOLS, TRAINER_COMMANDS, Tool, fail, main, overview  # noqa: F401 (`mhc`, as before)
from ..data import ByteTextDataModule
from ..errors import UserError, one_line
from ..loggers.credentials import take_credentials
from ..loggers.mlflow_runs import announce_run, label_runs, mlflow_logger_configs
from ..loggers.save_config import MLflowSaveConfig
from ..model import GPTConfig, HyperConfig
from ..training.checkpoint_io import CheckpointWriteError, use_verified_checkpoints
from ..training.module import LitLM, OptimConfig, check_compile, check_fused
from .configs import parser_kwargs
from .input_checks import check_inputs, schedule_warnings
from .interrupts import finish
from .quiet import silence_known_noise
from .resume import check_resume, resolve_last, resolve_requeued, resume_command


def _plain(ns) -> dict:
    return ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)


def validate_model_config(model_cfg) -> dict:
    """Build the config dataclasses once; their errors get the full CLI key as prefix. Returns them by CLI prefix."""
    arch = _plain(model_cfg.arch)
    hyper = _plain(arch.pop("hyper"))
    built = {}
    for prefix, build in (
        ("model.arch.hyper", lambda: HyperConfig(**hyper)),
        ("model.arch", lambda: GPTConfig(**arch, hyper=built["model.arch.hyper"])),
        ("model.optim", lambda: OptimConfig(**_plain(model_cfg.optim))),
    ):
        try:
            built[prefix] = build()
        except (ValueError, TypeError) as err:
            raise ValueError(f"{prefix}.{err}") from err
    if model_cfg.diagnostics_every < 0:
        raise ValueError(f"model.diagnostics_every must be >= 0 (0 = off), got {model_cfg.diagnostics_every}")
    check_compile(built["model.arch"], bool(model_cfg.compile), model_cfg.compile_mode)
    return built


class MHCLightningCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in TRAINER_COMMANDS}

    def add_arguments_to_parser(self, parser) -> None:
        # The corpus decides the vocabulary (bytes: 256); the model must agree, so link rather than repeat.
        parser.link_arguments("data.vocab_size", "model.arch.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.arch.context")
        # MFU and peak memory in every run; --utilization.peak_flops sets the device's peak where no table knows it
        parser.add_lightning_class_args(Utilization, "utilization")
        parser.add_argument(
            "--extend",
            action=ActionYesNo,
            default=False,
            help="fit --ckpt_path: continue the run to another trainer.max_steps, the cosine going on "
            "from the lr reached to its minimum at the new last step (refused without it)",
        )
        parser.add_argument(
            "--data_changed",
            action=ActionYesNo,
            default=False,
            help="fit continuing a run (--ckpt_path last): the data changed on purpose since the run read it "
            "(refused without it); the run's data tags keep both digests",
        )

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # Cross-field rules (d_model % n_heads, ranges) live in the dataclasses' __post_init__; run them now
        # so a bad value fails at parse time, with the field named, before any data or model is built.
        sub = self.config.get("subcommand")
        cfg = self.config.get(sub) if sub else self.config
        try:
            hyper = validate_model_config(cfg.model)["model.arch.hyper"]
            check_fused(cfg.model.optim.fused, cfg.trainer.precision)
        except (ValueError, TypeError) as err:
            (self._subcommand_parsers[sub] if sub else parser).error(f"invalid model configuration: {err}")
        ignored = hyper.spec.ignored_settings(hyper) if sub == "fit" else {}
        if ignored:
            keys = ", ".join(f"model.arch.hyper.{k}={v}" for k, v in ignored.items())
            print(f"mhc fit: residual_mode={hyper.residual_mode} has no Sinkhorn: ignoring {keys}", file=sys.stderr)
        # Inputs are checked here, not later: Lightning next replaces the model config by the checkpoint's
        # hyperparameters, and the loggers (which create the MLflow run) do not exist yet. `--ckpt_path last` first
        # becomes the earlier run's own checkpoint (resume.py), so that it is checked like any other.
        for logger in mlflow_logger_configs(cfg.trainer.get("logger")) if sub else []:
            logger.init_args.tracking_uri = take_credentials(logger.init_args.get("tracking_uri"))
        resumed = resolve_last(self.config, sub) or resolve_requeued(self.config, sub)
        self.checkpoint_info = check_inputs(sub, cfg) if sub else None
        if sub == "fit" and self.checkpoint_info is not None:
            check_resume(cfg, self.checkpoint_info, resumed)  # the same budget, or --extend; says the step
        elif sub == "fit" and cfg.get("ckpt_path") is None:
            model = cfg.model
            for line in schedule_warnings(
                int(cfg.trainer.max_steps or -1),
                model.optim.warmup_steps,
                model.diagnostics_every,
                model.arch.hyper.residual_mode,
            ):
                print(f"mhc fit: warning: {line}", file=sys.stderr, flush=True)

    def before_instantiate_classes(self) -> None:
        if self.subcommand:
            ckpt = self.checkpoint_info
            label_runs(
                self.config[self.subcommand].trainer.get("logger"),
                self.subcommand,
                ckpt.source_run_id if ckpt else None,
                str(ckpt.path.resolve()) if ckpt else None,
            )

    def instantiate_trainer(self, **kwargs):
        trainer = super().instantiate_trainer(**kwargs)
        use_verified_checkpoints(trainer)  # written whole, with a digest that is checked before a resume
        environment = trainer._accelerator_connector.cluster_environment  # what Lightning's signal handling reads
        if isinstance(environment, SLURMEnvironment):
            # Its requeue saves hpc_ckpt_<n>.ckpt in default_root_dir, often shared by jobs, and any later fit there
            # restores it in a new run. The fit requeues itself instead (GracefulStop), and the requeued job resumes
            # only the run tagged with its job id (resume.resolve_requeued).
            if environment.auto_requeue:
                for cb in trainer.callbacks:
                    if isinstance(cb, GracefulStop):
                        cb.requeue_signal = environment.requeue_signal
            environment.auto_requeue = False
        return trainer

    def after_fit(self) -> None:
        announce_run(self.trainer, "fit")

    def after_validate(self) -> None:
        announce_run(self.trainer, "val")

    def after_test(self) -> None:
        announce_run(self.trainer, "test")


def build_cli(
    args: Optional[list[str]] = None,
    run: bool = True,
    exit_on_error: bool = True,
    cli_class: type = MHCLightningCLI,
    **kwargs,
) -> MHCLightningCLI:
    """The project's LightningCLI, with conf/base.yaml as every subcommand's default config (configs.py).
    exit_on_error=False: parser errors raise ArgumentError instead of printing the usage and exiting (`main`
    prints them as one line)."""
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    silence_known_noise()
    kwargs.setdefault("save_config_callback", MLflowSaveConfig)
    # no --optimizer / --lr_scheduler: they would replace LitLM's decay groups and schedule (optimizer_options.py)
    kwargs.setdefault("auto_configure_optimizers", False)
    defaults = dict(kwargs.pop("trainer_defaults", None) or {})
    given = defaults.get("callbacks") or []
    defaults["callbacks"] = [
        FinalValidation(),
        PerLayerArtifacts(),
        RunProvenance(),
        SystemMetrics(),
        ProgressLines(),
        GracefulStop(),
        DivergenceGuard(),
        *(given if isinstance(given, list) else [given]),
    ]
    pk = parser_kwargs(
        {"parser_mode": "omegaconf+", "default_env": False, "exit_on_error": exit_on_error}, run, TRAINER_COMMANDS
    )
    pk["prog"] = "mhc"
    for name, text in TRAINER_COMMANDS.items():
        if run:
            pk[name] = {**pk.get(name, {}), "description": text}
    return cli_class(
        LitLM,
        ByteTextDataModule,
        parser_kwargs=pk,
        trainer_defaults=defaults,
        args=args,
        run=run,
        **kwargs,
    )


def parser_message(err: ArgumentError) -> str:
    """jsonargparse's (often nested, multi-line) message reduced to one line: the key and the innermost reasons."""
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    if len(lines) <= 1:
        return one_line(str(err))
    depth = max(len(ln) - len(ln.lstrip()) for ln in lines[1:])
    reasons = [ln.strip().lstrip("- ") for ln in lines[1:] if len(ln) - len(ln.lstrip()) == depth]
    return one_line(lines[0] + " " + "; ".join(dict.fromkeys(reasons)))


def run_trainer_command(command: str, args: list[str], argv: Optional[list[str]]) -> None:
    """`mhc fit|validate|test ARGS`; argv None: LightningCLI reads sys.argv itself."""
    try:
        with warnings.catch_warnings():
            # main(argv) called from Python (tests, tools) passes argv on; sys.argv is its caller's, not ours
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            build_cli(argv, exit_on_error=False)
    except (SystemExit, KeyboardInterrupt) as err:
        status = finish(args) if command == "fit" else None  # stopped by a signal: run KILLED, resume command
        if status is None and isinstance(err, KeyboardInterrupt):
            status = 128 + signal.SIGINT  # before anything started: nothing to save
        if status is None:
            raise
        sys.exit(status)
    except TrainingDiverged as err:  # the run is FAILED and tagged already (callbacks/divergence.py)
        if err.announce:
            print(f"mhc {command}: error: {one_line(str(err))}", file=sys.stderr)
        sys.exit(EXIT_DIVERGED)
    except CheckpointWriteError as err:
        fail(command, f"{err} Resume with: {resume_command(args)}" if err.resumable else str(err))
    except UserError as err:
        fail(command, str(err))
    except ArgumentError as err:
        fail(command, f"{parser_message(err)} (options: `mhc {command} --help`)")
    except Exception as err:
        user = _user_error_in(err)
        if user is None:
            raise
        fail(command, str(user))


def _user_error_in(err: BaseException) -> Optional[UserError]:
    """The UserError behind `err`: jsonargparse wraps what a class raises while it instantiates it (a logger whose
    store cannot be opened) in errors of its own, whose text repeats every argument of the class."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, UserError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


if __name__ == "__main__":
    main()
