"""Offload configuration with vLLM's field names, defaults, validation and flags:
`OffloadConfig` (`offload_config.py`), its parts and their field checks (`parts.py`), and
the command-line flags (`flags.py`)."""

from offload.config.flags import add_cli_args
from offload.config.offload_config import OFFLOAD_KEYS, OffloadConfig
from offload.config.parts import (
    BACKENDS,
    DISK_IO,
    PREFETCH_UNITS,
    Backend,
    DiskOffloadConfig,
    OffloadBackend,
    PrefetchOffloadConfig,
    PrefetchUnit,
    UVAOffloadConfig,
)

__all__ = [
    "BACKENDS",
    "DISK_IO",
    "OFFLOAD_KEYS",
    "PREFETCH_UNITS",
    "Backend",
    "DiskOffloadConfig",
    "OffloadBackend",
    "OffloadConfig",
    "PrefetchOffloadConfig",
    "PrefetchUnit",
    "UVAOffloadConfig",
    "add_cli_args",
]
