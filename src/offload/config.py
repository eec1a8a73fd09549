"""Offload configuration with vLLM's field names, defaults, validation and flags.

A config written for vLLM (`OffloadConfig`, its `uva` and `prefetch` parts, the
`--cpu-offload-gb`-style flags, or a JSON dict of either) means the same thing here.
Three fields exist beyond vLLM's, all vLLM's behaviour by default on a GPU: `disable_uva` and
`disable_pin_memory` (vLLM reads these only from environment variables, which are
honoured here too; see `offload.memory.host`), and `prefetch_unit`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from offload.errors import ConfigError, shown

OffloadBackend = Literal["auto", "uva", "prefetch"]
BACKENDS: tuple[str, ...] = ("auto", "uva", "prefetch")


def _as_number(owner: str, name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{owner}.{name} must be a number >= {minimum}, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range (10**400) is not finite
        number = math.inf
    except ValueError:
        raise ConfigError(
            f"{owner}.{name} must be a number >= {minimum}, got {shown(value)}"
        ) from None
    if not math.isfinite(number) or number < minimum:
        raise ConfigError(
            f"{owner}.{name} must be a finite number >= {minimum}, got {shown(value)}"
        )
    return number


def _as_int(owner: str, name: str, value: Any, minimum: int) -> int:
    number = _as_number(owner, name, value, minimum)
    if isinstance(value, int):  # exact, not through float
        return value
    if number != int(number):
        raise ConfigError(f"{owner}.{name} must be an integer >= {minimum}, got {shown(value)}")
    return int(number)


def _as_segments(owner: str, name: str, value: Any) -> set[str]:
    """A set of dot-separated name segments; a string may hold several, comma-separated."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Iterable) or isinstance(items, bytes | bytearray | Mapping):
        raise ConfigError(f"{owner}.{name} must be a set of name segments, got {shown(value)}")
    segments: set[str] = set()
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{owner}.{name} must hold strings, got {shown(item)}")
        if not item.strip(" ,"):
            raise ConfigError(
                f"{owner}.{name} entries must be name segments such as 'experts', got {item!r}"
            )
        for part in item.split(","):
            part = part.strip()
            if part.startswith(".") or part.endswith(".") or ".." in part:
                raise ConfigError(
                    f"{owner}.{name} entries are dot-separated name segments "
                    f"such as 'experts' or 'mlp.down_proj', got {part!r}"
                )
            if part:
                segments.add(part)
    return segments


def _as_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be true or false, got {shown(value)}")
    return value


@dataclass
class UVAOffloadConfig:
    """UVA (zero-copy) offloading: parameters live in pinned host memory.

    `cpu_offload_gb`: GiB of parameters to move to host memory, filled parameter by
    parameter in module order (0 = none). `cpu_offload_params`: name segments that
    select which parameters may be offloaded (empty = any); matching is by whole
    dot-separated segments, so "experts" matches "mlp.experts.w2_weight" and "w2"
    does not.
    """

    cpu_offload_gb: float | Literal["auto"] = 0
    cpu_offload_params: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.cpu_offload_gb != "auto":  # "auto": the smallest amount that fits (see LLM)
            self.cpu_offload_gb = _as_number("uva", "cpu_offload_gb", self.cpu_offload_gb, 0)
        self.cpu_offload_params = _as_segments("uva", "cpu_offload_params", self.cpu_offload_params)


@dataclass
class PrefetchOffloadConfig:
    """Prefetch offloading: the last `offload_num_in_group` layers of every group of
    `offload_group_size` layers live in host memory and are copied to the device
    `offload_prefetch_step` layers ahead of use. `offload_params` narrows which
    parameters of an offloaded layer move (empty = all), by segment matching.
    """

    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    offload_params: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        owner = "prefetch"
        self.offload_group_size = _as_int(owner, "offload_group_size", self.offload_group_size, 0)
        self.offload_num_in_group = _as_int(
            owner, "offload_num_in_group", self.offload_num_in_group, 1
        )
        self.offload_prefetch_step = _as_int(
            owner, "offload_prefetch_step", self.offload_prefetch_step, 0
        )
        self.offload_params = _as_segments(owner, "offload_params", self.offload_params)


