"""Offloaders: which parameters leave the device, and when they come back."""

from offload.offloader.base import (
    BaseOffloader,
    NoopOffloader,
    OffloadedParam,
    create_offloader,
    get_offloader,
    set_offloader,
)
from offload.offloader.uva import UVAOffloader

__all__ = [
    "BaseOffloader",
    "NoopOffloader",
    "OffloadedParam",
    "UVAOffloader",
    "create_offloader",
    "get_offloader",
    "set_offloader",
]
