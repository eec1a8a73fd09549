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


class LateEngine(ThreadCopyEngine):
    """Runs each copy as late as a copy stream may: only when compute waits for it or
    for a later copy (or synchronizes), in issue order. A read that is not ordered after
    its copy's wait sees the slot's old bytes every time, whatever the machine's load;
    `num_stalls` counts the waits that had to run their copy (deterministic)."""

    def __init__(self):
        super().__init__()
        self._pending: list[tuple[int, object, object]] = []  # (ticket, dst, src)
        self._issued = 0
        self._done = 0

    def copy(self, dst, src, after=None):
        self._issued += 1
        self._pending.append((self._issued, dst, src))
        self.stats.bytes_copied += dst.numel()
        self.stats.num_copies += 1
        return self._issued

    def wait(self, ticket):
        if ticket > self._done:
            self.stats.num_stalls += 1
        self._run_until(ticket)

    def synchronize(self):
        self._run_until(self._issued)

    def _run_until(self, ticket):
        while self._pending and self._pending[0][0] <= ticket:
            number, dst, src = self._pending.pop(0)
            self._copy(dst, src)
            self._done = number
