"""Scheduler.acquire (placement, least-loaded choice, queueing, backpressure) and NodeRegistry,
on NodeSession objects built without a network."""

from __future__ import annotations

import gc
import weakref
from collections import Counter

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from iop_trio.config import ModelPolicy, QueueConfig
from iop_trio.controlplane import (
    Grant,
    NodeRegistry,
    NodeSession,
    NoNodeAvailable,
    Placement,
    RunInbox,
    RunLost,
    Scheduler,
)
from iop_trio.wire import (
    CancelRequest,
    Error,
    LocalProtocolError,
    NodeConfig,
    RegisterRequest,
    RunEvent,
    RunRequest,
    Usage,
)


class StubConn:
    """The scheduler never touches the connection; finish_run's CancelRequest lands here."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.last_received = 0.0

    async def send(self, message: object) -> None:
        self.sent.append(message)


def make_session(
    node_id: str,
    models: tuple[str, ...] = ("m",),
    capacity: int = 4,
    outstanding: int = 0,
    labels: dict[str, str] | None = None,
) -> NodeSession:
    info = RegisterRequest(
        token="iop_x.y", node_id=node_id, version="test", models=models, capacity=capacity,
        labels=labels or {},
    )
    config = NodeConfig(max_concurrency=capacity, heartbeat_interval=30)
    session = NodeSession(info, config, StubConn(), peer="x")  # type: ignore[arg-type]
    set_outstanding(session, outstanding)
    return session


def running_inbox() -> RunInbox:
    """An inbox for a run already sent to its node (what send_run leaves behind)."""
    inbox = RunInbox()
    inbox.sent = True
    return inbox


def set_outstanding(session: NodeSession, count: int) -> None:
    session.runs = {f"{session.node_id}-run-{i}": running_inbox() for i in range(count)}


def sent(session: NodeSession) -> list[object]:
    assert isinstance(session.conn, StubConn)
    return session.conn.sent


def make_scheduler(
    *sessions: NodeSession,
    queue: QueueConfig | None = None,
    placement: Placement | None = None,
) -> tuple[NodeRegistry, Scheduler]:
    registry = NodeRegistry()
    scheduler = Scheduler(registry, placement, queue)
    for session in sessions:
        register(registry, scheduler, session)
    return registry, scheduler


def register(registry: NodeRegistry, scheduler: Scheduler, session: NodeSession) -> None:
    """What the edge's NodeAcceptor does for a new connection."""
    session.on_change = scheduler.update
    registry.add(session)


def terminal(run_id: str, kind: str = "complete") -> RunEvent:
    if kind == "complete":
        return RunEvent(run_id=run_id, kind="complete", finish_reason="stop", usage=Usage(1, 1))
    return RunEvent(run_id=run_id, kind="error", code="cancelled", message="cancelled by client")


async def free_one(session: NodeSession, run_id: str | None = None) -> str:
    """One of the session's runs completes and the edge finishes it (EdgeRun.close): the node
    has ended the run already, so its slot frees at once and no cancel is sent."""
    run_id = run_id or next(iter(session.runs))
    session.runs[run_id].put(terminal(run_id))
    assert not await session.finish_run(run_id, cancel_timeout=1.0)
    assert run_id not in session.runs
    return run_id


class Client:
    """One request waiting in ``acquire``, inside its own cancel scope (its HTTP handler)."""

    def __init__(
        self,
        scheduler: Scheduler,
        run_id: str,
        priority: int = 0,
        exclude: frozenset[str] = frozenset(),
        model: str = "m",
        granted: list[str] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.run_id = run_id
        self.priority = priority
        self.exclude = exclude
        self.model = model
        self.granted_order = granted
        self.scope = trio.CancelScope()
        self.grant: Grant | None = None
        self.error: NoNodeAvailable | None = None
        self.done = trio.Event()

    async def run(self) -> None:
        try:
            with self.scope:
                try:
                    self.grant = await self.scheduler.acquire(self.model, self.run_id, self.priority, self.exclude)
                except NoNodeAvailable as exc:
                    self.error = exc
                else:
                    if self.granted_order is not None:
                        self.granted_order.append(self.run_id)
        finally:
            self.done.set()

    @property
    def node(self) -> str | None:
        return None if self.grant is None else self.grant.session.node_id

    @property
    def waiting(self) -> bool:
        return not self.done.is_set()


async def queue_client(nursery: trio.Nursery, scheduler: Scheduler, run_id: str, **kwargs) -> Client:
    """Start a client and let it reach the scheduler (arrivals are ordered by these calls)."""
    client = Client(scheduler, run_id, **kwargs)
    nursery.start_soon(client.run)
    await wait_all_tasks_blocked()
    return client


# --- errors --------------------------------------------------------------------------------


async def test_no_nodes_is_503() -> None:
    _, scheduler = make_scheduler()
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "r1")
    assert info.value.status == 503
    assert info.value.code == "no_node_available"
    assert info.value.retry_after == 1
    assert scheduler.waiting("m") == 0


