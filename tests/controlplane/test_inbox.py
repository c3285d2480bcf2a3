"""RunInbox: ordered delivery, a producer that never blocks, delta merging, failure."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from iop_trio.controlplane import RunInbox, RunLost
from iop_trio.wire import RunEvent, Usage

RUN = "run-1"


def delta(text: str, tokens: int = 1) -> RunEvent:
    return RunEvent(run_id=RUN, kind="delta", text=text, tokens=tokens)


def start() -> RunEvent:
    return RunEvent(run_id=RUN, kind="start")


def complete() -> RunEvent:
    return RunEvent(run_id=RUN, kind="complete", finish_reason="stop", usage=Usage(3, 5))


def error() -> RunEvent:
    return RunEvent(run_id=RUN, kind="error", code="backend_error", message="boom")


async def drain(inbox: RunInbox) -> list[RunEvent]:
    """Every buffered event: get() until it would wait for more (instant on the autojump clock)."""
    events = []
    while True:
        with trio.move_on_after(1) as scope:
            events.append(await inbox.get())
        if scope.cancelled_caught:
            return events


async def test_events_come_out_in_order(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    events = [start(), delta("a"), delta("b", 2), delta("c"), complete()]
    for event in events:
        inbox.put(event)
    assert inbox.ended
    assert [await inbox.get() for _ in events] == events


async def test_get_waits_until_put(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    received: list[tuple[float, RunEvent]] = []

    async def reader() -> None:
        for _ in range(2):
            event = await inbox.get()
            received.append((trio.current_time(), event))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(5)
        assert received == []
        inbox.put(start())
        await trio.sleep(5)
        inbox.put(delta("x"))

    assert [event for _, event in received] == [start(), delta("x")]
    assert [when for when, _ in received] == [pytest.approx(5), pytest.approx(10)]


async def test_get_blocks_when_empty(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    with trio.move_on_after(0.05) as scope:
        await inbox.get()
    assert scope.cancelled_caught


async def test_put_never_blocks_and_merges_consecutive_deltas_when_full(
    autojump_clock: MockClock,
) -> None:
    inbox = RunInbox(max_events=4)
    inbox.put(start())
    pieces = [f"w{i} " for i in range(100)]
    for i, piece in enumerate(pieces):
        inbox.put(delta(piece, tokens=i % 3 + 1))  # synchronous: never waits for the reader
    inbox.put(complete())

    events = await drain(inbox)
    # Bounded: the start, at most max_events deltas in total, and the terminal event.
    assert len(events) <= 4 + 1
    assert events[0] == start()
    assert events[-1] == complete()
    deltas = events[1:-1]
    assert all(event.kind == "delta" and event.run_id == RUN for event in deltas)
    # Nothing is lost: the text is exactly preserved, in order, and the tokens add up.
    assert "".join(event.text for event in deltas) == "".join(pieces)
    assert sum(event.tokens for event in deltas) == sum(i % 3 + 1 for i in range(100))


async def test_merging_only_happens_when_full(autojump_clock: MockClock) -> None:
    inbox = RunInbox(max_events=4)
    for piece in "abc":
        inbox.put(delta(piece))
    events = await drain(inbox)
    assert events == [delta("a"), delta("b"), delta("c")]


async def test_merge_concatenates_text_and_sums_tokens(autojump_clock: MockClock) -> None:
    inbox = RunInbox(max_events=4)
    for piece in ("a", "b", "c", "d"):
        inbox.put(delta(piece))
    inbox.put(delta("e", 2))
    inbox.put(delta("f", 3))
    events = await drain(inbox)
    assert events == [delta("a"), delta("b"), delta("c"), delta("def", 6)]


async def test_reader_catching_up_stops_merging(autojump_clock: MockClock) -> None:
    inbox = RunInbox(max_events=2)
    inbox.put(delta("a"))
    inbox.put(delta("b"))
    inbox.put(delta("c"))  # full: merged into "bc"
    assert await inbox.get() == delta("a")
    inbox.put(delta("d"))  # room again: appended on its own
    assert await drain(inbox) == [delta("bc", 2), delta("d")]


@pytest.mark.parametrize("terminal", [complete(), error()], ids=["complete", "error"])
async def test_terminal_event_is_never_merged(
    terminal: RunEvent, autojump_clock: MockClock
) -> None:
    inbox = RunInbox(max_events=4)
    for piece in ("a", "b", "c", "d", "e"):
        inbox.put(delta(piece))
    inbox.put(terminal)
    assert inbox.ended
    events = await drain(inbox)
    assert events[-1] == terminal
    assert "".join(event.text for event in events[:-1]) == "abcde"
    assert all(event.kind == "delta" for event in events[:-1])


@pytest.mark.parametrize("terminal", [complete(), error()], ids=["complete", "error"])
async def test_puts_after_terminal_event_are_ignored(
    terminal: RunEvent, autojump_clock: MockClock
) -> None:
    inbox = RunInbox()
    inbox.put(delta("a"))
    inbox.put(terminal)
    inbox.put(delta("late"))
    inbox.put(complete())
    inbox.put(error())
    assert await drain(inbox) == [delta("a"), terminal]


async def test_fail_raises_after_buffered_events_are_drained(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    inbox.put(start())
    inbox.put(delta("a"))
    inbox.fail("node_lost", "node went away")
    assert await inbox.get() == start()
    assert await inbox.get() == delta("a")
    with pytest.raises(RunLost) as info:
        await inbox.get()
    assert info.value.code == "node_lost"
    assert info.value.message == "node went away"
    # It stays failed.
    with pytest.raises(RunLost):
        await inbox.get()


async def test_fail_wakes_a_waiting_reader(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    outcome: list[BaseException] = []

    async def reader() -> None:
        try:
            await inbox.get()
        except RunLost as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.sleep(1)
        inbox.fail("node_lost", "gone")

    assert len(outcome) == 1
    assert isinstance(outcome[0], RunLost)
    assert outcome[0].code == "node_lost"


async def test_first_failure_wins(autojump_clock: MockClock) -> None:
    inbox = RunInbox()
    inbox.fail("node_lost", "first")
    inbox.fail("other", "second")
    with pytest.raises(RunLost) as info:
        await inbox.get()
    assert (info.value.code, info.value.message) == ("node_lost", "first")


@pytest.mark.parametrize("terminal", [complete(), error()], ids=["complete", "error"])
async def test_fail_after_run_ended_is_a_noop(
    terminal: RunEvent, autojump_clock: MockClock
) -> None:
    inbox = RunInbox()
    inbox.put(delta("a"))
    inbox.put(terminal)
    inbox.fail("node_lost", "too late")
    assert await inbox.get() == delta("a")
    assert await inbox.get() == terminal
    # Nothing more: get() waits instead of raising RunLost.
    with trio.move_on_after(0.05) as scope:
        await inbox.get()
    assert scope.cancelled_caught


async def test_ready_says_whether_get_would_wait() -> None:
    inbox = RunInbox()
    assert not inbox.ready
    inbox.put(RunEvent(run_id="r", kind="start"))
    assert inbox.ready
    assert (await inbox.get()).kind == "start"
    assert not inbox.ready
    inbox.fail("node_lost", "gone")
    assert inbox.ready  # get() raises at once
    with pytest.raises(RunLost):
        await inbox.get()
