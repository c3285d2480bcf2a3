"""The worker under MockClock (autojump): the claim loop, shared concurrency, leases (renewal,
takeover, loss), cancellation, expiry by completion window, drain and resume. Deterministic:
virtual time, an in-memory edge, statements on the event loop."""

from __future__ import annotations

import sqlite3
from collections import Counter

import attrs
import pytest
import trio

from iop_trio.store.batches import BatchStore, NewLine
from iop_trio.worker import Worker

from .conftest import (
    CONFIG,
    TTL,
    FakeEdge,
    body,
    read_jsonl,
    request_line,
    start_worker,
    submit,
    wait_status,
)

PROMPTS = [f"p{n}" for n in range(10)]


async def test_a_batch_runs_from_validating_to_completed(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge(delay=1.0)
    batch_id = await submit(store, [*PROMPTS, "bad-request"])
    await start_worker(nursery, store, edge)
    batch = await wait_status(store, batch_id, "completed")

    assert (batch.total, batch.completed, batch.failed) == (11, 10, 1)
    assert batch.in_progress_at is not None and batch.finalizing_at is not None and batch.completed_at is not None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = await read_jsonl(store, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"id-{p}" for p in PROMPTS], "input order, each once"
    first = output[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"] == {
        "status_code": 200, "request_id": "req-p0", "body": {"echo": "p0", "endpoint": "/v1/chat/completions"},
    }
    [failed] = await read_jsonl(store, batch.error_file_id)
    assert failed["custom_id"] == "id-bad-request" and failed["response"]["status_code"] == 400
    output_file = await store.get_file(batch.output_file_id or "")
    assert output_file is not None and output_file.purpose == "batch_output"
    assert edge.max_in_flight == CONFIG.concurrency
    assert sorted(edge.started) == sorted([*PROMPTS, "bad-request"]), "no line ran twice"


async def test_concurrency_is_one_limit_across_batches(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge(delay=1.0)
    first = await submit(store, [f"a{n}" for n in range(5)])
    second = await submit(store, [f"b{n}" for n in range(5)])
    await start_worker(nursery, store, edge)
    for batch_id in (first, second):
        assert (await wait_status(store, batch_id, "completed")).completed == 5
    assert edge.max_in_flight == CONFIG.concurrency


async def test_invalid_input_fails_the_batch_without_running_anything(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    content = "\n".join([request_line("ok"), request_line("x", model="nope"), "{oops"])
    batch_id = await submit(store, [], content=content)
    await start_worker(nursery, store, edge)
    batch = await wait_status(store, batch_id, "failed")
    assert batch.errors is not None
    assert [(e["code"], e["line"]) for e in batch.errors] == [("model_not_found", 2), ("invalid_json_line", 3)]
    assert batch.failed_at is not None and batch.output_file_id is None and edge.started == []


async def test_validation_waits_while_the_edge_is_unreachable(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    edge.available = False
    batch_id = await submit(store, ["p"])
    await start_worker(nursery, store, edge)
    await trio.sleep(10 * CONFIG.poll_interval)
    assert (await wait_status(store, batch_id, "validating", "failed")).status == "validating"
    edge.available = True
    assert (await wait_status(store, batch_id, "completed")).completed == 1


async def test_a_renewed_lease_keeps_a_long_line_from_a_second_worker(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    edge.slow["long"] = 5 * TTL
    batch_id = await submit(store, ["long"])
    await start_worker(nursery, store, edge, owner="worker-a")
    await edge.wait_until(lambda: edge.started)
    await start_worker(nursery, store, edge, owner="worker-b")
    batch = await wait_status(store, batch_id, "completed")
    assert edge.started == ["long"] and edge.cancelled == []
    assert batch.completed == 1


async def test_an_expired_lease_of_a_dead_worker_is_taken_over(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    batch_id = await submit(store, ["a", "b"])
    lines = [NewLine(1, "id-a", body("a")), NewLine(2, "id-b", body("b"))]
    assert await store.begin_batch(batch_id, lines, trio.current_time())
    claimed_at = trio.current_time()
    dead = await store.claim_line(batch_id, "dead-worker", claimed_at, TTL)
    assert dead is not None and dead.custom_id == "id-a"

    await start_worker(nursery, store, edge, owner="worker-b")
    batch = await wait_status(store, batch_id, "completed")
    assert sorted(edge.started) == ["a", "b"]
    assert edge.started_at["b"] < claimed_at + 1, "the free line runs at once"
    assert edge.started_at["a"] >= claimed_at + TTL, "the held line only once its lease expired"
    assert batch.completed == 2


async def test_a_line_whose_lease_was_taken_over_is_cancelled(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    edge.slow["stalled"] = 100 * TTL
    batch_id = await submit(store, ["stalled"])
    await start_worker(nursery, store, edge, owner="worker-a")
    await edge.wait_until(lambda: edge.started)
    # As if worker-a had stalled past its lease and another worker had claimed the line.
    await store.db.call(lambda conn: conn.execute("UPDATE batch_lines SET lease_owner = 'thief', lease_id = 'stolen'"))
    await edge.wait_until(lambda: edge.cancelled)
    assert edge.cancelled == ["stalled"]
    [line] = await store.lines(batch_id)
    assert line.result is None, "the cancelled holder wrote nothing"
    owner = await store.db.call(lambda conn: conn.execute("SELECT lease_owner FROM batch_lines").fetchone()[0])
    assert owner == "thief", "and did not release the new holder's lease"


async def test_cancel_stops_in_flight_lines_and_keeps_finished_ones(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge(delay=1.0)
    prompts = [f"p{n}" for n in range(6)]
    for prompt in prompts[2:]:
        edge.slow[prompt] = 1000.0
    batch_id = await submit(store, prompts)
    await start_worker(nursery, store, edge, config=attrs.evolve(CONFIG, concurrency=2))
    await edge.wait_until(lambda: len(edge.finished) == 2 and edge.in_flight == 2)
    requested_at = trio.current_time()
    cancelling = await store.cancel_batch(batch_id, requested_at)
    assert cancelling is not None and cancelling.status == "cancelling"

    batch = await wait_status(store, batch_id, "cancelled")
    assert sorted(edge.cancelled) == ["p2", "p3"]
    assert batch.cancelled_at is not None and batch.cancelled_at - requested_at <= 2 * CONFIG.poll_interval
    assert (batch.total, batch.completed, batch.failed) == (6, 2, 0)
    assert [line["custom_id"] for line in await read_jsonl(store, batch.output_file_id)] == ["id-p0", "id-p1"]
    assert batch.error_file_id is None


async def test_a_batch_expires_at_the_end_of_its_window(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge(delay=4.0)
    batch_id = await submit(store, ["a", "b", "c", "d"], window=10.0)
    await start_worker(nursery, store, edge, config=attrs.evolve(CONFIG, concurrency=1))
    batch = await wait_status(store, batch_id, "expired")

    assert edge.finished == ["a", "b"] and edge.cancelled == ["c"]
    assert batch.expired_at is not None and batch.expired_at - batch.expires_at <= 2 * CONFIG.poll_interval
    assert (batch.total, batch.completed, batch.failed) == (4, 2, 2)
    assert [line["custom_id"] for line in await read_jsonl(store, batch.output_file_id)] == ["id-a", "id-b"]
    errors = await read_jsonl(store, batch.error_file_id)
    assert [(e["custom_id"], e["error"]["code"], e["response"]) for e in errors] == [
        ("id-c", "batch_expired", None), ("id-d", "batch_expired", None),
    ]


async def test_a_batch_nobody_started_in_time_expires_without_running(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    batch_id = await submit(store, ["a"], window=5.0)
    await trio.sleep(6.0)
    await start_worker(nursery, store, edge)
    batch = await wait_status(store, batch_id, "expired")
    assert edge.started == [] and batch.output_file_id is None and batch.error_file_id is None


async def test_shutdown_lets_lines_finish_within_grace_and_gives_back_the_rest(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge()
    edge.slow.update({"quick": 1.0, "long": 1000.0})
    batch_id = await submit(store, ["quick", "long"])
    stopped = trio.Event()
    stop = trio.Event()

    async def worker() -> None:
        await Worker(store, edge, CONFIG, clock=trio.current_time).run(stop.wait)
        stopped.set()

    nursery.start_soon(worker)
    await edge.wait_until(lambda: edge.in_flight == 2)
    stop.set()
    began = trio.current_time()
    await stopped.wait()
    assert trio.current_time() - began == pytest.approx(CONFIG.shutdown_grace)
    assert edge.finished == ["quick"] and edge.cancelled == ["long"]
    [open_batch] = await store.open_batches(trio.current_time())
    assert (open_batch.pending, open_batch.claimable) == (1, 1), "its lease was given back at once"
    assert open_batch.id == batch_id


async def test_a_new_worker_resumes_without_rerunning_finished_lines(store: BatchStore, nursery, autojump_clock) -> None:
    edge = FakeEdge(delay=1.0)
    prompts = [f"p{n}" for n in range(9)]
    batch_id = await submit(store, prompts)
    crash = trio.CancelScope()

    async def crashing_worker() -> None:
        with crash:
            await Worker(store, edge, CONFIG, clock=trio.current_time, owner="crashing").run(trio.sleep_forever)

    nursery.start_soon(crashing_worker)
    await edge.wait_until(lambda: len(edge.finished) >= 4)
    crash.cancel()
    finished_before = list(edge.finished)

    await start_worker(nursery, store, edge, owner="restarted")
    batch = await wait_status(store, batch_id, "completed")
    output = await read_jsonl(store, batch.output_file_id)
    assert sorted(line["custom_id"] for line in output) == sorted(f"id-{p}" for p in prompts)
    assert Counter(edge.finished) == Counter(prompts), "every line finished exactly once"
    assert all(edge.started.count(p) == 1 for p in finished_before), "finished lines never ran again"


async def test_a_locked_database_delays_polls_and_renewals_but_stops_nothing(
    store: BatchStore, nursery, autojump_clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    edge = FakeEdge()
    edge.slow["long"] = 3 * TTL
    batch_id = await submit(store, ["long"])
    failures = {"open_batches": 2, "renew_leases": 2}

    def flaky(name: str) -> None:
        real = getattr(store, name)

        async def call(*args: object) -> object:
            if failures[name]:
                failures[name] -= 1
                raise sqlite3.OperationalError("database is locked")
            return await real(*args)

        monkeypatch.setattr(store, name, call)

    flaky("open_batches")
    await start_worker(nursery, store, edge)
    await edge.wait_until(lambda: edge.started)
    flaky("renew_leases")
    batch = await wait_status(store, batch_id, "completed")
    assert failures == {"open_batches": 0, "renew_leases": 0}
    assert edge.started == ["long"] and edge.cancelled == [] and batch.completed == 1