async def test_no_node_serving_the_model_is_404() -> None:
    _, scheduler = make_scheduler(make_session("a", models=("m1",)), make_session("b", models=("m2",)))
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("other", "r1")
    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert "other" in info.value.message
    assert info.value.retry_after is None
    assert scheduler.waiting("other") == 0


@pytest.mark.parametrize("why", ["closed", "draining", "placement", "excluded"])
async def test_no_candidate_is_503(why: str) -> None:
    a = make_session("a", labels={"gpu": "t4"})
    b = make_session("b", labels={"gpu": "t4"})
    placement = Placement({"m": ModelPolicy(node_labels={"gpu": "a100"})}) if why == "placement" else None
    _, scheduler = make_scheduler(a, b, placement=placement)
    exclude: frozenset[str] = frozenset()
    if why == "closed":
        a.close("gone")
        b.close("gone")
    elif why == "draining":
        a.draining = b.draining = True
    elif why == "excluded":
        exclude = frozenset({"a", "b"})
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "r1", exclude=exclude)
    assert info.value.status == 503
    assert info.value.code == "no_node_available"
    assert info.value.retry_after == 1
    # Failing fast: the request never queued, nothing was reserved.
    assert scheduler.waiting("m") == 0
    assert a.runs == {} and b.runs == {}


async def test_check_servable_reports_without_acquiring() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    scheduler.check_servable("m")  # full is servable: it would queue
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.check_servable("m", frozenset({"a"}))
    assert info.value.status == 503
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.check_servable("x")
    assert info.value.status == 404


# --- choosing a node -------------------------------------------------------------------------


async def test_acquire_reserves_a_slot_and_returns_its_inbox() -> None:
    a = make_session("a", capacity=2)
    _, scheduler = make_scheduler(a)
    grant = await scheduler.acquire("m", "r1")
    assert grant.session is a
    assert a.runs == {"r1": grant.inbox}
    assert a.outstanding == 1
    assert scheduler.waiting("m") == 0
    assert sent(a) == []  # sending the run is the caller's job


async def test_least_loaded_relative_to_capacity_wins() -> None:
    # a: 3/4 = 0.75, b: 4/10 = 0.4, c: 1/2 = 0.5 -- b has the most outstanding runs but wins.
    a = make_session("a", capacity=4, outstanding=3)
    b = make_session("b", capacity=10, outstanding=4)
    c = make_session("c", capacity=2, outstanding=1)
    _, scheduler = make_scheduler(a, b, c)
    assert (await scheduler.acquire("m", "r1")).session is b  # b: 5/10 = 0.5 now

    set_outstanding(b, 8)  # 0.8: now c (0.5) is the least loaded
    assert (await scheduler.acquire("m", "r2")).session is c


async def test_idle_node_wins_over_busy_one() -> None:
    busy = make_session("busy", capacity=100, outstanding=1)
    idle = make_session("idle", capacity=1, outstanding=0)
    _, scheduler = make_scheduler(busy, idle)
    assert (await scheduler.acquire("m", "r1")).session is idle


async def test_ties_go_to_the_first_registered_node() -> None:
    first = make_session("first", capacity=2, outstanding=1)
    second = make_session("second", capacity=4, outstanding=2)
    _, scheduler = make_scheduler(first, second)
    assert (await scheduler.acquire("m", "r1")).session is first


