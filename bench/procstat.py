"""CPU seconds and RSS of a system under test, read from /proc (Linux only, no psutil).

A system under test is a process tree (an edge and a node; LiteLLM and its uvicorn worker), so
every figure is summed over the given pids and all their descendants, found afresh each time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after its closing one.
    return text[text.rfind(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def tree_pids(roots: Iterable[int]) -> list[int]:
    """The roots and every live descendant."""
    tree = _children()
    out: list[int] = []
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if os.path.exists(f"/proc/{pid}"):
            out.append(pid)
            stack.extend(tree.get(pid, ()))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of these processes (live ones; threads included)."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident set size now, summed (from statm: cheap enough to sample every 50 ms)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as handle:
                total += int(handle.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


def hwm_bytes(pids: Iterable[int]) -> int:
    """Peak RSS since each process started (VmHWM), summed."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            pass
    return total


class Meter:
    """CPU between :meth:`start` and :meth:`stop`, and the peak of the RSS samples taken between."""

    def __init__(self, roots: Iterable[int]) -> None:
        self.roots = list(roots)
        self.pids = tree_pids(self.roots)
        self.cpu_start = 0.0
        self.cpu = 0.0
        self.peak_rss = 0

    def start(self) -> None:
        self.pids = tree_pids(self.roots)
        self.cpu_start = cpu_seconds(self.pids)
        self.peak_rss = rss_bytes(self.pids)

    def sample(self) -> int:
        rss = rss_bytes(self.pids)
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def stop(self) -> None:
        self.sample()
        self.cpu = cpu_seconds(self.pids) - self.cpu_start
