"""Files and batches for the OpenAI Batch API: metadata in SQLite, file content on disk.

The edge (HTTP API) and the worker processes share one database (the edge's ``edge.db``, WAL) and
one files directory. Everything that must not happen twice is decided inside a ``BEGIN IMMEDIATE``
transaction, so it holds across processes:

- **Line leases.** A worker claims one pending line at a time: it writes a fresh ``lease_id``, its
  ``lease_owner`` and ``lease_expires_at``. Only a line whose lease is absent or expired can be
  claimed, so two workers never run the same line at once as long as the owner keeps renewing
  (:meth:`BatchStore.renew_leases`). A result is committed only with the lease it was claimed
  under (:meth:`BatchStore.complete_line`); a worker that lost its lease cannot write.
- **The freeze.** ``ending`` records how a batch will end (``completed``, ``expired``,
  ``cancelled``). Once it is set, no line can be claimed or committed any more, so the rows that
  make up the output and error files can no longer change, and writing them is idempotent.

Time is always passed in as ``now`` (seconds since the epoch), never read here: the worker's clock
is injectable, which lets MockClock tests drive leases and expiry deterministically.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, Literal, TypeVar

import trio
from attrs import frozen

from .sqlite import Database

T = TypeVar("T")

Ending = Literal["completed", "expired", "cancelled"]
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    id         TEXT NOT NULL UNIQUE,
    bytes      INTEGER NOT NULL,
    created_at REAL NOT NULL,
    filename   TEXT NOT NULL,
    purpose    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq               INTEGER PRIMARY KEY AUTOINCREMENT,
    id                TEXT NOT NULL UNIQUE,
    endpoint          TEXT NOT NULL,
    input_file_id     TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status            TEXT NOT NULL,
    ending            TEXT,
    metadata          TEXT,
    errors            TEXT,
    output_file_id    TEXT,
    error_file_id     TEXT,
    created_at        REAL NOT NULL,
    expires_at        REAL NOT NULL,
    in_progress_at    REAL,
    finalizing_at     REAL,
    completed_at      REAL,
    failed_at         REAL,
    expired_at        REAL,
    cancelling_at     REAL,
    cancelled_at      REAL,
    total             INTEGER NOT NULL DEFAULT 0,
    completed         INTEGER NOT NULL DEFAULT 0,
    failed            INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id         TEXT NOT NULL,
    line_no          INTEGER NOT NULL,
    custom_id        TEXT NOT NULL,
    body             TEXT NOT NULL,
    state            TEXT NOT NULL DEFAULT 'pending',
    ok               INTEGER,
    result           TEXT,
    lease_id         TEXT,
    lease_owner      TEXT,
    lease_expires_at REAL,
    finished_at      REAL,
    PRIMARY KEY (batch_id, line_no)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batch_lines_pending ON batch_lines (batch_id, state, line_no);
CREATE INDEX IF NOT EXISTS batch_lines_owner ON batch_lines (lease_owner) WHERE lease_owner IS NOT NULL;
"""


class UnknownCursor(KeyError):
    """A list's ``after`` names no object."""


@frozen
class FileRecord:
    id: str
    bytes: int
    created_at: float
    filename: str
    purpose: str


@frozen
class Batch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    ending: Ending | None
    metadata: dict[str, str] | None
    errors: list[dict[str, Any]] | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: float
    expires_at: float
    in_progress_at: float | None
    finalizing_at: float | None
    completed_at: float | None
    failed_at: float | None
    expired_at: float | None
    cancelling_at: float | None
    cancelled_at: float | None
    total: int
    completed: int
    failed: int

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Batch:
        values = {name: row[name] for name in row.keys() if name != "seq"}
        for name in ("metadata", "errors"):
            values[name] = None if values[name] is None else json.loads(values[name])
        return cls(**values)


@frozen
class OpenBatch:
    """A batch that is not finished yet, with what a worker needs to decide what to do with it."""

    id: str
    status: str
    ending: Ending | None
    endpoint: str
    input_file_id: str
    expires_at: float
    #: Lines without a result.
    pending: int
    #: Pending lines whose lease is absent or expired.
    claimable: int