async def test_ties_among_idle_nodes_go_to_the_first_registered_node() -> None:
    nodes = [make_session(name, capacity=3) for name in ("n1", "n2", "n3")]
    _, scheduler = make_scheduler(*nodes)
    chosen = [(await scheduler.acquire("m", f"r{i}")).session.node_id for i in range(6)]
    # Equal capacity: round robin in registration order, as each reservation raises the load.
    assert chosen == ["n1", "n2", "n3", "n1", "n2", "n3"]


async def test_load_spreads_in_proportion_to_capacity(autojump_clock: MockClock) -> None:
    a = make_session("a", capacity=2)
    b = make_session("b", capacity=4)
    _, scheduler = make_scheduler(a, b, queue=QueueConfig(timeout=1))
    picks: Counter[str] = Counter()
    for i in range(6):
        picks[(await scheduler.acquire("m", f"r{i}")).session.node_id] += 1
    assert picks == {"a": 2, "b": 4}
    # Everything is full now: the next request waits, and times out.
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "r6")
    assert info.value.code == "queue_timeout"
    assert (a.outstanding, b.outstanding) == (2, 4)


async def test_never_more_runs_than_max_concurrency() -> None:
    a = make_session("a", capacity=2)
    b = make_session("b", capacity=3)
    _, scheduler = make_scheduler(a, b)
    clients = [Client(scheduler, f"r{i}") for i in range(12)]
    async with trio.open_nursery() as nursery:
        # All at once: the reservations are counted as they are decided, not when the tasks run.
        for client in clients:
            nursery.start_soon(client.run)
        await wait_all_tasks_blocked()
        assert (a.outstanding, b.outstanding) == (2, 3)
        assert scheduler.waiting("m") == 7
        assert sum(not c.waiting for c in clients) == 5

        # Ending runs one by one: each freed slot goes to exactly one waiter, never beyond capacity.
        for _ in range(7):
            holder = a if a.runs else b
            await free_one(holder)
            await wait_all_tasks_blocked()
            assert a.outstanding <= 2 and b.outstanding <= 3
            assert a.outstanding + b.outstanding == 5
        assert scheduler.waiting("m") == 0
        assert all(c.grant is not None for c in clients)
    # Every grant reserved exactly its own run id on the node it names.
    for client in clients:
        assert client.grant is not None
        assert client.grant.session.node_id in ("a", "b")


async def test_nodes_not_serving_the_model_are_never_chosen() -> None:
    idle_other = make_session("idle", models=("x", "y"), capacity=100)
    busy = make_session("busy", models=("y", "m"), capacity=4, outstanding=3)
    _, scheduler = make_scheduler(idle_other, busy)
    assert (await scheduler.acquire("m", "r1")).session is busy
    assert (await scheduler.acquire("x", "r2")).session is idle_other
    assert (await scheduler.acquire("y", "r3")).session is idle_other


async def test_closed_and_draining_nodes_are_not_chosen() -> None:
    closed = make_session("closed")
    closed.close("gone")
    draining = make_session("draining")
    draining.draining = True
    busy = make_session("busy", capacity=4, outstanding=3)
    _, scheduler = make_scheduler(closed, draining, busy)
    assert not scheduler.has_candidates("m", frozenset({"busy"}))
    assert (await scheduler.acquire("m", "r1")).session is busy
    assert closed.runs == {} and draining.runs == {}


async def test_placement_restricts_nodes_by_labels() -> None:
    t4 = make_session("t4", models=("big", "small"), labels={"gpu": "t4"})
    a100 = make_session("a100", models=("big", "small"), capacity=8, outstanding=7,
                        labels={"gpu": "a100", "zone": "eu"})
    placement = Placement({"big": ModelPolicy(node_labels={"gpu": "a100"})})
    _, scheduler = make_scheduler(t4, a100, placement=placement)
    assert not scheduler.has_candidates("big", frozenset({"a100"}))
    assert scheduler.has_candidates("small", frozenset({"a100"}))  # no policy: any node
    # The idle t4 node is not allowed to run "big"; the nearly full a100 is.
    assert (await scheduler.acquire("big", "r1")).session is a100
    assert (await scheduler.acquire("small", "r2")).session is t4


