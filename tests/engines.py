"""Copy engines for tests: real copies, delayed, optionally without the compute-side wait."""

from offload.memory.copy_engine import ThreadCopyEngine


class SlowEngine(ThreadCopyEngine):
    """Delays every copy: any read that is not ordered after its copy sees stale bytes.
    With `waits=False` compute does not wait for copies either (a broken ordering)."""

    def __init__(self, delay_s=0.003, waits=True):
        super().__init__(delay_s=delay_s)
        self._waits = waits

    def wait(self, ticket):
        if self._waits:
            super().wait(ticket)


class ImmediateEngine(ThreadCopyEngine):
    """Copies at once, on the calling thread: a read that should have come before an
    overwrite of its slot, but runs after it, sees the new occupant's bytes."""

    def copy(self, dst, src, after=None):
        self._copy(dst, src)
        self.stats.bytes_copied += dst.numel()
        self.stats.num_copies += 1
        return None

    def wait(self, ticket):
        return None

    def synchronize(self):
        return None