_VLLM_TOP_FIELDS = ("offload_backend", "uva", "prefetch")
_EXTRA_TOP_FIELDS = ("disable_uva", "disable_pin_memory", "prefetch_unit")
PREFETCH_UNITS = ("auto", "layer", "module")


@dataclass
class OffloadConfig:
    """Which backend offloads the weights, and its settings (vLLM's `OffloadConfig`).

    `offload_backend="auto"` picks prefetch when `prefetch.offload_group_size > 0`,
    else UVA when `uva.cpu_offload_gb > 0`, else no offloading.
    """

    offload_backend: OffloadBackend = "auto"
    uva: UVAOffloadConfig = field(default_factory=UVAOffloadConfig)
    prefetch: PrefetchOffloadConfig = field(default_factory=PrefetchOffloadConfig)
    disable_uva: bool = False
    disable_pin_memory: bool = False
    # Ours, not vLLM's: what one prefetch copy brings in. "layer" (vLLM's) copies whole
    # layers; "module" copies each weight-holding module of an offloaded layer on its own,
    # so `offload_prefetch_step` counts modules; "auto" is layers on a GPU and modules on
    # a CPU (see offloader/units.py).
    prefetch_unit: str = "auto"

    def __post_init__(self) -> None:
        self.uva = _sub_config(UVAOffloadConfig, "uva", self.uva)
        self.prefetch = _sub_config(PrefetchOffloadConfig, "prefetch", self.prefetch)
        self.disable_uva = _as_bool("offload", "disable_uva", self.disable_uva)
        self.disable_pin_memory = _as_bool("offload", "disable_pin_memory", self.disable_pin_memory)
        if self.prefetch_unit not in PREFETCH_UNITS:
            raise ConfigError(
                f"prefetch_unit must be one of {', '.join(PREFETCH_UNITS)}, "
                f"got {shown(self.prefetch_unit)}"
            )
        self.validate()
        self._warn_about_ignored_fields()

    def validate(self) -> None:
        """Check every field again (they may have been assigned since construction)."""
        if self.offload_backend not in BACKENDS:
            raise ConfigError(
                f"offload_backend must be one of {', '.join(BACKENDS)}, "
                f"got {shown(self.offload_backend)}"
            )
        # The parts may have been replaced since construction, by anything.
        self.uva = _sub_config(UVAOffloadConfig, "uva", self.uva)
        self.prefetch = _sub_config(PrefetchOffloadConfig, "prefetch", self.prefetch)
        self.uva.__post_init__()
        self.prefetch.__post_init__()
        pre = self.prefetch
        if self.offload_backend == "prefetch" or pre.offload_group_size > 0:
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
        uva_active = self.uva.cpu_offload_gb == "auto" or self.uva.cpu_offload_gb > 0
        prefetch_active = pre.offload_group_size > 0
        if self.offload_backend == "uva" and prefetch_active:
            message = "Prefetch offload fields are set but offload_backend='uva'. Prefetch settings will be ignored."
        elif self.offload_backend == "prefetch" and uva_active:
            message = "UVA offload fields are set but offload_backend='prefetch'. UVA settings will be ignored."
        elif self.offload_backend == "auto" and uva_active and prefetch_active:
            message = (
                "Both UVA and prefetch offload fields are set with offload_backend='auto'. "
                "Prefetch backend will be selected. Set offload_backend explicitly to "
                "suppress this warning."
            )
        else:
            return
        warnings.warn(message, UserWarning, stacklevel=4)

    @property
    def selected_backend(self) -> Literal["none", "uva", "prefetch"]:
        """The backend `create_offloader` builds for this config."""
        if self.offload_backend != "auto":
            return self.offload_backend
        if self.prefetch.offload_group_size > 0:
            return "prefetch"
        if self.uva.cpu_offload_gb == "auto" or self.uva.cpu_offload_gb > 0:
            return "uva"
        return "none"

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
        for key, value in data.items():
            if key in ("uva", "prefetch"):
                continue
            if key in _VLLM_TOP_FIELDS or key in _EXTRA_TOP_FIELDS:
                nested[key] = value
            elif key in _UVA_FIELDS:
                uva[key] = value
            elif key in _PREFETCH_FIELDS:
                prefetch[key] = value
            else:
                raise ConfigError(
                    f"unknown offload config key {shown(key)}; allowed: {_allowed_keys()}"
                )
        return cls(uva=uva, prefetch=prefetch, **nested)

    @classmethod
    def from_cli(cls, argv: Sequence[str]) -> OffloadConfig:
        """Parse vLLM's offload flags (`--cpu-offload-gb 4 --offload-backend uva ...`)."""
        parser = _RaisingParser(prog="offload", add_help=False)
        add_cli_args(parser)
        return cls.from_cli_args(parser.parse_args(list(argv)))

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> OffloadConfig:
        """Build from a namespace parsed by a parser that `add_cli_args` extended."""
        data = {
            dest: getattr(args, dest)
            for dest in _FLAG_DESTS
            if getattr(args, dest, None) is not None
        }
        return cls.from_dict(data)