async def test_exclude() -> None:
    a = make_session("a", capacity=4, outstanding=0)
    b = make_session("b", capacity=4, outstanding=3)
    _, scheduler = make_scheduler(a, b)
    assert (await scheduler.acquire("m", "r1", exclude=frozenset({"a"}))).session is b
    assert (await scheduler.acquire("m", "r2", exclude=frozenset({"b", "unknown"}))).session is a
    assert scheduler.has_candidates("m", frozenset({"a"}))
    assert not scheduler.has_candidates("m", frozenset({"a", "b"}))


async def test_acquire_does_not_touch_the_connection() -> None:
    session = make_session("a")
    _, scheduler = make_scheduler(session)
    await scheduler.acquire("m", "r1")
    assert sent(session) == []


# --- queueing ------------------------------------------------------------------------------


async def test_full_nodes_make_acquire_wait_and_a_freed_slot_goes_to_the_waiter() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    b = make_session("b", capacity=2, outstanding=2)
    _, scheduler = make_scheduler(a, b)
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        assert client.waiting
        assert scheduler.waiting("m") == 1
        assert scheduler.total_waiting() == 1

        freed = await free_one(b)
        # The slot was reserved for the waiter in the same step as it freed up.
        assert "w1" in b.runs and freed not in b.runs
        assert b.outstanding == 2
        assert scheduler.waiting("m") == 0
        await client.done.wait()
    assert client.grant is not None
    assert client.grant.session is b
    assert client.grant.inbox is b.runs["w1"]
    assert sent(b) == []  # the run had ended: nothing to cancel


async def test_a_cancelled_run_keeps_its_slot_until_the_node_confirms_the_end() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    (run_id,) = a.runs
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        # The client of the running request goes away: the edge asks the node to cancel it...
        assert await a.finish_run(run_id, cancel_timeout=1.0)
        assert sent(a) == [CancelRequest(run_id=run_id, reason="client went away")]
        # ...but the node still counts the run until it ends, so the slot is not handed out.
        await wait_all_tasks_blocked()
        assert client.waiting
        assert run_id in a.runs and a.outstanding == 1
        # Events still in flight from the node do not free it either.
        await a.on_message(RunEvent(run_id=run_id, kind="delta", text="x", tokens=1), nursery)
        await wait_all_tasks_blocked()
        assert client.waiting
        # The node confirms the end: now the slot goes to the waiter.
        await a.on_message(terminal(run_id, "error"), nursery)
        assert run_id not in a.runs
        await client.done.wait()
    assert client.node == "a"
    assert list(a.runs) == ["w1"]
    # A second finish of the same run changes nothing.
    assert not await a.finish_run(run_id, cancel_timeout=1.0)
    assert list(a.runs) == ["w1"]


async def test_a_node_error_for_a_cancelled_run_also_frees_its_slot() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    (run_id,) = a.runs
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        assert await a.finish_run(run_id, cancel_timeout=1.0)
        await a.on_message(Error(code="unknown_run", message="no such run", run_id=run_id), nursery)
        await client.done.wait()
    assert client.node == "a"


async def test_a_run_that_completed_before_its_cancel_frees_its_slot_at_once() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    (run_id,) = a.runs
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        await a.on_message(terminal(run_id), nursery)  # the node finished first
        assert not await a.finish_run(run_id, cancel_timeout=1.0)
        await client.done.wait()
    assert client.node == "a"
    assert sent(a) == []


async def test_finishing_an_ended_run_frees_the_slot_without_a_cancel() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    (run_id, inbox), = a.runs.items()
    inbox.put(terminal(run_id))
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        assert not await a.finish_run(run_id, cancel_timeout=1.0)
        await client.done.wait()
    assert client.node == "a"
    assert sent(a) == []


class OversizeConn(StubConn):
    """A connection whose frame limit every run request exceeds."""

    async def send(self, message: object) -> None:
        if isinstance(message, RunRequest):
            raise LocalProtocolError("frame of 99999999 bytes exceeds the limit of 1024 bytes")
        await super().send(message)


