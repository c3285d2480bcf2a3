"""The nodes that may run one model, least loaded first: a pick is O(log n) in the fleet's size.

A full scan over the model's nodes per request cost the edge ~1.9 ms of CPU per request with
1,000 nodes (bench/results). Instead each model keeps a heap of ``(load, order, version,
session)``; whenever a session's load or state changes the scheduler calls :meth:`update`, which
pushes a fresh entry and makes the session's older entries stale. Stale entries are dropped when
they reach the top, and the heap is rebuilt whenever they outnumber the live ones (on a removal
too), so its size stays proportional to the number of member nodes.

Members are the sessions that serve the model, are schedulable (not closed, not draining) and
that placement allows (labels are fixed at registration, placement at start-up), so those
filters are applied once per change, not once per request. Ties in load go to the node
registered first (``order``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from attrs import define

from .session import NodeSession

_Entry = tuple[float, int, int, NodeSession]

#: The heap is rebuilt once it holds this many times more entries than members (plus slack).
REBUILD_FACTOR = 2
REBUILD_SLACK = 32


@define
class _Member:
    session: NodeSession
    order: int
    version: int = 0


class NodePool:
    def __init__(self, orders: Iterator[int]) -> None:
        #: Registration order, shared by every pool so ties break the same way in all of them.
        self._orders = orders
        self._members: dict[str, _Member] = {}
        self._heap: list[_Entry] = []

    def __len__(self) -> int:
        return len(self._members)

    def update(self, session: NodeSession, eligible: bool) -> None:
        """``session``'s load or state changed; ``eligible`` says whether it may take this model's
        runs at all (schedulable and allowed by placement)."""
        node_id = session.node_id
        member = self._members.get(node_id)
        if not eligible:
            if member is not None and member.session is session:
                del self._members[node_id]  # its heap entries are stale from now on
                self._trim()
            return
        if member is None or member.session is not session:  # new, or re-registered under its id
            member = self._members[node_id] = _Member(session, next(self._orders))
        member.version += 1
        heapq.heappush(self._heap, (session.load, member.order, member.version, session))
        self._trim()

    def pick(self, exclude: frozenset[str] = frozenset()) -> NodeSession | None:
        """The least loaded member with a free slot that is not in ``exclude``, or None."""
        heap = self._heap
        set_aside: list[_Entry] = []
        try:
            while heap:
                load, order, version, session = heap[0]
                member = self._members.get(session.node_id)
                if member is None or member.session is not session or member.version != version:
                    heapq.heappop(heap)
                elif not session.schedulable:  # closed or draining since its last update
                    heapq.heappop(heap)
                    del self._members[session.node_id]
                elif load != session.load:  # changed without an update: re-rank, never lose it
                    heapq.heapreplace(heap, (session.load, order, version, session))
                elif not session.has_capacity:
                    return None  # the least loaded one is full, so all of them are
                elif session.node_id in exclude:
                    set_aside.append(heapq.heappop(heap))
                else:
                    return session
            return None
        finally:
            for entry in set_aside:
                heapq.heappush(heap, entry)

    def any_eligible(self, exclude: frozenset[str] = frozenset()) -> bool:
        """Whether some member could take a run now or later (full or not), ``exclude`` aside."""
        return any(
            m.session.schedulable and node_id not in exclude for node_id, m in self._members.items()
        )

    def _trim(self) -> None:
        """Rebuild from the members once stale entries outnumber them, so the heap (and the
        sessions its entries keep alive) never outgrows the pool."""
        if len(self._heap) > REBUILD_FACTOR * len(self._members) + REBUILD_SLACK:
            self._heap = [(m.session.load, m.order, m.version, m.session) for m in self._members.values()]
            heapq.heapify(self._heap)
