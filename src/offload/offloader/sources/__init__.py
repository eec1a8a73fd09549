"""Where a prefetch unit's bytes come from, one kind per file behind `UnitSource`
(`base.py`): a host slab copied in (`slab.py`), a read from the checkpoint straight into
the slot (`direct_read.py`), a read into pinned staging then a copy (`staged_read.py`,
the GPU's path), or a mapping of the checkpoint computed on in place (`mapped.py`). The
offloader picks a unit's source once, when the slots are made, and then only calls
`load` and `wait`."""

from offload.offloader.sources.base import DiskSource, UnitSource, Unopened
from offload.offloader.sources.direct_read import DirectRead
from offload.offloader.sources.mapped import MappedRead
from offload.offloader.sources.slab import SlabSource
from offload.offloader.sources.staged_read import StagedRead

__all__ = [
    "DirectRead",
    "DiskSource",
    "MappedRead",
    "SlabSource",
    "StagedRead",
    "UnitSource",
    "Unopened",
]