async def test_a_run_the_node_never_received_frees_its_slot() -> None:
    a = make_session("a", capacity=1)
    a.conn = OversizeConn()  # type: ignore[assignment]
    _, scheduler = make_scheduler(a, queue=QueueConfig(timeout=5))
    grant = await scheduler.acquire("m", "big")
    await a.send_run(RunRequest(run_id="big", model="m", kind="completion", prompt="x"))
    with pytest.raises(RunLost) as info:
        await grant.inbox.get()
    assert info.value.code == "request_too_large"
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "next")
        await a.finish_run("big", cancel_timeout=1.0)  # EdgeRun.close after the 413
        await wait_all_tasks_blocked()
        try:
            assert "big" not in a.runs
            assert client.node == "a"
        finally:
            nursery.cancel_scope.cancel()


async def test_waiters_are_served_by_priority_then_arrival() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    order: list[str] = []
    arrivals = [("low1", 0), ("high1", 5), ("low2", 0), ("neg", -3), ("high2", 5), ("top", 10), ("low3", 0)]
    async with trio.open_nursery() as nursery:
        clients = [
            await queue_client(nursery, scheduler, run_id, priority=priority, granted=order)
            for run_id, priority in arrivals
        ]
        assert scheduler.waiting("m") == len(arrivals)
        for served in range(1, len(arrivals) + 1):
            await free_one(a)
            await wait_all_tasks_blocked()
            assert len(order) == served
            assert a.outstanding == 1
            assert scheduler.waiting("m") == len(arrivals) - served
    assert order == ["top", "high1", "high2", "low1", "low2", "low3", "neg"]
    assert all(c.node == "a" for c in clients)


async def test_a_newcomer_never_overtakes_waiting_requests() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        first = await queue_client(nursery, scheduler, "first", granted=order)
        # The slot frees up and, before the waiter's task even runs again, a newcomer with a
        # higher priority arrives: the slot already belongs to the waiter.
        await free_one(a)
        newcomer = Client(scheduler, "newcomer", priority=100, granted=order)
        nursery.start_soon(newcomer.run)
        await wait_all_tasks_blocked()
        assert order == ["first"]
        assert first.node == "a"
        assert newcomer.waiting
        assert scheduler.waiting("m") == 1
        await free_one(a, "first")
        await newcomer.done.wait()
    assert order == ["first", "newcomer"]


async def test_a_full_queue_refuses_at_once_with_429(autojump_clock: MockClock) -> None:
    a = make_session("a", models=("m", "n"), capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, queue=QueueConfig(max_waiting=2))
    async with trio.open_nursery() as nursery:
        w1 = await queue_client(nursery, scheduler, "w1")
        await queue_client(nursery, scheduler, "w2")
        start = trio.current_time()
        with pytest.raises(NoNodeAvailable) as info:
            await scheduler.acquire("m", "w3", priority=100)
        assert trio.current_time() == start
        assert info.value.status == 429
        assert info.value.code == "queue_full"
        assert info.value.retry_after == 1
        assert scheduler.waiting("m") == 2
        # The bound is per model: another model's queue is independent.
        n_waiter = await queue_client(nursery, scheduler, "n1", model="n")
        assert n_waiter.waiting
        assert (scheduler.waiting("n"), scheduler.total_waiting()) == (1, 3)
        # Once one leaves, there is room again.
        w1.scope.cancel()
        await wait_all_tasks_blocked()
        assert scheduler.waiting("m") == 1
        w4 = await queue_client(nursery, scheduler, "w4")
        assert w4.waiting and w4.error is None
        assert scheduler.waiting("m") == 2
        nursery.cancel_scope.cancel()


async def test_max_waiting_zero_still_serves_a_free_node() -> None:
    """max_waiting bounds the queue, not the service: a request that needs no wait is served."""
    a = make_session("a", capacity=2)
    _, scheduler = make_scheduler(a, queue=QueueConfig(max_waiting=0))
    assert (await scheduler.acquire("m", "r1")).session is a
    assert (await scheduler.acquire("m", "r2")).session is a
    assert scheduler.waiting("m") == 0


async def test_max_waiting_zero_refuses_when_full() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, queue=QueueConfig(max_waiting=0))
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "r1")
    assert (info.value.status, info.value.code) == (429, "queue_full")


