"""BatchStore: files on disk + rows, the batch lifecycle's guarded transitions, line leases.

Two stores opened on one database stand for two processes (the edge and a worker, or two workers):
each has its own SQLite connection, exactly as separate processes would.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_trio.store.batches import BatchStore, ClaimedLine, NewLine, UnknownCursor

TTL = 30.0
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    batches = BatchStore.for_data_dir(tmp_path / "edge")
    try:
        yield batches
    finally:
        batches.close()


@pytest.fixture
def other(tmp_path: Path, store: BatchStore) -> Iterator[BatchStore]:
    """A second connection to the same database: another process."""
    batches = BatchStore.for_data_dir(tmp_path / "edge")
    try:
        yield batches
    finally:
        batches.close()


async def upload(store: BatchStore, content: bytes = b'{"x": 1}\n', purpose: str = "batch", now: float = 100.0) -> str:
    return (await store.save_upload(io.BytesIO(content), "in.jsonl", purpose, now)).id


async def started_batch(store: BatchStore, lines: int = 3, now: float = 100.0, window: float = 3600.0) -> str:
    file_id = await upload(store)
    batch = await store.create_batch(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h",
        window_seconds=window, metadata=None, now=now,
    )
    assert await store.begin_batch(batch.id, [NewLine(n, f"c{n}", BODY) for n in range(1, lines + 1)], now)
    return batch.id


async def test_an_upload_is_written_to_disk_and_described_by_a_row(store: BatchStore) -> None:
    record = await store.save_upload(io.BytesIO(b"line one\nline two\n"), "input.jsonl", "batch", 123.0)
    assert record.id.startswith("file-") and record.bytes == 18
    assert (record.filename, record.purpose, record.created_at) == ("input.jsonl", "batch", 123.0)
    assert store.path_of(record.id).read_bytes() == b"line one\nline two\n"
    assert await store.get_file(record.id) == record
    assert await store.read_file(record.id) == b"line one\nline two\n"
    assert not list(store.files_dir.glob(".*")), "no partial files left behind"


async def test_deleting_a_file_removes_row_and_content(store: BatchStore) -> None:
    file_id = await upload(store)
    assert await store.delete_file(file_id)
    assert await store.get_file(file_id) is None
    assert await store.read_file(file_id) is None
    assert not store.path_of(file_id).exists()
    assert not await store.delete_file(file_id)


async def test_files_are_listed_in_pages_both_ways_and_by_purpose(store: BatchStore) -> None:
    ids = [await upload(store, now=float(n)) for n in range(5)]
    newest_first, more = await store.list_files(purpose=None, after=None, limit=2, ascending=False)
    assert [r.id for r in newest_first] == ids[:2:-1][:2] and more
    rest, more = await store.list_files(purpose=None, after=newest_first[-1].id, limit=10, ascending=False)
    assert [r.id for r in rest] == ids[2::-1] and not more
    oldest_first, more = await store.list_files(purpose=None, after=ids[1], limit=10, ascending=True)
    assert [r.id for r in oldest_first] == ids[2:] and not more
    assert (await store.list_files(purpose="batch_output", after=None, limit=10, ascending=True)) == ([], False)
    with pytest.raises(UnknownCursor):
        await store.list_files(purpose=None, after="file-nope", limit=10, ascending=True)


async def test_a_batch_is_created_validating_and_listed_newest_first(store: BatchStore) -> None:
    file_id = await upload(store)
    created = [
        await store.create_batch(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
            window_seconds=86400.0, metadata={"n": str(n)}, now=1000.0 + n,
        )
        for n in range(3)
    ]
    first = created[0]
    assert first.status == "validating" and first.ending is None
    assert (first.created_at, first.expires_at) == (1000.0, 87400.0)
    assert first.metadata == {"n": "0"} and (first.total, first.completed, first.failed) == (0, 0, 0)
    assert await store.get_batch(first.id) == first
    assert await store.get_batch("batch_nope") is None
    page, more = await store.list_batches(after=None, limit=2)
    assert [b.id for b in page] == [created[2].id, created[1].id] and more
    page, more = await store.list_batches(after=created[1].id, limit=2)
    assert [b.id for b in page] == [first.id] and not more


async def test_begin_batch_stores_lines_once(store: BatchStore, other: BatchStore) -> None:
    batch_id = await started_batch(store, lines=3)
    batch = await store.get_batch(batch_id)
    assert batch is not None and batch.status == "in_progress" and batch.total == 3 and batch.in_progress_at == 100.0
    assert not await other.begin_batch(batch_id, [NewLine(9, "late", BODY)], 101.0), "another worker lost the race"
    assert [row.custom_id for row in await store.lines(batch_id)] == ["c1", "c2", "c3"]


async def test_fail_batch_records_errors_only_while_validating(store: BatchStore) -> None:
    file_id = await upload(store)
    batch = await store.create_batch(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h",
        window_seconds=10.0, metadata=None, now=0.0,
    )
    errors = [{"code": "invalid_json_line", "message": "bad", "param": None, "line": 2}]
    assert await store.fail_batch(batch.id, errors, 5.0)
    failed = await store.get_batch(batch.id)
    assert failed is not None and failed.status == "failed" and failed.failed_at == 5.0 and failed.errors == errors
    assert not await store.fail_batch(batch.id, errors, 6.0)


async def test_claims_are_exclusive_across_connections(store: BatchStore, other: BatchStore) -> None:
    batch_id = await started_batch(store, lines=2)
    a = await store.claim_line(batch_id, "worker-a", 100.0, TTL)
    b = await other.claim_line(batch_id, "worker-b", 100.0, TTL)
    assert a is not None and b is not None
    assert (a.line_no, b.line_no) == (1, 2) and a.lease_id != b.lease_id
    assert a.body == BODY and a.custom_id == "c1"
    assert await store.claim_line(batch_id, "worker-c", 100.0 + TTL - 0.001, TTL) is None


async def test_an_expired_lease_is_taken_over_and_the_old_holder_cannot_commit(store: BatchStore, other: BatchStore) -> None:
    batch_id = await started_batch(store, lines=1)
    old = await store.claim_line(batch_id, "worker-a", 100.0, TTL)
    assert old is not None
    new = await other.claim_line(batch_id, "worker-b", 100.0 + TTL, TTL)
    assert new is not None and new.line_no == old.line_no
    assert await store.renew_leases("worker-a", 131.0, TTL) == set()
    assert await other.renew_leases("worker-b", 131.0, TTL) == {new.lease_id}
    assert not await store.complete_line(old, '{"old": true}', True, 132.0)
    assert await other.complete_line(new, '{"new": true}', True, 132.0)
    (row,) = await store.lines(batch_id)
    assert row.result == '{"new": true}' and row.ok


async def test_renewal_keeps_a_lease_from_being_taken_over(store: BatchStore, other: BatchStore) -> None:
    batch_id = await started_batch(store, lines=1)
    line = await store.claim_line(batch_id, "worker-a", 100.0, TTL)
    assert line is not None
    assert await store.renew_leases("worker-a", 120.0, TTL) == {line.lease_id}
    assert await other.claim_line(batch_id, "worker-b", 140.0, TTL) is None
    assert await other.claim_line(batch_id, "worker-b", 150.0, TTL) is not None


async def test_a_released_lease_is_claimable_at_once(store: BatchStore, other: BatchStore) -> None:
    batch_id = await started_batch(store, lines=1)
    line = await store.claim_line(batch_id, "worker-a", 100.0, TTL)
    assert line is not None
    await store.release_leases([line.lease_id])
    again = await other.claim_line(batch_id, "worker-b", 100.5, TTL)
    assert again is not None and again.line_no == line.line_no


async def test_completing_lines_keeps_request_counts_current(store: BatchStore) -> None:
    batch_id = await started_batch(store, lines=3)
    for ok in (True, False):
        line = await store.claim_line(batch_id, "w", 100.0, TTL)
        assert line is not None
        assert await store.complete_line(line, json.dumps({"ok": ok}), ok, 101.0)
        assert not await store.complete_line(line, "{}", ok, 101.0), "a line is committed once"
    batch = await store.get_batch(batch_id)
    assert batch is not None and (batch.total, batch.completed, batch.failed) == (3, 1, 1)
    [open_batch] = await store.open_batches(101.0)
    assert (open_batch.pending, open_batch.claimable) == (1, 1)


async def test_cancel_freezes_the_batch(store: BatchStore) -> None:
    batch_id = await started_batch(store, lines=2)
    line = await store.claim_line(batch_id, "w", 100.0, TTL)
    assert line is not None
    cancelled = await store.cancel_batch(batch_id, 105.0)
    assert cancelled is not None and cancelled.status == "cancelling" and cancelled.ending == "cancelled"
    assert cancelled.cancelling_at == 105.0
    assert not await store.complete_line(line, "{}", True, 106.0), "no result is accepted after the freeze"
    assert await store.claim_line(batch_id, "w", 106.0, TTL) is None
    again = await store.cancel_batch(batch_id, 107.0)
    assert again is not None and again.cancelling_at == 105.0
    assert await store.cancel_batch("batch_nope", 107.0) is None


async def test_expiry_happens_only_after_the_window(store: BatchStore) -> None:
    batch_id = await started_batch(store, lines=1, now=100.0, window=50.0)
    assert not await store.expire_batch(batch_id, 149.9)
    assert await store.claim_line(batch_id, "w", 150.0, TTL) is None, "no new work once the window is over"
    assert await store.expire_batch(batch_id, 150.0)
    batch = await store.get_batch(batch_id)
    assert batch is not None and batch.ending == "expired" and batch.status == "in_progress"
    assert not await store.expire_batch(batch_id, 151.0)


async def test_finalizing_waits_for_every_line(store: BatchStore) -> None:
    batch_id = await started_batch(store, lines=1)
    assert not await store.begin_finalizing(batch_id, 101.0)
    line = await store.claim_line(batch_id, "w", 100.0, TTL)
    assert line is not None and await store.complete_line(line, "{}", True, 101.0)
    assert await store.begin_finalizing(batch_id, 102.0)
    batch = await store.get_batch(batch_id)
    assert batch is not None and (batch.status, batch.ending, batch.finalizing_at) == ("finalizing", "completed", 102.0)


async def test_finish_registers_files_and_sets_the_final_status_once(store: BatchStore) -> None:
    batch_id = await started_batch(store, lines=3, now=100.0, window=10.0)
    line = await store.claim_line(batch_id, "w", 100.0, TTL)
    assert isinstance(line, ClaimedLine) and await store.complete_line(line, '{"a": 1}', True, 101.0)
    assert await store.expire_batch(batch_id, 110.0)
    output = await store.write_output("file-out", "out.jsonl", ['{"a": 1}'], 111.0)
    errors = await store.write_output("file-err", "err.jsonl", ["{}", "{}"], 111.0)
    assert await store.finish(batch_id, "expired", output, errors, 111.0)
    batch = await store.get_batch(batch_id)
    assert batch is not None and batch.status == "expired" and batch.expired_at == 111.0
    assert (batch.output_file_id, batch.error_file_id) == ("file-out", "file-err")
    assert (batch.completed, batch.failed) == (1, 2), "unfinished lines of an expired batch count as failed"
    assert await store.read_file("file-out") == b'{"a": 1}\n'
    assert (await store.get_file("file-err")) == errors and errors.purpose == "batch_output"
    assert not await store.finish(batch_id, "expired", None, None, 112.0)
    assert await store.open_batches(112.0) == []
