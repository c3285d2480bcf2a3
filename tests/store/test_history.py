"""RunRecorder: rows queued on the hot path, written in batches, never lost on the way out."""

from __future__ import annotations

import pytest
import trio
import trio.lowlevel

from iop_trio.store import RunOutcome, RunRecorder, RunStore


@pytest.fixture
def store(tmp_path):
    run_store = RunStore(tmp_path / "runs.db")
    yield run_store
    run_store.close()


async def test_rows_written_by_the_writer_in_batches(store) -> None:
    recorder = RunRecorder(store)
    calls = 0
    real_call = store.db.call

    async def counting_call(fn):
        nonlocal calls
        calls += 1
        return await real_call(fn)

    store.db.call = counting_call
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        for index in range(300):
            await recorder.start_run(f"r{index}", "n", "m", "mock")
            await recorder.end_run(f"r{index}", RunOutcome("complete", 2, 5, 1.5))
        recorder.close()
    rows = store.list_runs(limit=1000)
    assert len(rows) == 300 and {r["status"] for r in rows} == {"complete"}
    assert all(r["ended_at"] >= r["started_at"] for r in rows)
    assert calls < 10  # 600 rows, a handful of transactions


async def test_the_end_of_a_run_is_never_overwritten(store) -> None:
    recorder = RunRecorder(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        await recorder.start_run("r", "n", "m", "mock")
        await recorder.end_run("r", RunOutcome("cancelled", error="client went away"))
        await recorder.end_run("r", RunOutcome("complete"))
        recorder.close()
    (row,) = store.list_runs()
    assert (row["status"], row["error"]) == ("cancelled", "client went away")


async def test_queued_rows_are_flushed_when_the_writer_is_cancelled(store) -> None:
    recorder = RunRecorder(store)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(recorder.run)
            for index in range(50):
                recorder._send.send_nowait(  # queued but not yet taken by the writer
                    ("INSERT INTO runs (run_id, node_id, model, adapter, status, started_at) "
                     "VALUES (?, 'n', 'm', 'mock', 'running', 0)", (f"r{index}",))
                )
            scope.cancel()
    assert len(store.list_runs(limit=100)) == 50


async def test_rows_are_written_directly_when_no_writer_runs(store) -> None:
    recorder = RunRecorder(store)
    await recorder.start_run("before", "n", "m", "mock")
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        recorder.close()
    await recorder.end_run("before", RunOutcome("complete"))  # after the writer stopped
    (row,) = store.list_runs()
    assert row["status"] == "complete"


async def test_synchronous_reads_never_land_inside_the_writers_transaction(store) -> None:
    """Tests and `iop-trio runs` read from the event loop while the writer thread commits."""
    recorder = RunRecorder(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)

        async def write() -> None:
            for index in range(2000):
                await recorder.start_run(f"r{index}", "n", "m", "mock")
            recorder.close()

        nursery.start_soon(write)
        for _ in range(200):
            store.list_runs(limit=5)  # must not commit, or break, the writer's open transaction
            await trio.lowlevel.checkpoint()
    assert len(store.list_runs(limit=5000)) == 2000


async def test_rows_wait_for_the_flush_interval_then_go_in_one_transaction(tmp_path, autojump_clock) -> None:
    store = RunStore(tmp_path / "runs.db", in_thread=False)
    recorder = RunRecorder(store, flush_interval=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(recorder.run)
        await recorder.start_run("a", "n", "m", "mock")
        await trio.sleep(0.5)
        await recorder.start_run("b", "n", "m", "mock")
        assert store.list_runs() == []  # both still queued, half-way through the interval
        await trio.sleep(0.6)
        assert {r["run_id"] for r in store.list_runs()} == {"a", "b"}
        recorder.close()
    store.close()


async def test_an_end_written_directly_never_overtakes_its_queued_start(tmp_path) -> None:
    """A crash cancels the writer while a start is queued; the run's own end then comes too late
    for the channel and is written directly: it must land after the start, or the row would stay
    ``running`` for ever. (On the event loop, so only the lock decides the order.)"""
    store = RunStore(tmp_path / "runs.db", in_thread=False)
    for attempt in range(20):
        recorder = RunRecorder(store, flush_interval=60)
        crash = trio.CancelScope()

        async def writer(
            task_status: trio.TaskStatus[None], scope: trio.CancelScope = crash, recorder: RunRecorder = recorder
        ) -> None:
            with scope:
                await recorder.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(writer)
            await recorder.start_run(f"r{attempt}", "n", "m", "mock")  # queued: the writer waits 60 s
            crash.cancel()
            while recorder._running:  # until the writer is flushing
                await trio.lowlevel.checkpoint()
            await recorder.end_run(f"r{attempt}", RunOutcome("cancelled"))
    assert {r["status"] for r in store.list_runs(limit=100)} == {"cancelled"}
    store.close()
