"""What machine this is (its CPU or GPU, the software) and this process's memory: every
measurement and result says where it came from."""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import platform
import time
from pathlib import Path

import torch

from offload.memory.threads import available_cores
from offload.offloader.units import last_level_cache_bytes


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where it does not say)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and the cores this process may use."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model() or platform.machine()} ({available_cores()} cores)"


def software() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def machine(device: torch.device) -> dict[str, object]:
    """The fields every result file carries: the date, the software and the machine."""
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "cpu_model": cpu_model(),
        # It decides the CPU's prefetch unit, and hosts of one kind of VM differ in it.
        "last_level_cache_bytes": last_level_cache_bytes(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def process_memory_bytes() -> dict[str, int]:
    """This process's resident set now (`VmRSS`) and its peak (`VmHWM`), in bytes."""
    fields = {"VmRSS": "rss_bytes", "VmHWM": "peak_rss_bytes"}
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            found[fields[key]] = int(value.split()[0]) * 1024  # the kernel reports kB
    return found


def reset_peak_rss() -> None:
    """Start `VmHWM` again from the current RSS (Linux's clear_refs value 5), after
    freeing what Python and glibc still hold, so that a peak belongs to what follows."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # returns freed heap pages to the kernel
    Path("/proc/self/clear_refs").write_text("5")


class OthersLoad:
    """How busy other programs kept the machine's CPUs between `start` and `stop`: the CPU
    time of every user process outside this one and its children (from /proc/*/stat;
    kernel threads, such as those doing this process's I/O, left out), over the wall time
    and the CPUs. 0.0 where /proc cannot be read."""

    def __init__(self):
        self._start = (_others_s(), time.perf_counter())

    def fraction(self) -> float:
        (others0, wall0), others, wall = self._start, _others_s(), time.perf_counter()
        if others is None or others0 is None or wall <= wall0:
            return 0.0
        return others_used_s(others0, others) / ((wall - wall0) * (os.cpu_count() or 1))


_KERNEL_THREAD = 0x00200000  # PF_KTHREAD in /proc/<pid>/stat's flags


def others_used_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the processes of `after` used since `before` (two `_others_s`): each
    process's own growth, so that one that ended meanwhile takes nothing away (a sum of
    totals fell by its whole CPU time: a busy machine read as idle, or less than idle)."""
    return sum(max(0.0, used - before.get(pid, 0.0)) for pid, used in after.items())


def _others_s() -> dict[int, float] | None:
    """Seconds of CPU used so far by each user process that is not this one or its
    descendants, by pid (processes gone since are not counted: an undercount, never an
    over)."""
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    parents, ticks = {}, {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except OSError:  # (gone meanwhile)
            continue
        fields = text[text.rindex(")") + 2 :].split()  # from the state on
        if int(fields[6]) & _KERNEL_THREAD:
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime, stime
    ours = {os.getpid()}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in ours and pid not in ours:
                ours.add(pid)
                grew = True
    tick = os.sysconf("SC_CLK_TCK")
    return {pid: t / tick for pid, t in ticks.items() if pid not in ours}


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's replicas or pipeline ranks)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
