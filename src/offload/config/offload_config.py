"""Offload configuration with vLLM's field names, defaults, validation and flags.

A config written for vLLM (`OffloadConfig`, its `uva` and `prefetch` parts, the
`--cpu-offload-gb`-style flags, or a JSON dict of either) means the same thing here.
Fields beyond vLLM's, all vLLM's behaviour by default on a GPU: `disable_uva` and
`disable_pin_memory` (vLLM reads these only from environment variables, which are
honoured here too; see `offload.memory.host`), `prefetch_unit`, and the `disk` part (a disk
tier, off unless `cpu_memory_gb` is set); `to_dict(vllm_only=True)` leaves them out.

A config is frozen and checked once, when it is made: `dataclasses.replace` makes (and
checks) a new one. The parts and their field checks are in `parts.py`, the flags in
`flags.py`; the package exports all of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from offload.config.flags import flag_values, parse_flags
from offload.config.parts import (
    BACKENDS,
    PREFETCH_UNITS,
    Backend,
    DiskOffloadConfig,
    OffloadBackend,
    PrefetchOffloadConfig,
    PrefetchUnit,
    UVAOffloadConfig,
    as_bool,
    set_field,
)
from offload.errors import ConfigError, shown
from offload.memory.placement import AUTO

_VLLM_TOP_FIELDS = ("offload_backend", "uva", "prefetch")
_EXTRA_TOP_FIELDS = ("disable_uva", "disable_pin_memory", "prefetch_unit", "disk")


@dataclass(frozen=True)
class OffloadConfig:
    """Which backend offloads the weights, and its settings (vLLM's `OffloadConfig`).

    `offload_backend="auto"` picks prefetch when `prefetch.offload_group_size > 0`,
    else UVA when `uva.cpu_offload_gb > 0`, else no offloading. A disk tier
    (`disk.cpu_memory_gb` set) streams through the prefetch backend: with no prefetch
    layout given, every layer is offloaded (`offload_group_size=1`).
    """

    offload_backend: OffloadBackend = Backend.AUTO
    uva: UVAOffloadConfig = field(default_factory=UVAOffloadConfig)
    prefetch: PrefetchOffloadConfig = field(default_factory=PrefetchOffloadConfig)
    disable_uva: bool = False
    disable_pin_memory: bool = False
    # Ours, not vLLM's: what one prefetch copy brings in. "layer" (vLLM's) copies whole
    # layers; "module" copies each weight-holding module of an offloaded layer on its own,
    # so `offload_prefetch_step` counts modules; "auto" is layers on a GPU and modules on
    # a CPU (see offloader/units.py).
    prefetch_unit: PrefetchUnit = PrefetchUnit.AUTO
    disk: DiskOffloadConfig = field(default_factory=DiskOffloadConfig)

    def __post_init__(self) -> None:
        """Each field checked and normalized (parts given as mappings made, strings made
        enum members), then the fields together (`validate`): once, as the config is made."""
        set_field(self, "uva", _sub_config(UVAOffloadConfig, "uva", self.uva))
        set_field(self, "prefetch", _sub_config(PrefetchOffloadConfig, "prefetch", self.prefetch))
        set_field(self, "disk", _sub_config(DiskOffloadConfig, "disk", self.disk))
        set_field(self, "disable_uva", as_bool("offload", "disable_uva", self.disable_uva))
        pin = as_bool("offload", "disable_pin_memory", self.disable_pin_memory)
        set_field(self, "disable_pin_memory", pin)
        if not isinstance(self.prefetch_unit, str) or self.prefetch_unit not in PREFETCH_UNITS:
            raise ConfigError(
                f"prefetch_unit must be one of {', '.join(PREFETCH_UNITS)}, "
                f"got {shown(self.prefetch_unit)}"
            )
        set_field(self, "prefetch_unit", PrefetchUnit(self.prefetch_unit))
        if not isinstance(self.offload_backend, str) or self.offload_backend not in BACKENDS:
            raise ConfigError(
                f"offload_backend must be one of {', '.join(BACKENDS)}, "
                f"got {shown(self.offload_backend)}"
            )
        set_field(self, "offload_backend", Backend(self.offload_backend))
        self.validate()
        self._warn_about_ignored_fields()

    def validate(self) -> None:
        """Check the fields together (each field was checked as the config was made). A
        config is frozen, so this holds for good: construction runs it once, and a caller
        need not run it again (it is public, as vLLM's, and may be)."""
        if self.disk.is_active and self.offload_backend == Backend.UVA:
            raise ConfigError(
                "cpu_memory_gb (the disk tier) streams layers through the prefetch backend; "
                "offload_backend='uva' cannot use it: use 'prefetch' or 'auto'"
            )
        pre = self.prefetch
        if self.offload_backend == Backend.PREFETCH or pre.offload_group_size > 0:
            if pre.offload_num_in_group > pre.offload_group_size:
                raise ConfigError(
                    f"offload_num_in_group ({pre.offload_num_in_group}) must be "
                    f"<= offload_group_size ({pre.offload_group_size})"
                    + (
                        "; offload_backend='prefetch' needs offload_group_size >= 1"
                        if pre.offload_group_size == 0
                        else ""
                    )
                )
            if pre.offload_prefetch_step < 1:
                raise ConfigError(
                    f"offload_prefetch_step ({pre.offload_prefetch_step}) must be >= 1 "
                    "when prefetch offloading is enabled (offload_group_size > 0)"
                )

    def _warn_about_ignored_fields(self) -> None:
        pre = self.prefetch
        uva_active = self.uva.cpu_offload_gb == AUTO or self.uva.cpu_offload_gb > 0
        prefetch_active = pre.offload_group_size > 0
        if self.offload_backend == Backend.UVA and prefetch_active:
            message = "Prefetch offload fields are set but offload_backend='uva'. Prefetch settings will be ignored."
        elif self.offload_backend == Backend.PREFETCH and uva_active:
            message = "UVA offload fields are set but offload_backend='prefetch'. UVA settings will be ignored."
        elif self.offload_backend == Backend.AUTO and uva_active and prefetch_active:
            message = (
                "Both UVA and prefetch offload fields are set with offload_backend='auto'. "
                "Prefetch backend will be selected. Set offload_backend explicitly to "
                "suppress this warning."
            )
        else:
            return
        warnings.warn(message, UserWarning, stacklevel=4)

    @property
    def selected_backend(self) -> Backend:
        """The backend `create_offloader` builds for this config (`Backend.NONE`: none)."""
        if self.offload_backend != Backend.AUTO:
            return Backend(self.offload_backend)
        if self.prefetch.offload_group_size > 0 or self.disk.is_active:
            return Backend.PREFETCH
        if self.uva.cpu_offload_gb == AUTO or self.uva.cpu_offload_gb > 0:
            return Backend.UVA
        return Backend.NONE

    def compute_hash(self) -> str:
        """A digest of every field: compile caches keyed on it change with any setting."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_dict(self, vllm_only: bool = False) -> dict[str, Any]:
        """A JSON-ready dict (sets become sorted lists). `vllm_only` drops the
        fields vLLM does not have, so vLLM's `OffloadConfig(**d)` accepts the result."""
        result: dict[str, Any] = {
            "offload_backend": self.offload_backend,
            "uva": _plain(self.uva),
            "prefetch": _plain(self.prefetch),
        }
        if not vllm_only:
            result["disable_uva"] = self.disable_uva
            result["disable_pin_memory"] = self.disable_pin_memory
            result["prefetch_unit"] = self.prefetch_unit
            result["disk"] = _plain(self.disk)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadConfig:
        """Build from a nested dict (`to_dict`'s shape, vLLM's `OffloadConfig`) or
        from the flat keys of vLLM's engine arguments (`cpu_offload_gb`, ...)."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"an offload config must be a mapping, got {type(data).__name__}")
        nested: dict[str, Any] = {}
        uva = _part_dict(UVAOffloadConfig, "uva", data.get("uva"))
        prefetch = _part_dict(PrefetchOffloadConfig, "prefetch", data.get("prefetch"))
        disk = _part_dict(DiskOffloadConfig, "disk", data.get("disk"))
        for key, value in data.items():
            if key in ("uva", "prefetch", "disk"):
                continue
            if key in _VLLM_TOP_FIELDS or key in _EXTRA_TOP_FIELDS:
                nested[key] = value
            elif key in _UVA_FIELDS:
                uva[key] = value
            elif key in _PREFETCH_FIELDS:
                prefetch[key] = value
            elif key in _DISK_FIELDS:
                disk[key] = value
            else:
                raise ConfigError(
                    f"unknown offload config key {shown(key)}; allowed: {_allowed_keys()}"
                )
        return cls(uva=uva, prefetch=prefetch, disk=disk, **nested)

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> OffloadConfig:
        """Parse vLLM's offload flags (`--cpu-offload-gb 4 --offload-backend uva ...`)."""
        return cls.from_cli_args(parse_flags(argv))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> OffloadConfig:
        """Build from a namespace parsed by a parser that `add_cli_args` extended."""
        return cls.from_dict(flag_values(args))


_UVA_FIELDS = tuple(f.name for f in dataclasses.fields(UVAOffloadConfig))
_PREFETCH_FIELDS = tuple(f.name for f in dataclasses.fields(PrefetchOffloadConfig))
_DISK_FIELDS = tuple(f.name for f in dataclasses.fields(DiskOffloadConfig))
# Every key an offload config (or LLM's offload flags) may have.
OFFLOAD_KEYS = (
    *_VLLM_TOP_FIELDS,
    *_EXTRA_TOP_FIELDS,
    *_UVA_FIELDS,
    *_PREFETCH_FIELDS,
    *_DISK_FIELDS,
)


def _allowed_keys() -> str:
    return ", ".join(OFFLOAD_KEYS)


def _plain(part: UVAOffloadConfig | PrefetchOffloadConfig) -> dict[str, Any]:
    return {
        key: sorted(value) if isinstance(value, set | frozenset) else _text(value)
        for key, value in dataclasses.asdict(part).items()
    }


def _text(value: Any) -> Any:
    """An enum member as its plain string (JSON-ready, as the user wrote it)."""
    return value.value if isinstance(value, enum.Enum) else value


def _sub_config(kind: type, name: str, value: Any) -> Any:
    if isinstance(value, kind):
        return value
    return kind(**_part_dict(kind, name, value))


def _part_dict(kind: type, name: str, value: Any) -> dict[str, Any]:
    """The fields of a `uva` or `prefetch` part given as a mapping, an instance or None
    (JSON's null: the defaults); unknown keys are refused, whatever their type."""
    if value is None:
        return {}
    if isinstance(value, kind):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(kind)}
    allowed = tuple(f.name for f in dataclasses.fields(kind))
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name} must be a {kind.__name__} or a mapping of {', '.join(allowed)}, "
            f"got {shown(value)}"
        )
    unknown = [key for key in value if key not in allowed]
    if unknown:
        raise ConfigError(
            f"unknown key {shown(unknown[0])} in {name}; allowed: {', '.join(allowed)}"
        )
    return dict(value)