async def test_waiting_times_out_exactly_at_the_queue_timeout(autojump_clock: MockClock) -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, queue=QueueConfig(timeout=7.5))
    start = trio.current_time()
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "w1")
    assert trio.current_time() - start == 7.5
    assert info.value.status == 429
    assert info.value.code == "queue_timeout"
    assert info.value.retry_after == 1
    assert "7.5s" in info.value.message
    assert scheduler.waiting("m") == 0
    # A slot freed later is not handed to the request that gave up.
    await free_one(a)
    assert a.runs == {}


async def test_timeouts_are_per_waiter(autojump_clock: MockClock) -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, queue=QueueConfig(timeout=10))
    ended: dict[str, float] = {}
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        w1 = await queue_client(nursery, scheduler, "w1")
        await trio.sleep(4)
        w2 = await queue_client(nursery, scheduler, "w2")
        for client in (w1, w2):
            async def record(client: Client = client) -> None:
                await client.done.wait()
                ended[client.run_id] = trio.current_time() - start
            nursery.start_soon(record)
    assert ended == {"w1": 10, "w2": 14}
    assert w1.error is not None and w1.error.code == "queue_timeout"
    assert w2.error is not None and w2.error.code == "queue_timeout"
    assert scheduler.waiting("m") == 0


async def test_zero_timeout_grants_a_free_slot_and_refuses_a_full_node() -> None:
    a = make_session("a", capacity=1)
    _, scheduler = make_scheduler(a, queue=QueueConfig(timeout=0))
    assert (await scheduler.acquire("m", "r1")).session is a
    with pytest.raises(NoNodeAvailable) as info:
        await scheduler.acquire("m", "r2")
    assert info.value.code == "queue_timeout"
    assert list(a.runs) == ["r1"]
    assert scheduler.waiting("m") == 0


async def test_a_cancelled_waiter_leaves_the_queue_at_once(autojump_clock: MockClock) -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        w1 = await queue_client(nursery, scheduler, "w1", granted=order)
        w2 = await queue_client(nursery, scheduler, "w2", granted=order)
        assert scheduler.waiting("m") == 2
        start = trio.current_time()
        w1.scope.cancel()  # its client went away
        await w1.done.wait()
        assert trio.current_time() == start
        assert w1.scope.cancelled_caught
        assert w1.grant is None and w1.error is None
        assert scheduler.waiting("m") == 1
        # The next freed slot skips the departed waiter.
        await free_one(a)
        await w2.done.wait()
    assert order == ["w2"]
    assert list(a.runs) == ["w2"]
    assert scheduler.waiting("m") == 0


async def test_a_grant_for_a_waiter_cancelled_at_the_same_time_is_given_back() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        w1 = await queue_client(nursery, scheduler, "w1", granted=order)
        w2 = await queue_client(nursery, scheduler, "w2", granted=order)
        # Same step: w1's client goes away, and a slot frees up before w1's task gets to run.
        w1.scope.cancel()
        await free_one(a)
        assert "w1" in a.runs  # the race really happened: the slot was reserved for w1
        await wait_all_tasks_blocked()
        # w1 gave the slot back as it left, and it went straight to the next waiter.
        assert w1.scope.cancelled_caught and w1.grant is None
        assert "w1" not in a.runs
        assert order == ["w2"]
        assert w2.node == "a"
        assert list(a.runs) == ["w2"]
        assert a.outstanding == 1
        assert scheduler.waiting("m") == 0


async def test_a_slot_given_back_with_nobody_waiting_stays_free() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a)
    async with trio.open_nursery() as nursery:
        w1 = await queue_client(nursery, scheduler, "w1")
        w1.scope.cancel()
        await free_one(a)
        await wait_all_tasks_blocked()
    assert w1.grant is None
    assert a.runs == {}
    assert a.has_capacity
    assert scheduler.waiting("m") == 0


