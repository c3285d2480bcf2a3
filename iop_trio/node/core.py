"""The node core: runs each ``run.request`` in its own cancel scope and records how it ended.

A run's scope lives in the connection's nursery, so three things can end it early and each is
recorded as such: ``cancel.request`` (the scope's ``cancel()``), the run's deadline (a nested
``move_on_after``), and the connection going away (the nursery's own cancellation).
"""

from __future__ import annotations

import logging
import math

import trio
from attrs import frozen

from ..adapters import BackendError, Completion, ExecutionSpec
from ..store import RunHistory, RunOutcome
from ..transport import ConnectionClosed, FramedConnection
from ..wire import CancelRequest, Error, Heartbeat, Message, NodeConfig, RunEvent, RunRequest
from .router import Route, Router, UnknownModel
from .run import RunTracker, final_event

log = logging.getLogger("iop_trio.node")

class RegistrationRefused(Exception):
    """The edge refused this node (bad or revoked token, node id not allowed): retrying is futile."""


class NodeReplaced(RegistrationRefused):
    """Another process registered with this node id; this one must stop, not fight it."""


@frozen
class Admitted:
    route: Route
    spec: ExecutionSpec
    scope: trio.CancelScope


@frozen
class Refused:
    code: str
    message: str


class NodeCore:
    def __init__(self, node_id: str, router: Router, history: RunHistory, max_concurrency: int) -> None:
        self.node_id = node_id
        self.router = router
        self.history = history
        self.max_concurrency = max_concurrency
        self.draining = False
        self._runs: dict[str, trio.CancelScope] = {}
        self._cancel_reasons: dict[str, str] = {}
        self._idle = trio.Event()
        self._idle.set()

    @property
    def active_runs(self) -> int:
        return len(self._runs)

    def apply(self, config: NodeConfig) -> None:
        """Adopt the centrally managed settings from ``register.response``."""
        self.max_concurrency = config.max_concurrency

    def cancel(self, run_id: str, reason: str = "cancelled by client") -> bool:
        scope = self._runs.get(run_id)
        if scope is None:
            return False
        self._cancel_reasons.setdefault(run_id, reason)
        scope.cancel()
        return True

    def cancel_all(self, reason: str) -> None:
        for run_id in list(self._runs):
            self.cancel(run_id, reason)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def handler(self, conn: FramedConnection) -> NodeConnectionHandler:
        return NodeConnectionHandler(self, conn)

    def admit(self, request: RunRequest) -> Admitted | Refused:
        """Decide synchronously, as the request is read: a ``cancel.request`` right behind it must
        find the run's scope already registered, and capacity must count it at once."""
        if request.run_id in self._runs:
            return Refused("duplicate_run", f"run {request.run_id} is already running")
        if self.draining:
            return Refused("node_draining", f"node {self.node_id} is draining")
        if len(self._runs) >= self.max_concurrency:
            return Refused("node_busy", f"node {self.node_id} is at capacity ({self.max_concurrency})")
        try:
            route, spec = self.router.resolve(request)
        except UnknownModel:
            return Refused("model_not_found", f"model {request.model!r} is not served by node {self.node_id}")
        scope = trio.CancelScope()
        if not self._runs:
            self._idle = trio.Event()
        self._runs[request.run_id] = scope
        return Admitted(route, spec, scope)

    async def refuse(self, request: RunRequest, refusal: Refused, conn: FramedConnection) -> None:
        if refusal.code == "duplicate_run":
            # Not a run event: that would end the legitimate run with this id on the edge.
            await conn.send(Error(code=refusal.code, message=refusal.message, run_id=request.run_id))
        else:
            await conn.send(
                RunEvent(run_id=request.run_id, kind="error", code=refusal.code, message=refusal.message)
            )

    async def run(self, request: RunRequest, admitted: Admitted, conn: FramedConnection) -> None:
        """Execute one admitted run to exactly one recorded end."""
        route, spec, scope = admitted.route, admitted.spec, admitted.scope
        tracker = RunTracker(conn, request.run_id)
        outcome: RunOutcome | None = None
        code, finish_reason = "cancelled", None
        try:
            await self.history.start_run(request.run_id, self.node_id, request.model, route.adapter.name)
            with scope:
                outcome, code, finish_reason = await self._execute(route, spec, tracker, request.deadline)
            if outcome is None:
                reason = self._cancel_reasons.get(request.run_id, "cancelled by client")
                outcome = tracker.outcome("cancelled", error=reason)
        finally:
            connection_lost = outcome is None
            if outcome is None:
                # Cancelled from outside the run's own scope: the connection ended or the node is
                # shutting down. There is nobody to tell, but the row must still say so.
                outcome = tracker.outcome("cancelled", error="connection to edge lost")
            try:
                with trio.CancelScope(shield=True):
                    await self.history.end_run(request.run_id, outcome)
                if not connection_lost:
                    if outcome.status == "complete":
                        await tracker.started()  # a run that produced no text still started
                    await send_final(conn, final_event(request.run_id, outcome, code, finish_reason))
            finally:
                # Only now is the run over: a drain waiting for idleness must find its last
                # event already queued on the connection.
                del self._runs[request.run_id]
                self._cancel_reasons.pop(request.run_id, None)
                if not self._runs:
                    self._idle.set()
            log.info(
                "run ended",
                extra={
                    "run_id": request.run_id,
                    "model": request.model,
                    "status": outcome.status,
                    "completion_tokens": outcome.completion_tokens,
                },
            )

    async def _execute(
        self, route: Route, spec: ExecutionSpec, tracker: RunTracker, deadline: float | None
    ) -> tuple[RunOutcome, str, str | None]:
        """Run the adapter under the deadline; map every way it can end except cancellation."""
        with trio.move_on_after(deadline if deadline else math.inf) as deadline_scope:
            try:
                completion: Completion = await route.adapter.execute(spec, tracker)
            except BackendError as exc:
                return tracker.outcome("error", error=exc.message), exc.code, None
            except ConnectionClosed:
                raise
            except Exception as exc:
                # One adapter bug must not take the connection and every other run down with it.
                log.exception("adapter crashed", extra={"run_id": spec.run_id})
                return tracker.outcome("error", error=f"adapter failed: {exc!r}"), "internal_error", None
        if deadline_scope.cancelled_caught:
            message = f"run exceeded its deadline of {deadline:g}s"
            return tracker.outcome("error", error=message), "deadline_exceeded", None
        usage = tracker.usage(completion.usage)
        return tracker.outcome("complete", usage=usage), "", completion.finish_reason


