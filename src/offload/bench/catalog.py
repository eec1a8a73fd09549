"""Every method `offload bench` knows, by its `--methods` name, in the order they load and
run: the first that is ours stands in for resident as the reference when resident is
not there."""

from __future__ import annotations

from offload.bench.engine import Engine, EngineDraft, EngineNgram
from offload.bench.llama_cpp import LlamaCpp
from offload.bench.method import Method
from offload.bench.ours import UVA, Disk, DiskDirect, PrefetchAll, PrefetchHalf, Resident
from offload.bench.peers import AccelerateDisk, AccelerateMap, Diffusers
from offload.bench.planned import Planned

METHODS: dict[str, type[Method]] = {
    method.name: method
    for method in (
        Resident,
        Engine,
        EngineNgram,
        EngineDraft,
        UVA,
        PrefetchAll,
        PrefetchHalf,
        Disk,
        DiskDirect,
        Planned,
        AccelerateMap,
        AccelerateDisk,
        Diffusers,
        LlamaCpp,
    )
}