async def test_registering_a_new_node_serves_the_queue() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    registry, scheduler = make_scheduler(a)
    order: list[str] = []
    async with trio.open_nursery() as nursery:
        waiters = [await queue_client(nursery, scheduler, f"w{i}", granted=order) for i in range(3)]
        b = make_session("b", capacity=2)
        register(registry, scheduler, b)
        await wait_all_tasks_blocked()
        # Both granted in the same step (the first two arrivals); their tasks wake in any order.
        assert sorted(order) == ["w0", "w1"]
        assert sorted(b.runs) == ["w0", "w1"]
        assert waiters[2].waiting
        assert scheduler.waiting("m") == 1
        # A node for another model does not help.
        register(registry, scheduler, make_session("c", models=("other",), capacity=8))
        await wait_all_tasks_blocked()
        assert waiters[2].waiting
        await free_one(a)
        await waiters[2].done.wait()
    assert waiters[2].node == "a"


async def test_a_freed_slot_on_a_draining_node_is_not_handed_out() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    b = make_session("b", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, b)
    async with trio.open_nursery() as nursery:
        client = await queue_client(nursery, scheduler, "w1")
        a.draining = True
        await free_one(a)
        await wait_all_tasks_blocked()
        assert client.waiting
        assert a.runs == {}
        await free_one(b)
        await client.done.wait()
    assert client.node == "b"


async def test_a_waiter_never_gets_a_node_it_excluded() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    b = make_session("b", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, b)
    async with trio.open_nursery() as nursery:
        retry = await queue_client(nursery, scheduler, "retry", exclude=frozenset({"a"}))
        await free_one(a)
        await wait_all_tasks_blocked()
        assert retry.waiting
        await free_one(b)
        await retry.done.wait()
    assert retry.node == "b"


async def test_a_waiter_that_cannot_use_a_free_node_does_not_block_the_others() -> None:
    a = make_session("a", capacity=1, outstanding=1)
    b = make_session("b", capacity=1, outstanding=1)
    _, scheduler = make_scheduler(a, b)
    async with trio.open_nursery() as nursery:
        # A retry (its first attempt failed on a) is at the head of the queue.
        retry = await queue_client(nursery, scheduler, "retry", priority=5, exclude=frozenset({"a"}))
        other = await queue_client(nursery, scheduler, "other")
        await free_one(a)
        await wait_all_tasks_blocked()
        try:
            assert retry.waiting
            assert other.node == "a"
        finally:
            nursery.cancel_scope.cancel()


# --- NodeRegistry -------------------------------------------------------------------------


def test_registry_add_and_lookup() -> None:
    registry = NodeRegistry()
    assert len(registry) == 0
    a = make_session("a", models=("m1", "m2"))
    b = make_session("b", models=("m2",))
    registry.add(a)
    registry.add(b)
    assert len(registry) == 2
    assert registry.sessions() == [a, b]
    assert registry.models() == {"m1": ["a"], "m2": ["a", "b"]}
    assert registry.serves("m1") and not registry.serves("none")


async def test_registry_same_node_id_replaces_and_cancels_old_session() -> None:
    # Async only because CancelScope.cancel_called reads trio's clock.
    registry = NodeRegistry()
    old = make_session("a", models=("m1",))
    other = make_session("b")
    registry.add(old)
    registry.add(other)
    assert not old.scope.cancel_called

    new = make_session("a", models=("m2",))
    registry.add(new)
    assert old.scope.cancel_called
    assert not new.scope.cancel_called
    assert not other.scope.cancel_called
    assert len(registry) == 2
    assert set(registry.sessions()) == {new, other}
    assert registry.models() == {"m": ["b"], "m2": ["a"]}


def test_registry_remove_only_removes_the_current_session() -> None:
    registry = NodeRegistry()
    old = make_session("a")
    new = make_session("a")
    registry.add(old)
    registry.add(new)

    # The old connection's teardown must not unregister the node that replaced it.
    registry.remove(old)
    assert registry.sessions() == [new]
    assert registry.holds(new) and not registry.holds(old)

    registry.remove(new)
    assert len(registry) == 0
    assert not registry.serves("m") and not registry.holds(new)
    # Removing something not registered is harmless.
    registry.remove(new)
    registry.remove(make_session("never"))
    assert len(registry) == 0


