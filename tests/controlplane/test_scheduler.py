"""Scheduler.pick and NodeRegistry, on NodeSession objects built without a network."""

from __future__ import annotations

from collections import Counter

import pytest
import trio
from trio.testing import MockClock

from iop_trio.controlplane import NodeRegistry, NodeSession, NoNodeAvailable, RunInbox, Scheduler
from iop_trio.wire import NodeConfig, RegisterRequest


class StubConn:
    """pick() and the registry never touch the connection; anything sent would land here."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, message: object) -> None:
        self.sent.append(message)


def make_session(
    node_id: str,
    models: tuple[str, ...] = ("m",),
    capacity: int = 4,
    outstanding: int = 0,
) -> NodeSession:
    info = RegisterRequest(
        token="iop_x.y", node_id=node_id, version="test", models=models, capacity=capacity
    )
    config = NodeConfig(max_concurrency=capacity, heartbeat_interval=30)
    session = NodeSession(info, config, StubConn(), peer="x")  # type: ignore[arg-type]
    set_outstanding(session, outstanding)
    return session


def set_outstanding(session: NodeSession, count: int) -> None:
    session.runs = {f"{session.node_id}-run-{i}": RunInbox() for i in range(count)}


def make_scheduler(*sessions: NodeSession) -> tuple[NodeRegistry, Scheduler]:
    registry = NodeRegistry()
    for session in sessions:
        registry.add(session)
    return registry, Scheduler(registry)


def test_no_nodes_is_503() -> None:
    _, scheduler = make_scheduler()
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.pick("m")
    assert info.value.status == 503
    assert info.value.code == "no_node_available"


def test_no_node_serving_the_model_is_404() -> None:
    _, scheduler = make_scheduler(
        make_session("a", models=("m1",)), make_session("b", models=("m2",))
    )
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.pick("other")
    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert "other" in info.value.message


def test_all_serving_nodes_full_is_429() -> None:
    _, scheduler = make_scheduler(
        make_session("a", capacity=2, outstanding=2),
        make_session("b", capacity=1, outstanding=1),
        # A free node that does not serve the model does not help.
        make_session("c", models=("other",), capacity=8),
    )
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.pick("m")
    assert info.value.status == 429
    assert info.value.code == "capacity_exceeded"


def test_closed_nodes_are_not_picked() -> None:
    closed = make_session("a", outstanding=0)
    closed.close("gone")
    busy = make_session("b", capacity=4, outstanding=3)
    _, scheduler = make_scheduler(closed, busy)
    assert scheduler.pick("m") is busy
    set_outstanding(busy, 4)
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.pick("m")
    assert info.value.status == 429


def test_least_outstanding_relative_to_capacity_wins() -> None:
    # a: 3/4 = 0.75, b: 4/10 = 0.4, c: 1/2 = 0.5 -- b has the most outstanding runs but wins.
    a = make_session("a", capacity=4, outstanding=3)
    b = make_session("b", capacity=10, outstanding=4)
    c = make_session("c", capacity=2, outstanding=1)
    _, scheduler = make_scheduler(a, b, c)
    assert scheduler.pick("m") is b

    set_outstanding(b, 8)  # 0.8: now c (0.5) is the least loaded
    assert scheduler.pick("m") is c


def test_idle_node_wins_over_busy_one() -> None:
    busy = make_session("busy", capacity=100, outstanding=1)
    idle = make_session("idle", capacity=1, outstanding=0)
    _, scheduler = make_scheduler(busy, idle)
    assert scheduler.pick("m") is idle


def test_ties_go_to_the_longest_registered_node() -> None:
    first = make_session("first", capacity=2, outstanding=1)
    second = make_session("second", capacity=4, outstanding=2)
    _, scheduler = make_scheduler(first, second)
    assert scheduler.pick("m") is first


def test_load_spreads_as_runs_are_added() -> None:
    a = make_session("a", capacity=2)
    b = make_session("b", capacity=4)
    _, scheduler = make_scheduler(a, b)
    picks: Counter[str] = Counter()
    for i in range(6):
        session = scheduler.pick("m")
        session.runs[f"r{i}"] = RunInbox()
        picks[session.node_id] += 1
    # Both fill up in proportion to their capacity, then nothing is left.
    assert picks == {"a": 2, "b": 4}
    with pytest.raises(NoNodeAvailable) as info:
        scheduler.pick("m")
    assert info.value.status == 429


def test_nodes_not_serving_the_model_are_never_picked() -> None:
    # The idle, huge node serves other models only.
    idle_other = make_session("idle", models=("x", "y"), capacity=100)
    busy = make_session("busy", models=("y", "m"), capacity=4, outstanding=3)
    _, scheduler = make_scheduler(idle_other, busy)
    for _ in range(3):
        assert scheduler.pick("m") is busy
    assert scheduler.pick("x") is idle_other
    assert scheduler.pick("y") is idle_other


def test_exclude() -> None:
    a = make_session("a", capacity=4, outstanding=0)
    b = make_session("b", capacity=4, outstanding=3)
    _, scheduler = make_scheduler(a, b)
    assert scheduler.pick("m") is a
    assert scheduler.pick("m", exclude=frozenset({"a"})) is b
    assert scheduler.pick("m", exclude=frozenset({"b", "unknown"})) is a
    with pytest.raises(NoNodeAvailable):
        scheduler.pick("m", exclude=frozenset({"a", "b"}))


def test_pick_does_not_touch_the_connection() -> None:
    session = make_session("a")
    _, scheduler = make_scheduler(session)
    assert scheduler.pick("m") is session
    assert isinstance(session.conn, StubConn)
    assert session.conn.sent == []


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
    assert registry.serving("m1") == [a]
    assert registry.serving("m2") == [a, b]
    assert registry.serving("none") == []


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
    assert registry.serving("m1") == []
    assert registry.serving("m2") == [new]


def test_registry_remove_only_removes_the_current_session() -> None:
    registry = NodeRegistry()
    old = make_session("a")
    new = make_session("a")
    registry.add(old)
    registry.add(new)

    # The old connection's teardown must not unregister the node that replaced it.
    registry.remove(old)
    assert registry.sessions() == [new]

    registry.remove(new)
    assert len(registry) == 0
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


def test_registry_describe() -> None:
    registry = NodeRegistry()
    registry.add(make_session("n1", models=("m",), capacity=3, outstanding=2))
    (row,) = registry.describe()
    assert row["node_id"] == "n1"
    assert row["peer"] == "x"
    assert row["models"] == ["m"]
    assert row["max_concurrency"] == 3
    assert row["outstanding"] == 2


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
