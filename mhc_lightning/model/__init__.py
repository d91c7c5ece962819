"""The model as plain nn.Modules, free of Lightning."""

from .config import GPTConfig, HyperConfig
from .gpt import GPT
from .hyper_connection import HyperConnection, hyper_connections

__all__ = ["GPT", "GPTConfig", "HyperConfig", "HyperConnection", "hyper_connections"]
