"""Run history: one row per run, written when it starts and once more when it ends."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from attrs import frozen

from .sqlite import Database

RunStatus = Literal["running", "complete", "error", "cancelled"]
FINAL_STATUSES = ("complete", "error", "cancelled")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id            TEXT PRIMARY KEY,
    node_id           TEXT NOT NULL,
    model             TEXT NOT NULL,
    adapter           TEXT NOT NULL,
    status            TEXT NOT NULL,
    started_at        REAL NOT NULL,
    ended_at          REAL,
    ttft_ms           REAL,
    prompt_tokens     INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    error             TEXT
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, started_at);
"""


START_SQL = (
    "INSERT INTO runs (run_id, node_id, model, adapter, status, started_at) VALUES (?, ?, ?, ?, 'running', ?)"
)
#: Only a running row is updated: a run's end is recorded once and never overwritten.
END_SQL = (
    "UPDATE runs SET status=?, ended_at=?, ttft_ms=?, prompt_tokens=?, completion_tokens=?, error=? "
    "WHERE run_id=? AND status='running'"
)


@frozen
class RunOutcome:
    status: Literal["complete", "error", "cancelled"]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None
    error: str | None = None


class RunStore:
    def __init__(self, path: str | Path, *, in_thread: bool = True, owner: bool = True) -> None:
        """``owner``: this process writes the history (a node or edge). Only the owner may close
        runs a previous process left open; a reader (``iop-trio runs``) must not touch them."""
        self.db = Database(path, SCHEMA, in_thread=in_thread)
        if not owner:
            return
        # Runs a previous process left open cannot finish any more: end them, exactly once.
        self.db.call_sync(
            lambda conn: conn.execute(
                "UPDATE runs SET status='error', ended_at=?, error='interrupted: process exited' "
                "WHERE status='running'",
                (time.time(),),
            )
        )

    async def start_run(self, run_id: str, node_id: str, model: str, adapter: str) -> None:
        await self.db.execute(START_SQL, (run_id, node_id, model, adapter, time.time()))

    async def end_run(self, run_id: str, outcome: RunOutcome) -> bool:
        """Record the run's end. Returns False if it had already ended (never overwritten)."""

        def update(conn: Any) -> bool:
            cursor = conn.execute(
                END_SQL,
                (
                    outcome.status,
                    time.time(),
                    outcome.ttft_ms,
                    outcome.prompt_tokens,
                    outcome.completion_tokens,
                    outcome.error,
                    run_id,
                ),
            )
            return bool(cursor.rowcount == 1)

        return await self.db.call(update)

    def list_runs(self, status: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """Most recent first. Synchronous: for the ``runs`` command and tests."""
        sql = "SELECT * FROM runs"
        params: tuple[Any, ...] = ()
        if status:
            sql += " WHERE status = ?"
            params = (status,)
        sql += " ORDER BY started_at DESC LIMIT ?"
        rows = self.db.call_sync(lambda conn: conn.execute(sql, (*params, limit)).fetchall())
        return [dict(row) for row in rows]

    def close(self) -> None:
        self.db.close()
