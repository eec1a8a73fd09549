"""The probes of the machine at a test's size: small copies and reads, as many repeats (the
tests count measurements and compare predictions, not bandwidths)."""

from offload.probes.settings import MeasureSettings
from offload.sizes import MIB

SMALL_PROBES = MeasureSettings(copy_bytes=16 * MIB, disk_bytes=64 * MIB, probe_file_bytes=16 * MIB)
