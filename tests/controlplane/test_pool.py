"""NodePool: the heap-ordered pick agrees with a full scan, whatever the sequence of changes."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from iop_trio.controlplane.pool import REBUILD_FACTOR, REBUILD_SLACK, NodePool
from iop_trio.controlplane.session import NodeSession
from tests.controlplane.test_scheduler import make_session

NODES = 5
operations = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "free", "drain", "reregister", "remove", "pick"]),
        st.integers(0, NODES - 1),
        st.frozensets(st.integers(0, NODES - 1), max_size=2),
    ),
    max_size=300,
)


class Reference:
    """What the pool must answer, computed by scanning every session."""

    def __init__(self) -> None:
        self.order: dict[int, int] = {}  # id(session) -> registration order
        self.members: dict[str, NodeSession] = {}
        self.orders = itertools.count()

    def update(self, session: NodeSession, eligible: bool) -> None:
        if not eligible:
            if self.members.get(session.node_id) is session:
                del self.members[session.node_id]
            return
        if self.members.get(session.node_id) is not session:
            self.members[session.node_id] = session
            self.order[id(session)] = next(self.orders)

    def pick(self, exclude: frozenset[str]) -> NodeSession | None:
        free = [s for s in self.members.values() if s.has_capacity and s.node_id not in exclude]
        return min(free, key=lambda s: (s.load, self.order[id(s)]), default=None)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_pick_matches_a_full_scan(ops: list[tuple[str, int, frozenset[int]]]) -> None:
    shared = itertools.count()
    pool, reference = NodePool(shared), Reference()
    sessions = [make_session(f"n{i}", capacity=1 + i % 3) for i in range(NODES)]
    runs = itertools.count()

    def update(session: NodeSession, eligible: bool) -> None:
        pool.update(session, eligible)
        reference.update(session, eligible)

    for session in sessions:
        update(session, True)
    for op, index, excluded in ops:
        session = sessions[index]
        eligible = reference.members.get(session.node_id) is session
        if op == "reserve" and eligible and session.has_capacity:
            session.reserve(f"r{next(runs)}")
            update(session, True)
        elif op == "free" and session.runs:
            session.free(next(iter(session.runs)))
            update(session, eligible)
        elif op == "drain":
            session.draining = True
            update(session, False)
        elif op == "reregister":  # a new connection under the same node id, idle again
            sessions[index] = make_session(session.node_id, capacity=session.config.max_concurrency)
            update(sessions[index], True)
        elif op == "remove":
            update(session, False)
        elif op == "pick":
            exclude = frozenset(f"n{i}" for i in excluded)
            assert pool.pick(exclude) is reference.pick(exclude)
            assert pool.any_eligible(exclude) == any(n not in exclude for n in reference.members)
        # The heap never holds more than a bounded number of entries per member.
        assert len(pool._heap) <= REBUILD_FACTOR * len(reference.members) + REBUILD_SLACK + 1
    assert pool.pick() is reference.pick(frozenset())
    assert len(pool) == len(reference.members)


def test_a_node_that_began_draining_without_an_update_is_not_picked() -> None:
    pool = NodePool(itertools.count())
    a, b = make_session("a"), make_session("b")
    pool.update(a, True)
    pool.update(b, True)
    a.draining = True
    assert pool.pick() is b
    assert len(pool) == 1


def test_a_load_change_without_an_update_never_overcommits_a_node() -> None:
    pool = NodePool(itertools.count())
    a, b = make_session("a", capacity=1), make_session("b", capacity=2, outstanding=1)
    pool.update(a, True)
    pool.update(b, True)
    a.reserve("r1")  # a is full now, but the pool was not told
    assert pool.pick() is b
    b.reserve("r2")
    assert pool.pick() is None


def test_many_changes_on_few_nodes_keep_the_heap_small() -> None:
    pool = NodePool(itertools.count())
    a = make_session("a", capacity=10)
    pool.update(a, True)
    for i in range(10_000):
        a.reserve(f"r{i}")
        pool.update(a, True)
        a.free(f"r{i}")
        pool.update(a, True)
    assert len(pool._heap) <= REBUILD_FACTOR + REBUILD_SLACK + 1
    assert pool.pick() is a


def test_the_heap_shrinks_when_members_leave() -> None:
    """Stale entries piled up by one busy node are dropped when the others leave, not kept (with
    the sessions they point to) until something is added again."""
    pool = NodePool(itertools.count())
    sessions = [make_session(f"n{i}", capacity=2) for i in range(NODES)]
    for session in sessions:
        pool.update(session, True)
    busy = sessions[0]
    for i in range(REBUILD_SLACK // 2):
        busy.reserve(f"r{i}")
        pool.update(busy, True)
        busy.free(f"r{i}")
        pool.update(busy, True)
    for session in sessions:
        pool.update(session, False)
        assert len(pool._heap) <= REBUILD_FACTOR * len(pool) + REBUILD_SLACK
    assert len(pool) == 0
