"""What a process tree costs, read from Linux's /proc: CPU time used and peak resident memory.

Peak RSS is per measurement: writing ``5`` to ``/proc/PID/clear_refs`` resets ``VmHWM`` (the
high-water mark) to the current RSS, so each run reports its own peak, not the process's lifetime one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (children, their children, ...), found by their parent ids."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parents.setdefault(_stat_fields(int(entry.name))[1], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _stat_fields(pid: int) -> list[int]:
    """/proc/PID/stat from field 3 (state) on; the command name before it may hold spaces."""
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()
    return [0 if not field.lstrip("-").isdigit() else int(field) for field in rest]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU time the processes have used so far (a process gone since counts 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = _stat_fields(pid)
            ticks += fields[11] + fields[12]  # utime, stime: fields 14 and 15 of stat(5)
    return ticks / CLOCK_TICKS


def reset_peak_rss(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss_bytes(pids: Sequence[int]) -> int:
    """The sum of the processes' peak RSS since the last reset (an upper bound of the tree's peak)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


@dataclass
class Usage:
    cpu_s: float = 0.0
    peak_rss: int = 0


@contextlib.contextmanager
def measure(pids: Sequence[int]) -> Iterator[Usage]:
    """CPU seconds and peak RSS of ``pids`` over the ``with`` block."""
    usage = Usage()
    reset_peak_rss(pids)
    before = cpu_seconds(pids)
    yield usage
    usage.cpu_s = cpu_seconds(pids) - before
    usage.peak_rss = peak_rss_bytes(pids)