def test_registry_models_lists_model_to_node_ids() -> None:
    registry = NodeRegistry()
    assert registry.models() == {}
    registry.add(make_session("n1", models=("zeta", "alpha")))
    registry.add(make_session("n2", models=("alpha",)))
    registry.add(make_session("n3", models=()))
    models = registry.models()
    assert models == {"alpha": ["n1", "n2"], "zeta": ["n1"]}
    assert list(models) == ["alpha", "zeta"]  # sorted by model name

    registry.add(make_session("n1", models=("beta",)))  # n1 re-registers with other models
    assert registry.models() == {"alpha": ["n2"], "beta": ["n1"]}


async def test_a_removed_node_is_no_longer_a_candidate() -> None:
    a = make_session("a")
    b = make_session("b")
    registry, scheduler = make_scheduler(a, b)
    registry.remove(a)
    assert not scheduler.has_candidates("m", frozenset({"b"}))
    assert (await scheduler.acquire("m", "r1")).session is b


async def test_nodes_that_left_are_not_kept_alive_by_the_scheduler() -> None:
    """Nodes that served a model, or a model name of their own (versions, fine-tunes), and left:
    nothing in the scheduler still refers to them, and it keeps working for newcomers."""
    shared = [make_session(f"s{i}", models=("x",), capacity=2) for i in range(300)]
    own = [make_session(f"o{i}", models=(f"x-v{i}",)) for i in range(100)]
    registry, scheduler = make_scheduler(*shared, *own)
    for i in range(len(shared)):
        await scheduler.acquire("x", f"r{i}")
    for session in shared:
        (run_id,) = session.runs
        session.free(run_id)
    refs = [weakref.ref(session) for session in (*shared, *own)]
    for session in (*shared, *own):
        registry.remove(session)
        session.close("gone")
    del shared, own, session
    gc.collect()
    assert [ref for ref in refs if ref() is not None] == []
    newcomer = make_session("new", models=("x",))
    register(registry, scheduler, newcomer)
    assert (await scheduler.acquire("x", "r-new")).session is newcomer


async def test_registry_describe() -> None:
    registry = NodeRegistry()
    session = make_session("n1", models=("m",), capacity=3, outstanding=2, labels={"gpu": "t4"})
    registry.add(session)
    assert isinstance(session.conn, StubConn)
    session.conn.last_received = trio.current_time() - 1.5
    (row,) = registry.describe()
    assert row["node_id"] == "n1"
    assert row["peer"] == "x"
    assert row["models"] == ["m"]
    assert row["labels"] == {"gpu": "t4"}
    assert row["state"] == "ready"
    assert row["max_concurrency"] == 3
    assert row["outstanding"] == 2
    assert row["last_heartbeat_age_s"] == pytest.approx(1.5, abs=0.01)
    session.draining = True
    assert registry.describe()[0]["state"] == "draining"
    session.close("gone")
    assert registry.describe()[0]["state"] == "closed"


async def test_replacing_a_session_ends_the_old_connection_task(autojump_clock: MockClock) -> None:
    registry = NodeRegistry()
    old = make_session("a")
    registry.add(old)
    ended_at: list[float] = []

    async def serve_old_connection() -> None:
        with old.scope:
            await trio.sleep_forever()
        ended_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_old_connection)
        await trio.sleep(3)
        registry.add(make_session("a"))

    assert ended_at == [pytest.approx(3)]


async def test_a_slot_whose_request_was_never_sent_is_free_at_once() -> None:
    """The client left between the reservation and the send: the node never heard of the run,
    so there is nothing to cancel there and no confirmation to wait for."""
    a = make_session("a", capacity=1)
    _, scheduler = make_scheduler(a)
    grant = await scheduler.acquire("m", "r1")
    assert grant.session is a and a.outstanding == 1
    assert not await a.finish_run("r1", cancel_timeout=1.0)
    assert sent(a) == [] and a.outstanding == 0


async def test_runs_lost_to_a_re_registration_fail_with_a_retryable_code() -> None:
    a = make_session("a", capacity=2, outstanding=1)
    (inbox,) = a.runs.values()
    a.close("replaced by a newer registration", "node_reconnected")
    with pytest.raises(RunLost) as lost:
        await inbox.get()
    assert lost.value.code == "node_reconnected"
