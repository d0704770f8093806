"""mindft: MindSpore training that survives device faults without losing the job."""
from __future__ import annotations

from mindft import config
from mindft.config import ConfigError, MindftConfig, TFTOptions, load_config, parse_tft
from mindft.exitcodes import ExitCode

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "ExitCode",
    "MindftConfig",
    "TFTOptions",
    "config",
    "load_config",
    "parse_tft",
]
