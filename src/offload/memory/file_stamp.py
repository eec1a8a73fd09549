"""What a checkpoint file was when a model was loaded (`FileStamp`), and the error of a
file that weights stream from (`DiskReadError`): a read from anything else is refused."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from offload.errors import ModelError


class DiskReadError(ModelError):
    """A file that weights stream from changed, vanished or failed to read. `transient`:
    the read itself failed (an I/O error), the file is still the one loaded: reading it
    again may work."""

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class FileStamp:
    """What a file was when the model was loaded: a read from anything else is refused.
    The change time (ctime) is part of it because no user can set it back: every write,
    and every `touch` that puts the modification time back, moves it (so does a chmod, a
    change that is refused too: a clear error, never a wrong answer)."""

    path: Path
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        try:
            st = os.stat(path)
        except OSError as error:
            raise DiskReadError(f"cannot read {path}: {error.strerror or error}") from None
        return cls(Path(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)

    def differs(self, st: os.stat_result) -> str | None:
        """How `st` differs from the stamp, or None."""
        if (st.st_ino, st.st_dev) != (self.inode, self.device):
            return "was replaced"
        if st.st_size != self.size:
            return f"changed size ({self.size} -> {st.st_size} bytes)"
        if (st.st_mtime_ns, st.st_ctime_ns) != (self.mtime_ns, self.ctime_ns):
            return "was modified"
        return None
