"""`mhc` command: LightningCLI (fit / validate / test) plus the sweep and compare tools."""
import sys
from typing import Optional

from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

from .data import ByteTextDataModule
from .module import LitLM
from .tracking import MLflowSaveConfig


class MHCLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The corpus decides the vocabulary (bytes: 256); the model must agree, so link rather than repeat.
        parser.link_arguments("data.vocab_size", "model.arch.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.seq_len", "model.arch.context")


def build_cli(args: Optional[list[str]] = None, run: bool = True, **kwargs) -> MHCLightningCLI:
    set_parsing_settings(omegaconf_absolute_to_relative_paths=True)
    kwargs.setdefault("save_config_callback", MLflowSaveConfig)
    return MHCLightningCLI(
        LitLM,
        ByteTextDataModule,
        parser_kwargs={"parser_mode": "omegaconf+", "default_env": False},
        args=args,
        run=run,
        **kwargs,
    )


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    build_cli(argv)


if __name__ == "__main__":
    main()
