"""RunStore: one row per run, ended exactly once, interrupted runs closed on reopen, WAL."""

from __future__ import annotations

import itertools
import sqlite3
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import iop_trio.store.runs as runs_module
from iop_trio.store import FINAL_STATUSES, RunOutcome, RunStore


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The store's wall clock ticks one second per call, so ordering is never a tie."""
    ticks: list[float] = []
    counter = itertools.count(1_700_000_000)

    def now() -> float:
        ticks.append(float(next(counter)))
        return ticks[-1]

    monkeypatch.setattr(runs_module, "time", types.SimpleNamespace(time=now))
    yield ticks


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "runs.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[RunStore]:
    runs = RunStore(db_path)
    try:
        yield runs
    finally:
        runs.close()


def row(store: RunStore, run_id: str) -> dict[str, object]:
    (found,) = [r for r in store.list_runs(limit=1000) if r["run_id"] == run_id]
    return found


async def test_start_run_writes_a_running_row(store: RunStore) -> None:
    await store.start_run("r1", "node-1", "model-a", "mock")
    r = row(store, "r1")
    assert r["status"] == "running"
    assert r["node_id"] == "node-1"
    assert r["model"] == "model-a"
    assert r["adapter"] == "mock"
    assert r["started_at"] is not None
    assert r["ended_at"] is None
    assert r["ttft_ms"] is None
    assert (r["prompt_tokens"], r["completion_tokens"]) == (0, 0)
    assert r["error"] is None


@pytest.mark.parametrize("status", FINAL_STATUSES)
async def test_end_run_records_the_outcome(store: RunStore, status: str) -> None:
    await store.start_run("r1", "node-1", "model-a", "mock")
    error = None if status == "complete" else f"{status} because"
    outcome = RunOutcome(
        status=status,  # type: ignore[arg-type]
        prompt_tokens=12,
        completion_tokens=34,
        ttft_ms=56.5,
        error=error,
    )
    assert await store.end_run("r1", outcome) is True

    r = row(store, "r1")
    assert r["status"] == status
    assert r["prompt_tokens"] == 12
    assert r["completion_tokens"] == 34
    assert r["ttft_ms"] == pytest.approx(56.5)
    assert r["error"] == error
    assert isinstance(r["ended_at"], float)
    assert isinstance(r["started_at"], float)
    assert r["ended_at"] >= r["started_at"]


async def test_end_run_without_ttft(store: RunStore) -> None:
    await store.start_run("r1", "n", "m", "mock")
    assert await store.end_run("r1", RunOutcome("error", error="backend_error: boom"))
    r = row(store, "r1")
    assert r["ttft_ms"] is None
    assert r["completion_tokens"] == 0
    assert r["error"] == "backend_error: boom"


async def test_end_run_twice_does_not_overwrite(store: RunStore) -> None:
    await store.start_run("r1", "n", "m", "mock")
    assert await store.end_run("r1", RunOutcome("complete", 1, 2, 3.0)) is True
    first = row(store, "r1")

    assert await store.end_run("r1", RunOutcome("cancelled", 9, 9, 9.0, "late")) is False
    assert await store.end_run("r1", RunOutcome("error", error="later still")) is False
    assert row(store, "r1") == first
    assert first["status"] == "complete"


async def test_end_unknown_run_returns_false(store: RunStore) -> None:
    assert await store.end_run("never-started", RunOutcome("complete")) is False
    assert store.list_runs() == []


async def test_start_run_twice_is_an_error(store: RunStore) -> None:
    await store.start_run("r1", "n", "m", "mock")
    with pytest.raises(sqlite3.IntegrityError):
        await store.start_run("r1", "n", "m", "mock")


