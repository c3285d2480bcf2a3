"""A SQLite database used from trio: one connection, WAL, every call in a worker thread.

A ``CapacityLimiter(1)`` serialises access, so the single connection is never used by two
threads at once and the event loop never blocks on disk.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class Database:
    """``in_thread=False`` runs statements on the event loop: only for MockClock tests, where a
    worker thread would let the virtual clock jump while the statement runs."""

    def __init__(self, path: str | Path, schema: str, *, in_thread: bool = True) -> None:
        self.in_thread = in_thread
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(schema)
        self._limiter = trio.CapacityLimiter(1)
        # The one connection is never used by two threads at once: a synchronous read from the
        # event loop (``iop-trio runs``, tests) must not land inside a worker thread's transaction.
        self._lock = threading.Lock()

    def call_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on the connection in this thread (CLI commands, start-up)."""
        with self._lock, self._conn:
            return fn(self._conn)

    async def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in a worker thread, inside one transaction."""
        if not self.in_thread:
            await trio.lowlevel.checkpoint()
            return self.call_sync(fn)
        return await trio.to_thread.run_sync(self.call_sync, fn, limiter=self._limiter)

    async def execute(self, sql: str, params: Any = ()) -> None:
        await self.call(lambda conn: conn.execute(sql, params))

    def close(self) -> None:
        self._conn.close()
