"""Offloaders: which parameters leave the device, and when they come back. The names are
those of vLLM's `vllm.model_executor.offloader`, so code written against it runs with only
the import changed."""

from offload.offloader.base import BaseOffloader, NoopOffloader, get_offloader, set_offloader
from offload.offloader.factory import as_config, create_offloader
from offload.offloader.manifest import OffloadedParam
from offload.offloader.prefetch import PrefetchOffloader
from offload.offloader.stats import DiskStats, OffloadStats
from offload.offloader.uva import UVAOffloader

__all__ = [
    "BaseOffloader",
    "DiskStats",
    "NoopOffloader",
    "OffloadStats",
    "OffloadedParam",
    "PrefetchOffloader",
    "UVAOffloader",
    "as_config",
    "create_offloader",
    "get_offloader",
    "set_offloader",
]