async def test_list_runs_newest_first_filtered_and_limited(
    store: RunStore, fake_time: list[float]
) -> None:
    statuses = ["complete", "error", "running", "complete", "cancelled", "complete", "running"]
    for index, status in enumerate(statuses):
        run_id = f"r{index}"
        await store.start_run(run_id, "n", "m", "mock")
        if status != "running":
            await store.end_run(run_id, RunOutcome(status))  # type: ignore[arg-type]

    newest_first = [f"r{i}" for i in reversed(range(len(statuses)))]
    assert [r["run_id"] for r in store.list_runs()] == newest_first
    assert [r["run_id"] for r in store.list_runs(limit=3)] == newest_first[:3]
    assert [r["run_id"] for r in store.list_runs(status="complete")] == ["r5", "r3", "r0"]
    assert [r["run_id"] for r in store.list_runs(status="complete", limit=2)] == ["r5", "r3"]
    assert [r["run_id"] for r in store.list_runs(status="running")] == ["r6", "r2"]
    assert [r["run_id"] for r in store.list_runs(status="error")] == ["r1"]
    assert [r["run_id"] for r in store.list_runs(status="cancelled")] == ["r4"]
    assert store.list_runs(status="nonsense") == []
    # No status filter at all (None or empty) lists everything.
    assert len(store.list_runs(status=None)) == len(statuses)
    assert len(store.list_runs(status="")) == len(statuses)


async def test_list_runs_default_limit(store: RunStore, fake_time: list[float]) -> None:
    for index in range(60):
        await store.start_run(f"r{index}", "n", "m", "mock")
    runs = store.list_runs()
    assert len(runs) == 50
    assert runs[0]["run_id"] == "r59"
    assert len(store.list_runs(limit=100)) == 60


async def test_reopening_marks_running_rows_as_interrupted(db_path: Path) -> None:
    first = RunStore(db_path)
    try:
        await first.start_run("done", "n", "m", "mock")
        await first.end_run("done", RunOutcome("complete", 3, 4, 5.0))
        await first.start_run("cancelled", "n", "m", "mock")
        await first.end_run("cancelled", RunOutcome("cancelled", error="client went away"))
        await first.start_run("open-1", "n", "m", "mock")
        await first.start_run("open-2", "n", "m", "mock")
        before = {r["run_id"]: r for r in first.list_runs()}
    finally:
        first.close()  # the process "exits" with two runs still running

    second = RunStore(db_path)
    try:
        after = {r["run_id"]: r for r in second.list_runs()}
        assert second.list_runs(status="running") == []
        for run_id in ("open-1", "open-2"):
            assert after[run_id]["status"] == "error"
            assert "interrupted" in str(after[run_id]["error"])
            assert after[run_id]["ended_at"] is not None
        # Runs that had already ended are left exactly as they were.
        assert after["done"] == before["done"]
        assert after["cancelled"] == before["cancelled"]
        # And an interrupted run cannot be ended a second time by anyone.
        assert await second.end_run("open-1", RunOutcome("complete")) is False
    finally:
        second.close()

    third = RunStore(db_path)
    try:
        # Reopening again changes nothing: the interruption was recorded exactly once.
        assert {r["run_id"]: r for r in third.list_runs()} == after
    finally:
        third.close()


async def test_runs_persist_across_reopen(db_path: Path) -> None:
    first = RunStore(db_path)
    try:
        await first.start_run("r1", "n", "m", "mock")
        await first.end_run("r1", RunOutcome("complete", 1, 2, 3.0))
    finally:
        first.close()
    second = RunStore(db_path)
    try:
        (r,) = second.list_runs()
        assert (r["run_id"], r["status"], r["prompt_tokens"], r["completion_tokens"]) == (
            "r1",
            "complete",
            1,
            2,
        )
    finally:
        second.close()


def test_wal_mode_is_on(store: RunStore, db_path: Path) -> None:
    mode = store.db.call_sync(lambda conn: conn.execute("PRAGMA journal_mode").fetchone()[0])
    assert mode.lower() == "wal"
    # WAL is a property of the database file: a separate connection sees it too.
    other = sqlite3.connect(db_path)
    try:
        assert other.execute("PRAGMA journal_mode").fetchone()[0].lower() == "wal"
    finally:
        other.close()


def test_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "c" / "runs.db"
    runs = RunStore(path)
    try:
        assert path.is_file()
        assert runs.list_runs() == []
    finally:
        runs.close()
