"""Changes made to a checkpoint file under a running model, shared by the reader's and
the disk tier's tests: each must end in a clear error naming the file."""

import os


def replace(path):
    other = path.with_suffix(".new")
    other.write_bytes(path.read_bytes())
    os.replace(other, path)


def modify(path):
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))


def remove(path):
    path.unlink()


def rewrite_back_dated(path):  # in place: size, inode and times as they were
    stat = os.stat(path)
    with path.open("r+b") as file:
        file.seek(stat.st_size // 2)
        file.write(b"\x3f" * 64)  # plausible weights (0.75 as float32), no nan
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


COMMON = {
    "rewritten, its time set back": rewrite_back_dated,
    "replaced": replace,
    "modified": modify,
    "removed": remove,
}
