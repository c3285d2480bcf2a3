"""Batched run history: the hot path queues rows, one task writes them, many per transaction.

A start and an end row per run, each in its own worker-thread call, cost more CPU than the rest
of a request on the edge and on the node. Here runs hand their rows to a bounded channel (a
memory operation; a slow disk pushes back instead of growing a queue) and ``run`` writes
whatever has accumulated in one transaction. It waits ``flush_interval`` after the first row of a
batch before writing: a hand-off to the worker thread costs more than a request on a busy core,
so at most ~20 of them a second, whatever the load (measured in bench/results/findings.md).
History therefore lags the runs by at most that interval. Timestamps are taken when the row is
queued, so batching never shifts them.

Nothing is lost on the way out: ``run`` flushes what is queued when it is stopped or cancelled,
and a row that arrives when no writer runs (tests, or after shutdown) is written directly. One
lock orders the writes, so a run's end written directly never overtakes its start still queued
(the end would update no row, and the start would then stay ``running`` for ever).
"""

from __future__ import annotations

import sqlite3
import time
from functools import partial
from typing import Any, Protocol

import trio

from .runs import END_SQL, START_SQL, RunOutcome, RunStore


class RunHistory(Protocol):
    """Where runs record their start and end: a RunStore directly, or a RunRecorder batching."""

    async def start_run(self, run_id: str, node_id: str, model: str, adapter: str) -> object: ...

    async def end_run(self, run_id: str, outcome: RunOutcome) -> object: ...


CHANNEL_CAPACITY = 4096
BATCH_LIMIT = 1024
FLUSH_INTERVAL = 0.05


class RunRecorder:
    def __init__(self, store: RunStore, capacity: int = CHANNEL_CAPACITY, flush_interval: float = FLUSH_INTERVAL) -> None:
        self.store = store
        self.flush_interval = flush_interval
        self._send, self._receive = trio.open_memory_channel[tuple[str, tuple[Any, ...]]](capacity)
        self._running = False
        self._write_order = trio.Lock()

    async def start_run(self, run_id: str, node_id: str, model: str, adapter: str) -> None:
        await self._submit((START_SQL, (run_id, node_id, model, adapter, time.time())))

    async def end_run(self, run_id: str, outcome: RunOutcome) -> None:
        params = (
            outcome.status, time.time(), outcome.ttft_ms, outcome.prompt_tokens,
            outcome.completion_tokens, outcome.error, run_id,
        )
        await self._submit((END_SQL, params))

    async def _submit(self, row: tuple[str, tuple[Any, ...]]) -> None:
        if self._running:
            try:
                try:
                    self._send.send_nowait(row)  # a memory operation: no need to yield
                except trio.WouldBlock:
                    await self._send.send(row)
                return
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the writer has stopped: write it ourselves
        async with self._write_order:
            await self.store.db.call(lambda conn: conn.execute(*row))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write queued rows until :meth:`close`; then (or when cancelled) flush the rest."""
        self._running = True
        task_status.started()
        batch: list[tuple[str, tuple[Any, ...]]] = []
        try:
            async for row in self._receive:
                batch = [row]
                await trio.sleep(self.flush_interval)
                batch += _drain(self._receive, BATCH_LIMIT - 1)
                # Cancelled here means not written: the call checks for cancellation before it
                # starts, and a started thread call always completes. `batch` then goes below.
                async with self._write_order:
                    await self.store.db.call(partial(_write, rows=batch))
                batch = []
        finally:
            self._running = False
            with trio.CancelScope(shield=True):
                # Shielded, the lock is taken before any task can write directly.
                async with self._write_order:
                    rest = batch + _drain(self._receive)
                    if rest:
                        await self.store.db.call(partial(_write, rows=rest))
                    self._receive.close()

    def close(self) -> None:
        """No more rows will come through the channel; ``run`` flushes and returns."""
        self._send.close()


def _drain(receive: trio.MemoryReceiveChannel[tuple[str, tuple[Any, ...]]], limit: int | None = None) -> list[tuple[str, tuple[Any, ...]]]:
    rows: list[tuple[str, tuple[Any, ...]]] = []
    while limit is None or len(rows) < limit:
        try:
            rows.append(receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            break
    return rows


def _write(conn: sqlite3.Connection, rows: list[tuple[str, tuple[Any, ...]]]) -> None:
    conn.execute("BEGIN")
    try:
        for sql, params in rows:
            conn.execute(sql, params)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
