"""The edge's side of one registered node: its connection, its runs, and how they end."""

from __future__ import annotations

import logging
import time

import trio

from ..transport import ConnectionClosed, FramedConnection
from ..wire import (
    CancelRequest,
    Error,
    Heartbeat,
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

    @property
    def node_id(self) -> str:
        return self.info.node_id

    @property
    def outstanding(self) -> int:
        return len(self.runs)

    @property
    def has_capacity(self) -> bool:
        return len(self.runs) < self.config.max_concurrency

    def serves(self, model: str) -> bool:
        return model in self.info.models

    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        if isinstance(message, RunEvent):
            inbox = self.runs.get(message.run_id)
            if inbox is not None:
                inbox.put(message)
            # Events for a run the edge already gave up on are expected after a cancel: dropped.
        elif isinstance(message, Heartbeat):
            pass
        elif isinstance(message, Error):
            inbox = self.runs.get(message.run_id or "")
            if inbox is not None:
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

    def close(self, reason: str) -> None:
        """The connection is gone: every run still waiting on it fails now, never hangs."""
        self.closed = True
        for inbox in self.runs.values():
            inbox.fail("node_lost", f"node {self.node_id} was lost: {reason}")

    def replace(self) -> None:
        """A newer connection registered with this node id: end this one."""
        self.scope.cancel()

    async def start_run(self, request: RunRequest) -> RunInbox:
        """Register the run's inbox and send the request to the node."""
        if self.closed:
            raise ConnectionClosed(f"node {self.node_id} is gone")
        inbox = RunInbox()
        self.runs[request.run_id] = inbox
        try:
            await self.conn.send(request)
        except BaseException:
            del self.runs[request.run_id]
            raise
        return inbox

    async def finish_run(self, run_id: str, cancel_timeout: float) -> bool:
        """Forget the run; if it had not ended, tell the node to cancel it (shielded, bounded).

        Returns True when a cancel was sent."""
        inbox = self.runs.pop(run_id, None)
        if inbox is None or inbox.ended or self.closed:
            return False
        with trio.CancelScope(shield=True), trio.move_on_after(cancel_timeout):
            try:
                await self.conn.send(CancelRequest(run_id=run_id, reason="client went away"))
                return True
            except ConnectionClosed:
                pass  # the node is gone, and its runs with it
        return False
