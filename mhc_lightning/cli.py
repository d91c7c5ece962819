"""`mhc` command: LightningCLI (fit / validate / test) plus the sweep and compare tools."""
import sys
from typing import Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from .data import ByteTextDataModule
from .model import GPTConfig, HyperConfig
from .module import LitLM, OptimConfig
from .tracking import MLflowSaveConfig


def announce_run(trainer) -> None:
    """Tell the user where the run went and how to look at it."""
    from lightning.pytorch.loggers import MLFlowLogger

    if trainer.global_rank != 0:
        return
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "train/loss"))}
    for lg in trainer.loggers:
        if isinstance(lg, MLFlowLogger):
            uri = lg._tracking_uri
            print(f"\nMLflow run {lg.run_id} (experiment {lg._experiment_name!r}, id {lg.experiment_id}) at {uri}")
            print("final metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(metrics.items())))
            if uri.startswith("sqlite:"):
                print(f"view it:  mlflow ui --backend-store-uri {uri}   (then open http://127.0.0.1:5000)")


def _plain(ns) -> dict:
    return ns.as_dict() if hasattr(ns, "as_dict") else dict(ns)


def validate_model_config(model_cfg) -> None:
    """Build the config dataclasses once; their errors get the full CLI key as prefix."""
    arch = _plain(model_cfg.arch)
    hyper = _plain(arch.pop("hyper"))
    for prefix, build in (
        ("model.arch.hyper", lambda: HyperConfig(**hyper)),
        ("model.arch", lambda: GPTConfig(**arch, hyper=HyperConfig(**hyper))),
        ("model.optim", lambda: OptimConfig(**_plain(model_cfg.optim))),
    ):
        try:
            build()
        except (ValueError, TypeError) as err:
            raise ValueError(f"{prefix}.{err}") from err
    if model_cfg.diagnostics_every < 0:
        raise ValueError(f"model.diagnostics_every must be >= 0 (0 = off), got {model_cfg.diagnostics_every}")


class MHCLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The corpus decides the vocabulary (bytes: 256); the model must agree, so link rather than repeat.
        parser.link_arguments("data.vocab_size", "model.arch.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.arch.context")

    def after_fit(self) -> None:
        announce_run(self.trainer)

    def before_instantiate_classes(self) -> None:
        from .resume import resolve_last

        resolve_last(self.config, self.config.get("subcommand"))  # `--ckpt_path last`: the same run, its checkpoint

    def parse_arguments(self, parser, args) -> None:
        super().parse_arguments(parser, args)
        # Cross-field rules (d_model % n_heads, ranges) live in the dataclasses' __post_init__; run them now
        # so a bad value fails at parse time, with the field named, before any data or model is built.
        sub = self.config.get("subcommand")
        cfg = self.config.get(sub) if sub else self.config
        try:
            validate_model_config(cfg.model)
        except (ValueError, TypeError) as err:
            (self._subcommand_parsers[sub] if sub else parser).error(f"invalid model configuration: {err}")


def build_cli(args: Optional[list[str]] = None, run: bool = True, cli_class: type = MHCLightningCLI,
              **kwargs) -> MHCLightningCLI:
    from .configs import parser_kwargs

    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    kwargs.setdefault("save_config_callback", MLflowSaveConfig)
    return cli_class(
        LitLM,
        ByteTextDataModule,
        parser_kwargs=parser_kwargs({"parser_mode": "omegaconf+", "default_env": False}, run),  # base.yaml stacks
        args=args,
        run=run,
        **kwargs,
    )


TOOLS = {  # subcommands with their own argparse front ends (module:function); everything else is LightningCLI
    "sweep": ("mhc_lightning.sweeps.cli:main", "Optuna sweeps tracked in MLflow"),
    "compare": ("mhc_lightning.reports.cli:main", "table and plots of MLflow runs"),
    "report": ("mhc_lightning.reports.cli:report_main",
               "runs grouped by tags, mean +- std over seeds (= mhc compare --group-by)"),
    "grid": ("mhc_lightning.grid:main", "a grid of `mhc fit` runs in parallel processes"),
}


def main(argv: Optional[list[str]] = None) -> None:
    from .errors import UserError
    from .launcher import die_with_parent

    die_with_parent()  # started by `mhc grid` / `mhc sweep` / DDP rank 0: do not outlive it
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in TOOLS:
        import importlib

        module, _, func = TOOLS[args[0]][0].partition(":")
        sys.exit(getattr(importlib.import_module(module), func)(list(args[1:])))
    try:
        # argv=None lets LightningCLI read sys.argv itself (it warns when given both)
        build_cli(argv)
    except UserError as err:
        print(f"mhc: error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
