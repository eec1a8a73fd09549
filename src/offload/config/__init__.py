"""Offload configuration with vLLM's field names, defaults, validation and flags:
`OffloadConfig` (`offload_config.py`), its parts and their field checks (`parts.py`), and
the command-line flags (`flags.py`)."""

from offload.config.flags import add_cli_args
from offload.config.offload_config import OFFLOAD_KEYS, OffloadConfig
from offload.config.parts import (
    BACKENDS,
    DISK_IO,
    PREFETCH_UNITS,
    DiskOffloadConfig,
    OffloadBackend,
    PrefetchOffloadConfig,
    UVAOffloadConfig,
)

__all__ = [
    "BACKENDS",
    "DISK_IO",
    "OFFLOAD_KEYS",
    "PREFETCH_UNITS",
    "DiskOffloadConfig",
    "OffloadBackend",
    "OffloadConfig",
    "PrefetchOffloadConfig",
    "UVAOffloadConfig",
    "add_cli_args",
]