async def send_final(conn: FramedConnection, event: RunEvent) -> None:
    """Queue the run's terminal event behind its deltas, however long the outbox takes.

    Never dropped and never timed out: the edge would wait for it forever. It is not
    shielded either: if the connection dies meanwhile, its nursery's cancellation ends this
    wait, and the edge learns of the loss from the connection itself."""
    try:
        await conn.send(event)
    except ConnectionClosed:
        pass  # the edge is gone; the history row is what remains


class NodeConnectionHandler:
    """Dispatches the messages of one edge connection into the node core."""

    def __init__(self, core: NodeCore, conn: FramedConnection) -> None:
        self.core = core
        self.conn = conn

    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        if isinstance(message, RunRequest):
            decision = self.core.admit(message)
            if isinstance(decision, Refused):
                await self.core.refuse(message, decision, self.conn)
            else:
                nursery.start_soon(self.core.run, message, decision, self.conn, name=f"run {message.run_id}")
        elif isinstance(message, CancelRequest):
            # A cancel for a run that already ended is normal (the race is inherent): ignore it.
            self.core.cancel(message.run_id)
        elif isinstance(message, Heartbeat):
            pass
        elif isinstance(message, Error):
            if message.code == "node_replaced":
                raise NodeReplaced(f"another node registered with this node id: {message.message}")
            log.warning("edge reported an error", extra={"code": message.code, "reason": message.message})
        else:
            await self.conn.send(
                Error(code="unexpected_message", message=f"a node does not accept {type(message).__name__}")
            )
