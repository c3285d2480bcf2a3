"""Scheduling and backpressure: which node runs a request, and who waits when all are full.

Candidates are the nodes that serve the model, are neither draining nor gone, are allowed by
placement policy, and were not already tried for this request. Among those with a free slot the
least loaded relative to its ``max_concurrency`` wins (exactly, not power-of-two choices: each
model's nodes are kept ordered by load in a :class:`~.pool.NodePool`, so a pick is O(log n) even
with thousands of nodes). A slot is reserved in the same step as the decision, so no node is ever
given more runs than its ``max_concurrency``.

When every candidate is full the request waits in its model's queue: a heap ordered by priority
(higher first), then arrival. The queue is bounded (``queue.max_waiting``) and so is the wait
(``queue.timeout``); past either the client gets 429. A freed slot is handed directly to the
best waiter, so a newcomer can never overtake the queue. A waiter whose client disconnects is
cancelled like any trio task and leaves the queue at once.
"""

from __future__ import annotations

import heapq
import itertools

import trio
from attrs import define, field

from ..config import QueueConfig
from .inbox import RunInbox
from .policy import Placement
from .pool import NodePool
from .registry import NodeRegistry
from .session import NodeSession


class NoNodeAvailable(Exception):
    """Why nothing can take the request, as an HTTP status and an OpenAI error code."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


@define(eq=False)
class Waiter:
    model: str
    run_id: str
    exclude: frozenset[str]
    granted: trio.Event = field(factory=trio.Event)
    session: NodeSession | None = None
    inbox: RunInbox | None = None
    abandoned: bool = False


@define
class Grant:
    session: NodeSession
    inbox: RunInbox


class Scheduler:
    def __init__(
        self, registry: NodeRegistry, placement: Placement | None = None, queue: QueueConfig | None = None
    ) -> None:
        self.registry = registry
        self.placement = placement or Placement({})
        self.queue = queue or QueueConfig()
        self._queues: dict[str, list[tuple[int, int, Waiter]]] = {}
        self._waiting: dict[str, int] = {}
        self._arrivals = itertools.count()
        self._pools: dict[str, NodePool] = {}
        self._registrations = itertools.count()

    def waiting(self, model: str) -> int:
        return self._waiting.get(model, 0)

    def total_waiting(self) -> int:
        return sum(self._waiting.values())

    def has_candidates(self, model: str, exclude: frozenset[str] = frozenset()) -> bool:
        """Whether some node could take ``model`` now or once it has a free slot."""
        pool = self._pools.get(model)
        return pool is not None and pool.any_eligible(exclude)

    def check_servable(self, model: str, exclude: frozenset[str] = frozenset()) -> NodePool:
        """The model's pool; fail fast when no node could ever take the request, rather than queue it."""
        if not len(self.registry):
            raise NoNodeAvailable(503, "no_node_available", "no inference node is connected", retry_after=1)
        if not self.registry.serves(model):
            raise NoNodeAvailable(404, "model_not_found", f"The model `{model}` does not exist or no node serves it.")
        if not self.has_candidates(model, exclude):
            raise NoNodeAvailable(
                503, "no_node_available", f"no node can take `{model}` now (draining, placement or failed)",
                retry_after=1,
            )
        return self._pools[model]

    async def acquire(
        self, model: str, run_id: str, priority: int = 0, exclude: frozenset[str] = frozenset()
    ) -> Grant:
        """A node with a slot reserved for ``run_id``; waits in the model's queue when all are full."""
        pool = self.check_servable(model, exclude)
        if not self.waiting(model):
            session = pool.pick(exclude)
            if session is not None:  # a free slot and nobody ahead: no queueing at all
                return Grant(session, self._reserve(session, run_id))
        if self.waiting(model) >= self.queue.max_waiting:
            raise NoNodeAvailable(
                429, "queue_full", f"every node serving `{model}` is busy and its queue is full", retry_after=1
            )
        waiter = Waiter(model, run_id, exclude)
        heapq.heappush(self._queues.setdefault(model, []), (-priority, next(self._arrivals), waiter))
        self._waiting[model] = self.waiting(model) + 1
        self._dispatch(model)
        keep = False
        try:
            with trio.move_on_after(self.queue.timeout):
                await waiter.granted.wait()
            keep = waiter.session is not None
        finally:
            if not keep:
                self._abandon(waiter)
        if waiter.session is None or waiter.inbox is None:
            raise NoNodeAvailable(
                429, "queue_timeout",
                f"no node serving `{model}` had a free slot within {self.queue.timeout:g}s", retry_after=1,
            )
        return Grant(waiter.session, waiter.inbox)

    def _abandon(self, waiter: Waiter) -> None:
        if waiter.session is not None:
            # Granted, but the client left before it could use the slot: give it back.
            waiter.session.free(waiter.run_id)
        elif not waiter.abandoned:
            waiter.abandoned = True
            self._waiting[waiter.model] -= 1

    def update(self, session: NodeSession) -> None:
        """``session`` joined or left the registry, freed a slot or began draining: re-rank it,
        then hand its free slots to the queues (every session's ``on_change``)."""
        self._rank(session)
        for model in session.info.models:
            if self.waiting(model):
                self._dispatch(model)

    def _rank(self, session: NodeSession) -> None:
        for model in session.info.models:
            eligible = (
                session.schedulable
                and self.registry.holds(session)
                and self.placement.allows(model, session.info.labels)
            )
            pool = self._pools.get(model)
            if pool is None:
                if not eligible:
                    continue
                pool = self._pools[model] = NodePool(self._registrations)
            pool.update(session, eligible)
            if not len(pool):
                del self._pools[model]  # model names come and go (versions, fine-tunes)

    def _reserve(self, session: NodeSession, run_id: str) -> RunInbox:
        inbox = session.reserve(run_id)
        self._rank(session)
        return inbox

    def _dispatch(self, model: str) -> None:
        """Hand free slots to waiters in priority order. A waiter that cannot use any free node
        (a retry excluding the nodes that failed it) is skipped, not allowed to block the rest."""
        queue = self._queues.get(model)
        pool = self._pools.get(model)
        if not queue or pool is None:
            return
        skipped: list[tuple[int, int, Waiter]] = []
        while queue and pool.pick() is not None:
            item = heapq.heappop(queue)
            waiter = item[2]
            if waiter.abandoned:
                continue
            session = pool.pick(waiter.exclude)
            if session is None:
                skipped.append(item)
                continue
            self._waiting[model] -= 1
            waiter.session = session
            waiter.inbox = self._reserve(session, waiter.run_id)
            waiter.granted.set()
        for item in skipped:
            heapq.heappush(queue, item)
