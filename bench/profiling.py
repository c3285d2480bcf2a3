"""Sampling profiles of a system under test while the load generator drives it (py-spy).

py-spy reads the target's memory from outside (``--nonblocking``: the target is never paused),
so the profile costs the system under test almost nothing; it runs pinned to the load core.
The raw collapsed stacks are summarised here into the two views that find hot spots: self time
per function, and inclusive time per component (hypercorn, quart, httpx, the IOP codec, ...).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::(?P<line>\d+))?\)$")

#: Where a frame's file lives -> the component it is charged to (first match wins).
COMPONENTS = (
    ("/iop_trio/wire/", "iop_trio.wire (codec, framing)"),
    ("/iop_trio/transport/", "iop_trio.transport"),
    ("/iop_trio/edge/", "iop_trio.edge"),
    ("/iop_trio/controlplane/", "iop_trio.controlplane"),
    ("/iop_trio/node/", "iop_trio.node"),
    ("/iop_trio/adapters/", "iop_trio.adapters"),
    ("/iop_trio/store/", "iop_trio.store (sqlite)"),
    ("/iop_trio/", "iop_trio (other)"),
    ("/cattrs/", "cattrs"),
    ("/attr/", "attrs"),
    ("/hypercorn/", "hypercorn"),
    ("/quart_trio/", "quart / quart-trio"),
    ("/quart/", "quart / quart-trio"),
    ("/werkzeug/", "werkzeug"),
    ("/h11/", "h11"),
    ("/httpx/", "httpx"),
    ("/httpcore/", "httpcore"),
    ("/prometheus_client/", "prometheus_client"),
    ("/trio/_core/", "trio core (scheduler, I/O)"),
    ("/trio/", "trio (streams, ssl, sync)"),
    ("/json/", "json"),
    ("/ssl.py", "ssl"),
    ("/logging/", "logging"),
    ("sqlite3", "sqlite3"),
    ("/threading.py", "threads (trio.to_thread workers)"),
)


def available() -> str:
    """py-spy's path, or ``""``."""
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy") or ""


def start(pid: int, seconds: float, out: Path, core: int | None) -> subprocess.Popen[bytes] | None:
    exe = available()
    if not exe:
        return None
    pin = ["taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    args = [*pin, exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "250",
            "--nonblocking", "--format", "raw", "--output", str(out)]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


#: The frames at the bottom of every stack (interpreter start, the CLI, trio's run loop itself).
ENTRY = {"runpy", "iop_trio/cli.py", "iop_trio/roles.py"}
ENTRY_FUNCS = {"run", "unrolled_run"}
#: Leaves that are waiting, not working, though py-spy could not tell (epoll, an idle worker thread).
IDLE_LEAVES = {"EpollIOManager.get_events", "WorkerThread._work"}


def component(file: str, func: str = "") -> str:
    path = "/" + file  # py-spy prints paths relative to site-packages: anchor the needles
    if any(e in path for e in ENTRY) or (func in ENTRY_FUNCS and path.endswith("trio/_core/_run.py")):
        return "entry"
    for needle, name in COMPONENTS:
        if needle in path:
            return name
    return "other"


def summarise(raw: Path, top: int = 15) -> dict[str, Any]:
    """Self time per function and inclusive time per component, as % of the busy samples
    (py-spy leaves idle threads out unless asked; the waits it cannot recognise, ``IDLE_LEAVES``,
    are counted apart as ``idle_samples``)."""
    self_time: Counter[str] = Counter()
    components: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f for f in stack.split(";") if f]
        # py-spy's first frames are the process/thread; keep only "func (file:line)" frames.
        parsed = [m for m in (FRAME.match(f) for f in frames) if m]
        if not parsed:
            continue
        leaf = parsed[-1]
        if leaf["func"] in IDLE_LEAVES:
            idle += count
            continue
        total += count
        leaf_name = f"{leaf['func']} ({_short(leaf['file'])})"
        self_time[leaf_name] += count
        own[component(leaf["file"], leaf["func"])] += count
        for name in {component(m["file"], m["func"]) for m in parsed} - {"entry", "other"}:
            components[name] += count
    if not total:
        return {"samples": 0}

    def pct(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    return {
        "samples": total,
        "idle_samples": idle,
        "self": pct(self_time),
        "self_by_component": pct(own),
        "inclusive_by_component": pct(components),
    }


def _short(path: str) -> str:
    for marker in ("site-packages/", "iop_trio/", "lib/python3"):
        at = path.find(marker)
        if at >= 0:
            return path[at:].replace("site-packages/", "")
    return path
