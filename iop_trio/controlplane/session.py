"""The edge's side of one registered node: its connection, its runs, and how they end."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from ..transport import ConnectionClosed, FramedConnection
from ..wire import (
    CancelRequest,
    Drain,
    Error,
    Heartbeat,
    LocalProtocolError,
    Message,
    NodeConfig,
    RegisterRequest,
    RunEvent,
    RunRequest,
)
from .inbox import RunInbox

log = logging.getLogger("iop_trio.edge")


class NodeSession:
    """A connected node. Also the connection's :class:`~iop_trio.transport.PeerHandler`."""

    def __init__(
        self, info: RegisterRequest, config: NodeConfig, conn: FramedConnection, peer: str
    ) -> None:
        self.info = info
        self.config = config
        self.conn = conn
        self.peer = peer
        self.connected_at = time.time()
        self.scope = trio.CancelScope()
        self.runs: dict[str, RunInbox] = {}
        self.closed = False
        #: Set when the node announced it is shutting down: nothing new is scheduled to it.
        self.draining = False
        #: Called when a slot frees up, the node begins draining, or the session joins or leaves
        #: the registry, so the scheduler can re-rank it and give its free slots to queued
        #: requests (``Scheduler.update``).
        self.on_change: Callable[[NodeSession], None] = lambda session: None

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def outstanding(self) -> int:
        return len(self.runs)

    @property
    def has_capacity(self) -> bool:
        return len(self.runs) < self.config.max_concurrency

    @property
    def schedulable(self) -> bool:
        return not self.closed and not self.draining

    @property
    def load(self) -> float:
        return len(self.runs) / self.config.max_concurrency

    @property
    def state(self) -> str:
        return "closed" if self.closed else "draining" if self.draining else "ready"

    def serves(self, model: str) -> bool:
        return model in self.info.models

    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        if isinstance(message, RunEvent):
            inbox = self.runs.get(message.run_id)
            if inbox is not None:
                if inbox.abandoned:
                    if message.is_terminal:  # the node confirms the cancelled run is over
                        self.free(message.run_id)
                else:
                    inbox.put(message)
        elif isinstance(message, Heartbeat):
            pass
        elif isinstance(message, Drain):
            self.draining = True
            self.on_change(self)
            log.info("node draining", extra={"node_id": self.node_id, "reason": message.reason})
        elif isinstance(message, Error):
            inbox = self.runs.get(message.run_id or "")
            if inbox is not None and inbox.abandoned:
                self.free(message.run_id or "")
            elif inbox is not None:
                inbox.fail(message.code, message.message)
            else:
                log.warning(
                    "node reported an error",
                    extra={"node_id": self.node_id, "code": message.code, "reason": message.message},
                )
        else:
            await self.conn.send(
                Error(code="unexpected_message", message=f"an edge does not accept {type(message).__name__}")
            )

    def close(self, reason: str, code: str = "node_lost") -> None:
        """The connection is gone: every run still waiting on it fails now, never hangs."""
        self.closed = True
        for inbox in self.runs.values():
            inbox.fail(code, f"node {self.node_id} was lost: {reason}")

    def replace(self) -> None:
        """A newer connection registered with this node id: end this one."""
        self.scope.cancel()

    def reserve(self, run_id: str) -> RunInbox:
        """Take one of this node's slots for ``run_id`` (synchronously: the scheduler's decision
        and the slot it counts are one step)."""
        inbox = RunInbox()
        self.runs[run_id] = inbox
        return inbox

    async def send_run(self, request: RunRequest) -> None:
        """Send a reserved run to the node; a node already gone fails its inbox instead."""
        try:
            await self.conn.send(request)
            self.runs[request.run_id].sent = True
        except ConnectionClosed as exc:
            self.runs[request.run_id].fail("node_lost", f"node {self.node_id} was lost: {exc}")
        except LocalProtocolError as exc:
            self.runs[request.run_id].fail("request_too_large", f"the request does not fit in one frame: {exc}")

    async def finish_run(self, run_id: str, cancel_timeout: float) -> bool:
        """The edge is done with the run. If it had not ended, tell the node to cancel it
        (shielded, bounded) and keep its slot taken until the node confirms the end: the node
        counts the run until then, and a slot handed out early would be refused as busy.
        Returns True when a cancel was sent."""
        inbox = self.runs.get(run_id)
        if inbox is None:
            return False
        if inbox.ended or not inbox.sent or self.closed:
            self.free(run_id)  # nothing runs on the node for it: the slot is free now
            return False
        inbox.abandoned = True
        with trio.CancelScope(shield=True), trio.move_on_after(cancel_timeout):
            try:
                await self.conn.send(CancelRequest(run_id=run_id, reason="client went away"))
                return True
            except ConnectionClosed:
                pass  # the node is gone, and its runs with it
        return False

    def free(self, run_id: str) -> None:
        """``run_id`` no longer holds one of this node's slots."""
        if self.runs.pop(run_id, None) is not None:
            self.on_change(self)
