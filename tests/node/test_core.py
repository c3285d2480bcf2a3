"""The node core: every run ends exactly once, and its history row says how."""

from __future__ import annotations

import trio

from iop_trio.node.run import RunTracker
from iop_trio.wire import CancelRequest, ChatMessage, Error, RunEvent, RunRequest, SamplingParams


def request(run_id: str, deadline: float | None = None, max_tokens: int | None = None) -> RunRequest:
    return RunRequest(
        run_id=run_id,
        model="m",
        messages=(ChatMessage("user", "hello there"),),
        params=SamplingParams(max_tokens=max_tokens),
        deadline=deadline,
    )


async def test_run_streams_start_deltas_complete_and_records_complete(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=5, token_delay=0.1)
    await node.edge.send(request("r1"))
    events = await node.edge.events_until_end("r1")
    assert [e.kind for e in events] == ["start"] + ["delta"] * 5 + ["complete"]
    assert events[-1].finish_reason == "stop"
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 5
    assert events[-1].usage.prompt_tokens == 2
    await node.core.wait_idle()
    row = node.row("r1")
    assert row["status"] == "complete"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (2, 5)
    assert row["ttft_ms"] is not None and row["error"] is None


async def test_cancel_request_cancels_the_runs_scope_and_records_cancelled(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=100, token_delay=1.0)
    await node.edge.send(request("r1"))
    deltas = 0
    while deltas < 3:
        event = await node.edge.receive()
        deltas += event.kind == "delta"
    cancelled_at = trio.current_time()
    await node.edge.send(CancelRequest(run_id="r1"))
    events = await node.edge.events_until_end("r1")
    assert events[-1].kind == "error" and events[-1].code == "cancelled"
    # The cancel takes effect at once: no further token is produced after it arrives.
    assert trio.current_time() - cancelled_at < 1.0
    await node.core.wait_idle()
    row = node.row("r1")
    assert row["status"] == "cancelled"
    assert 3 <= row["completion_tokens"] < 100


async def test_cancel_only_touches_the_named_run(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=20, token_delay=1.0)
    await node.edge.send(request("keep"))
    await node.edge.send(request("drop"))
    await node.edge.send(CancelRequest(run_id="drop"))
    ends = {}
    while len(ends) < 2:
        event = await node.edge.receive()
        if event.is_terminal:
            ends[event.run_id] = event
    assert ends["drop"].code == "cancelled"
    assert ends["keep"].kind == "complete" and ends["keep"].usage.completion_tokens == 20


async def test_deadline_ends_the_run_as_error(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=100, token_delay=1.0)
    started = trio.current_time()
    await node.edge.send(request("r1", deadline=5.0))
    events = await node.edge.events_until_end("r1")
    assert events[-1].kind == "error" and events[-1].code == "deadline_exceeded"
    assert 5.0 <= trio.current_time() - started < 6.0
    await node.core.wait_idle()
    row = node.row("r1")
    assert row["status"] == "error" and "deadline" in row["error"]
    assert 0 < row["completion_tokens"] <= 6


async def test_losing_the_connection_cancels_its_runs(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=100, token_delay=1.0)
    await node.edge.send(request("a"))
    await node.edge.send(request("b"))
    seen = 0
    while seen < 4:
        seen += (await node.edge.receive()).kind == "delta"
    await node.edge.conn.stream.aclose()
    await node.connection_ended.wait()
    assert node.core.active_runs == 0
    for run_id in ("a", "b"):
        row = node.row(run_id)
        assert row["status"] == "cancelled"
        assert row["error"] == "connection to edge lost"
        assert row["completion_tokens"] < 100


async def test_backend_failure_is_an_error_event_and_an_error_row(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=10, fail_after_tokens=3, fail_message="gpu on fire")
    await node.edge.send(request("r1"))
    events = await node.edge.events_until_end("r1")
    assert [e.kind for e in events] == ["start", "delta", "delta", "delta", "error"]
    assert events[-1].code == "backend_error" and events[-1].message == "gpu on fire"
    await node.core.wait_idle()
    row = node.row("r1")
    assert (row["status"], row["completion_tokens"], row["error"]) == ("error", 3, "gpu on fire")


async def test_unknown_model_is_refused_without_a_history_row(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store)
    await node.edge.send(RunRequest(run_id="r1", model="nope", messages=(ChatMessage("user", "x"),)))
    (event,) = await node.edge.events_until_end("r1")
    assert event.kind == "error" and event.code == "model_not_found"
    assert store.list_runs() == []


async def test_capacity_and_draining_refuse_new_runs(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, max_concurrency=1, tokens=5, token_delay=1.0)
    await node.edge.send(request("first"))
    await node.edge.send(request("second"))
    (refused,) = await node.edge.events_until_end("second")
    assert refused.code == "node_busy"
    node.core.draining = True
    await node.edge.send(request("third"))
    (refused,) = await node.edge.events_until_end("third")
    assert refused.code == "node_draining"
    events = await node.edge.events_until_end("first")
    assert events[-1].kind == "complete"


async def test_duplicate_run_id_is_a_protocol_error_for_that_run(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=5, token_delay=1.0)
    await node.edge.send(request("r1"))
    await node.edge.send(request("r1"))
    while True:
        message = await node.edge.receive()
        if isinstance(message, Error):
            break
    assert message.code == "duplicate_run" and message.run_id == "r1"
    events = await node.edge.events_until_end("r1")
    assert events[-1].kind == "complete"


async def test_max_tokens_caps_the_run(nursery, store, start_node, autojump_clock):
    node = await start_node(nursery, store, tokens=50)
    await node.edge.send(request("r1", max_tokens=4))
    events = await node.edge.events_until_end("r1")
    assert sum(e.kind == "delta" for e in events) == 4
    assert events[-1].finish_reason == "length"



async def test_the_terminal_event_waits_for_a_backed_up_connection_and_is_never_dropped(
    store, autojump_clock
):
    """Under thousands of streams the outbox can stay full for a long while; a run's end must
    still go out (it used to be dropped after one second, and the client hung)."""
    from iop_trio.node.core import send_final
    from iop_trio.wire import RunEvent

    class BackedUpConnection:
        def __init__(self) -> None:
            self.sent: list[RunEvent] = []

        async def send(self, message: RunEvent) -> None:
            await trio.sleep(600)  # ten minutes before the outbox has room
            self.sent.append(message)

    conn = BackedUpConnection()
    event = RunEvent(run_id="r1", kind="complete", finish_reason="stop")
    await send_final(conn, event)  # type: ignore[arg-type]
    assert conn.sent == [event]


class RecordingConnection:
    def __init__(self) -> None:
        self.sent: list[RunEvent] = []

    async def send(self, message: RunEvent) -> None:
        self.sent.append(message)


async def test_start_goes_once_when_the_backend_accepts_or_with_the_first_delta() -> None:
    accepted, implied = RecordingConnection(), RecordingConnection()
    tracker = RunTracker(accepted, "r1")  # type: ignore[arg-type]
    await tracker.started()
    await tracker.started()
    await tracker.delta("a")
    lazy = RunTracker(implied, "r2")  # type: ignore[arg-type]
    await lazy.delta("a")
    await lazy.delta("b")
    assert [e.kind for e in accepted.sent] == ["start", "delta"]
    assert [e.kind for e in implied.sent] == ["start", "delta", "delta"]