_UVA_FIELDS = tuple(f.name for f in dataclasses.fields(UVAOffloadConfig))
_PREFETCH_FIELDS = tuple(f.name for f in dataclasses.fields(PrefetchOffloadConfig))
# Every key an offload config (or LLM's offload flags) may have.
OFFLOAD_KEYS = (*_VLLM_TOP_FIELDS, *_EXTRA_TOP_FIELDS, *_UVA_FIELDS, *_PREFETCH_FIELDS)


def _allowed_keys() -> str:
    return ", ".join(OFFLOAD_KEYS)


def _plain(part: UVAOffloadConfig | PrefetchOffloadConfig) -> dict[str, Any]:
    return {
        key: sorted(value) if isinstance(value, set) else value
        for key, value in dataclasses.asdict(part).items()
    }


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


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit
        raise ConfigError(message)


def _gib_or_auto(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of GiB or 'auto', got {text!r}"
        ) from None


# (flag, dest, argparse keywords): vLLM's names, plus the two switches vLLM keeps in env vars.
_FLAGS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "--offload-backend",
        "offload_backend",
        {
            "choices": BACKENDS,
            "help": "auto: prefetch if --offload-group-size > 0, else UVA if --cpu-offload-gb > 0",
        },
    ),
    (
        "--cpu-offload-gb",
        "cpu_offload_gb",
        {
            "type": _gib_or_auto,
            "metavar": "GIB|auto",
            "help": "UVA: GiB of weights kept in host memory and read in place (auto: just enough to fit; vLLM default 0)",
        },
    ),
    (
        "--cpu-offload-params",
        "cpu_offload_params",
        {
            "nargs": "+",
            "metavar": "SEG",
            "help": "UVA: only parameters whose names contain these dot-separated segments",
        },
    ),
    (
        "--offload-group-size",
        "offload_group_size",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: of every N layers, the last --offload-num-in-group are offloaded (vLLM default 0: off)",
        },
    ),
    (
        "--offload-num-in-group",
        "offload_num_in_group",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: layers offloaded per group (vLLM default 1)",
        },
    ),
    (
        "--offload-prefetch-step",
        "offload_prefetch_step",
        {
            "type": int,
            "metavar": "N",
            "help": "prefetch: how many layers ahead copies run; device slots (vLLM default 1)",
        },
    ),
    (
        "--offload-params",
        "offload_params",
        {
            "nargs": "+",
            "metavar": "SEG",
            "help": "prefetch: only parameters whose names contain these segments",
        },
    ),
    (
        "--offload-disable-uva",
        "disable_uva",
        {
            "action": "store_const",
            "const": True,
            "help": "UVA: copy each layer to the device before it runs instead of reading host memory in place",
        },
    ),
    (
        "--offload-disable-pin-memory",
        "disable_pin_memory",
        {"action": "store_const", "const": True, "help": "keep host memory pageable (not pinned)"},
    ),
    (
        "--offload-prefetch-unit",
        "prefetch_unit",
        {
            "choices": PREFETCH_UNITS,
            "help": "prefetch: what one copy brings in (ours; auto: layers, or on a CPU with a core free for the copy thread, modules when layers overflow its cache)",
        },
    ),
)
_FLAG_DESTS = tuple(dest for _, dest, _ in _FLAGS)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add vLLM's weight-offloading flags to `parser` (every default is "not given")."""
    group = parser.add_argument_group("weight offloading (vLLM-compatible)")
    for flag, dest, keywords in _FLAGS:
        group.add_argument(flag, dest=dest, default=None, **keywords)
    return parser