@frozen
class NewLine:
    """A validated input line, stored when the batch starts."""

    line_no: int
    custom_id: str
    body: dict[str, Any]


@frozen
class ClaimedLine:
    batch_id: str
    line_no: int
    custom_id: str
    body: dict[str, Any]
    lease_id: str


@frozen
class LineRow:
    """A line as the output files see it: its result if it has one."""

    line_no: int
    custom_id: str
    ok: bool | None
    result: str | None


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


def _immediate(fn: Callable[[sqlite3.Connection], T]) -> Callable[[sqlite3.Connection], T]:
    """Run ``fn`` inside ``BEGIN IMMEDIATE``: the write lock is taken before anything is read, so
    a read-then-write decision cannot race another process. ``Database.call_sync`` commits (or
    rolls back on error) when ``fn`` returns."""

    def transaction(conn: sqlite3.Connection) -> T:
        conn.execute("BEGIN IMMEDIATE")
        return fn(conn)

    return transaction


def _placeholders(values: Sequence[object]) -> str:
    return ",".join("?" * len(values))


class BatchStore:
    """``in_thread=False`` runs statements and file IO on the event loop (MockClock tests only)."""

    def __init__(self, database: str | Path, files_dir: str | Path, *, in_thread: bool = True) -> None:
        self.db = Database(database, SCHEMA, in_thread=in_thread)
        self.files_dir = Path(files_dir)
        self.files_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_data_dir(cls, data_dir: str | Path, *, in_thread: bool = True) -> BatchStore:
        """The store of the edge whose ``data_dir`` this is: ``edge.db`` and ``files/``."""
        return cls(Path(data_dir) / "edge.db", Path(data_dir) / "files", in_thread=in_thread)

    def close(self) -> None:
        self.db.close()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking file IO, off the event loop unless the store runs in-loop for tests."""
        if not self.db.in_thread:
            await trio.lowlevel.checkpoint()
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args)

    # -- files -------------------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def _write_atomically(self, file_id: str, copy: Callable[[IO[bytes]], None]) -> int:
        """Write the content under a temporary name, fsync it, then rename it into place: a
        reader never sees half a file, and a committed row never points at lost content."""
        final = self.path_of(file_id)
        partial = final.with_name(f".{file_id}.{secrets.token_hex(4)}.partial")
        try:
            with partial.open("wb") as handle:
                copy(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)
        return final.stat().st_size

    async def save_upload(self, source: IO[bytes], filename: str, purpose: str, now: float) -> FileRecord:
        """Store an uploaded file: content first, then its row."""
        file_id = new_file_id()
        size = await self._io(self._write_atomically, file_id, lambda out: shutil.copyfileobj(source, out))
        record = FileRecord(file_id, size, now, filename, purpose)
        inserted = False
        try:
            await self.db.call(lambda conn: self._insert_file(conn, record))
            inserted = True
        finally:
            if not inserted:  # content nobody can reach: remove it (a quick unlink, no await)
                self.path_of(file_id).unlink(missing_ok=True)
        return record

    async def write_output(self, file_id: str, filename: str, lines: Iterable[str], now: float) -> FileRecord:
        """Write a worker-generated JSONL file to disk (its row is added by :meth:`finish`).
        ``file_id`` is derived from the batch, so writing it again yields the same file."""
        data = "".join(line + "\n" for line in lines).encode("utf-8")
        size = await self._io(self._write_atomically, file_id, lambda out: out.write(data))
        return FileRecord(file_id, size, now, filename, "batch_output")

    @staticmethod
    def _insert_file(conn: sqlite3.Connection, record: FileRecord) -> None:
        conn.execute(
            "INSERT INTO files (id, bytes, created_at, filename, purpose) VALUES (?, ?, ?, ?, ?)",
            (record.id, record.bytes, record.created_at, record.filename, record.purpose),
        )

    async def get_file(self, file_id: str) -> FileRecord | None:
        row = await self.db.call(
            lambda conn: conn.execute(
                "SELECT id, bytes, created_at, filename, purpose FROM files WHERE id = ?", (file_id,)
            ).fetchone()
        )
        return None if row is None else FileRecord(*row)

    async def read_file(self, file_id: str) -> bytes | None:
        """The content of a stored file, or None if it has no row or no content."""
        if await self.get_file(file_id) is None:
            return None
        try:
            return await self._io(self.path_of(file_id).read_bytes)
        except FileNotFoundError:
            return None

    async def list_files(
        self, *, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> tuple[list[FileRecord], bool]:
        """A page of files and whether more follow."""

        def query(conn: sqlite3.Connection) -> tuple[list[FileRecord], bool]:
            where, params = self._page_filter(conn, "files", after, ascending)
            if purpose is not None:
                where.append("purpose = ?")
                params.append(purpose)
            rows = conn.execute(
                "SELECT id, bytes, created_at, filename, purpose FROM files "
                f"{self._where(where)} ORDER BY seq {'ASC' if ascending else 'DESC'} LIMIT ?",
                (*params, limit + 1),
            ).fetchall()
            return [FileRecord(*row) for row in rows[:limit]], len(rows) > limit

        return await self.db.call(query)

    async def delete_file(self, file_id: str) -> bool:
        deleted = await self.db.call(
            lambda conn: conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount == 1
        )
        if deleted:
            await self.discard_content(file_id)
        return deleted

    async def discard_content(self, file_id: str) -> None:
        await self._io(self.path_of(file_id).unlink, True)

    # -- batches: the API side ---------------------------------------------------------------

    async def create_batch(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window_seconds: float,
        metadata: dict[str, str] | None,
        now: float,
    ) -> Batch:
        batch_id = new_batch_id()

        def insert(conn: sqlite3.Connection) -> Batch:
            conn.execute(
                "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, metadata, "
                "created_at, expires_at) VALUES (?, ?, ?, ?, 'validating', ?, ?, ?)",
                (
                    batch_id, endpoint, input_file_id, completion_window,
                    None if metadata is None else json.dumps(metadata), now, now + window_seconds,
                ),
            )
            return self._batch(conn, batch_id)

        return await self.db.call(insert)

    async def get_batch(self, batch_id: str) -> Batch | None:
        return await self.db.call(lambda conn: self._find_batch(conn, batch_id))

    async def list_batches(self, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """Newest first, as OpenAI lists them."""

        def query(conn: sqlite3.Connection) -> tuple[list[Batch], bool]:
            where, params = self._page_filter(conn, "batches", after, ascending=False)
            rows = conn.execute(
                f"SELECT * FROM batches {self._where(where)} ORDER BY seq DESC LIMIT ?", (*params, limit + 1)
            ).fetchall()
            return [Batch.from_row(row) for row in rows[:limit]], len(rows) > limit

        return await self.db.call(query)

    async def cancel_batch(self, batch_id: str, now: float) -> Batch | None:
        """Move a validating or in-progress batch to ``cancelling``. Returns the batch as it is
        afterwards (unchanged if it could not be cancelled), or None if there is no such batch."""

        def cancel(conn: sqlite3.Connection) -> Batch | None:
            conn.execute(
                "UPDATE batches SET status = 'cancelling', ending = 'cancelled', cancelling_at = ? "
                "WHERE id = ? AND status IN ('validating', 'in_progress') AND ending IS NULL",
                (now, batch_id),
            )
            return self._find_batch(conn, batch_id)

        return await self.db.call(_immediate(cancel))

    # -- batches: the worker side ------------------------------------------------------------

    async def open_batches(self, now: float) -> list[OpenBatch]:
        """Every batch not finished yet, oldest first, with its pending and claimable lines."""
        rows = await self.db.call(
            lambda conn: conn.execute(
                "SELECT b.id, b.status, b.ending, b.endpoint, b.input_file_id, b.expires_at, "
                "(SELECT count(*) FROM batch_lines l WHERE l.batch_id = b.id AND l.state = 'pending'), "
                "(SELECT count(*) FROM batch_lines l WHERE l.batch_id = b.id AND l.state = 'pending' "
                " AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= ?)) "
                f"FROM batches b WHERE b.status IN ({_placeholders(OPEN_STATUSES)}) ORDER BY b.seq",
                (now, *OPEN_STATUSES),
            ).fetchall()
        )
        return [OpenBatch(*row) for row in rows]

    async def begin_batch(self, batch_id: str, lines: Sequence[NewLine], now: float) -> bool:
        """validating -> in_progress, storing the validated lines. False if the batch was no
        longer validating (another worker got there first, or it was cancelled or expired)."""

        def begin(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?, total = ? "
                "WHERE id = ? AND status = 'validating' AND ending IS NULL",
                (now, len(lines), batch_id),
            )
            if cursor.rowcount != 1:
                return False
            conn.executemany(
                "INSERT INTO batch_lines (batch_id, line_no, custom_id, body) VALUES (?, ?, ?, ?)",
                ((batch_id, line.line_no, line.custom_id, json.dumps(line.body)) for line in lines),
            )
            return True

        return await self.db.call(_immediate(begin))

    async def fail_batch(self, batch_id: str, errors: Sequence[dict[str, Any]], now: float) -> bool:
        """validating -> failed, with the validation errors."""
        return await self.db.call(
            _immediate(
                lambda conn: conn.execute(
                    "UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                    "WHERE id = ? AND status = 'validating' AND ending IS NULL",
                    (now, json.dumps(list(errors)), batch_id),
                ).rowcount
                == 1
            )
        )

    async def claim_line(self, batch_id: str, owner: str, now: float, ttl: float) -> ClaimedLine | None:
        """Lease the first pending line nobody holds (or whose lease expired), if the batch still
        accepts work."""
        lease_id = secrets.token_hex(8)

        def claim(conn: sqlite3.Connection) -> ClaimedLine | None:
            row = conn.execute(
                "SELECT l.line_no, l.custom_id, l.body FROM batch_lines l JOIN batches b ON b.id = l.batch_id "
                "WHERE l.batch_id = ? AND l.state = 'pending' "
                "AND (l.lease_expires_at IS NULL OR l.lease_expires_at <= ?) "
                "AND b.status = 'in_progress' AND b.ending IS NULL AND b.expires_at > ? "
                "ORDER BY l.line_no LIMIT 1",
                (batch_id, now, now),
            ).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE batch_lines SET lease_id = ?, lease_owner = ?, lease_expires_at = ? "
                "WHERE batch_id = ? AND line_no = ?",
                (lease_id, owner, now + ttl, batch_id, row["line_no"]),
            )
            return ClaimedLine(batch_id, row["line_no"], row["custom_id"], json.loads(row["body"]), lease_id)

        return await self.db.call(_immediate(claim))

    async def renew_leases(self, owner: str, now: float, ttl: float) -> set[str]:
        """Extend every lease ``owner`` still holds; returns their ids. A lease missing from the
        answer was taken over by another worker after it expired."""
        rows = await self.db.call(
            lambda conn: conn.execute(
                "UPDATE batch_lines SET lease_expires_at = ? "
                "WHERE lease_owner = ? AND state = 'pending' RETURNING lease_id",
                (now + ttl, owner),
            ).fetchall()
        )
        return {row[0] for row in rows}

    async def release_leases(self, lease_ids: Sequence[str]) -> None:
        """Give lines back without a result, so another worker need not wait for expiry."""
        if lease_ids:
            await self.db.execute(
                "UPDATE batch_lines SET lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL "
                f"WHERE state = 'pending' AND lease_id IN ({_placeholders(lease_ids)})",
                tuple(lease_ids),
            )

    async def complete_line(self, line: ClaimedLine, result: str, ok: bool, now: float) -> bool:
        """Commit a line's result and the batch's counts, in one transaction. False (nothing
        written) if the lease was lost or the batch stopped accepting results."""

        def complete(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE batch_lines SET state = 'done', ok = ?, result = ?, finished_at = ?, "
                "lease_id = NULL, lease_owner = NULL, lease_expires_at = NULL "
                "WHERE batch_id = ? AND line_no = ? AND lease_id = ? AND state = 'pending' "
                "AND EXISTS (SELECT 1 FROM batches WHERE id = ? AND status = 'in_progress' AND ending IS NULL)",
                (int(ok), result, now, line.batch_id, line.line_no, line.lease_id, line.batch_id),
            )
            if cursor.rowcount != 1:
                return False
            column = "completed" if ok else "failed"
            conn.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (line.batch_id,))
            return True

        return await self.db.call(_immediate(complete))

    async def expire_batch(self, batch_id: str, now: float) -> bool:
        """Freeze a batch whose completion window has passed: it ends ``expired``."""
        return await self.db.call(
            _immediate(
                lambda conn: conn.execute(
                    "UPDATE batches SET ending = 'expired' WHERE id = ? AND ending IS NULL "
                    "AND status IN ('validating', 'in_progress') AND expires_at <= ?",
                    (batch_id, now),
                ).rowcount
                == 1
            )
        )

    async def begin_finalizing(self, batch_id: str, now: float) -> bool:
        """in_progress -> finalizing once every line has its result: it ends ``completed``."""
        return await self.db.call(
            _immediate(
                lambda conn: conn.execute(
                    "UPDATE batches SET status = 'finalizing', ending = 'completed', finalizing_at = ? "
                    "WHERE id = ? AND status = 'in_progress' AND ending IS NULL AND NOT EXISTS "
                    "(SELECT 1 FROM batch_lines WHERE batch_id = ? AND state = 'pending')",
                    (now, batch_id, batch_id),
                ).rowcount
                == 1
            )
        )

    async def lines(self, batch_id: str) -> list[LineRow]:
        rows = await self.db.call(
            lambda conn: conn.execute(
                "SELECT line_no, custom_id, ok, result FROM batch_lines WHERE batch_id = ? ORDER BY line_no",
                (batch_id,),
            ).fetchall()
        )
        return [LineRow(row[0], row[1], None if row[2] is None else bool(row[2]), row[3]) for row in rows]

    async def finish(
        self,
        batch_id: str,
        ending: Ending,
        output: FileRecord | None,
        errors: FileRecord | None,
        now: float,
    ) -> bool:
        """The last step of a frozen batch: register its output files and set its final status.
        Lines still pending (expired batches) count as failed: they are in the error file."""

        def finish(conn: sqlite3.Connection) -> bool:
            unfinished = 0
            if ending == "expired":
                unfinished = conn.execute(
                    "SELECT count(*) FROM batch_lines WHERE batch_id = ? AND state = 'pending'", (batch_id,)
                ).fetchone()[0]
            cursor = conn.execute(
                f"UPDATE batches SET status = ?, {ending}_at = ?, output_file_id = ?, error_file_id = ?, "
                "failed = failed + ? "
                f"WHERE id = ? AND ending = ? AND status IN ({_placeholders(OPEN_STATUSES)})",
                (
                    ending, now, None if output is None else output.id, None if errors is None else errors.id,
                    unfinished, batch_id, ending, *OPEN_STATUSES,
                ),
            )
            if cursor.rowcount != 1:
                return False
            for record in (output, errors):
                if record is not None:
                    self._insert_file(conn, record)
            return True

        return await self.db.call(_immediate(finish))

    # -- helpers -----------------------------------------------------------------------------

    def _find_batch(self, conn: sqlite3.Connection, batch_id: str) -> Batch | None:
        row = conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else Batch.from_row(row)

    def _batch(self, conn: sqlite3.Connection, batch_id: str) -> Batch:
        batch = self._find_batch(conn, batch_id)
        assert batch is not None
        return batch

    @staticmethod
    def _page_filter(
        conn: sqlite3.Connection, table: str, after: str | None, ascending: bool
    ) -> tuple[list[str], list[Any]]:
        if after is None:
            return [], []
        row = conn.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
        if row is None:
            raise UnknownCursor(after)
        return [f"seq {'>' if ascending else '<'} ?"], [row[0]]

    @staticmethod
    def _where(conditions: list[str]) -> str:
        return "WHERE " + " AND ".join(conditions) if conditions else ""
