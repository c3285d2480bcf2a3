"""The edge's IOP side: accept a node, check its registration, serve its connection.

Per connection: the first frame must be ``register.request`` within ``register_timeout``, carrying
a valid, unrevoked token. Then the connection's nursery (writer, heartbeats, read loop) runs inside
the session's cancel scope, so a newer registration of the same node id ends this one.
"""

from __future__ import annotations

import logging

import trio

from ..controlplane import NodeSession
from ..controlplane.policy import labels_match
from ..transport import (
    ConnectionClosed,
    FramedConnection,
    HeartbeatTimeout,
    reject_peer,
    serve_peer,
)
from ..wire import NodeConfig, RegisterRequest, RegisterResponse, RemoteProtocolError
from .state import EdgeState

log = logging.getLogger("iop_trio.edge")


class NodeAcceptor:
    def __init__(self, state: EdgeState) -> None:
        self.state = state

    async def __call__(self, stream: trio.abc.Stream, peer: str) -> None:
        iop = self.state.config.iop
        conn = FramedConnection(stream, max_frame_size=iop.max_frame_size, peer=peer)
        request = await self._receive_registration(conn, peer)
        if request is None:
            return
        check = await self.state.tokens.check(request.token, request.node_id)
        if not check.ok:
            log.warning(
                "node registration refused",
                extra={"peer": peer, "node_id": request.node_id, "reason": check.reason},
            )
            await self._refuse(conn, f"registration refused: {check.reason}")
            return
        config = self._node_config(request)
        session = NodeSession(request, config, conn, peer)
        try:
            await conn.send_now(RegisterResponse(accepted=True, config=config))
        except ConnectionClosed:
            return
        await self._serve(session)

    async def _receive_registration(self, conn: FramedConnection, peer: str) -> RegisterRequest | None:
        try:
            with trio.fail_after(self.state.config.iop.register_timeout):
                first = await conn.receive()
        except trio.TooSlowError:
            await reject_peer(conn, "register_timeout", "no register.request within the deadline")
            log.warning("node did not register in time", extra={"peer": peer})
            return None
        except RemoteProtocolError as exc:
            await reject_peer(conn, exc.code, str(exc))
            log.warning("protocol error before registration", extra={"peer": peer, "reason": str(exc)})
            return None
        except ConnectionClosed:
            return None
        if not isinstance(first, RegisterRequest):
            await reject_peer(conn, "register_required", "the first frame must be register.request")
            return None
        return first

    async def _refuse(self, conn: FramedConnection, reason: str) -> None:
        with trio.move_on_after(1.0):
            try:
                await conn.send_now(RegisterResponse(accepted=False, reason=reason))
            except ConnectionClosed:
                pass
        await conn.flush_and_close()

    def _node_config(self, request: RegisterRequest) -> NodeConfig:
        """The central config for this node: the edge's default ``max_concurrency``, or the first
        override matching its id or labels, never above the capacity the node declared."""
        defaults = self.state.config.nodes
        limit = defaults.max_concurrency
        for override in defaults.overrides:
            if (override.node_id and override.node_id == request.node_id) or (
                not override.node_id and override.labels and labels_match(override.labels, request.labels)
            ):
                limit = override.max_concurrency
                break
        return NodeConfig(
            max_concurrency=max(1, min(request.capacity, limit)),
            heartbeat_interval=defaults.heartbeat_interval,
            models=request.models,
            labels=dict(request.labels),
        )

    async def _serve(self, session: NodeSession) -> None:
        registry, metrics = self.state.registry, self.state.metrics
        reason = "connection closed"
        session.on_change = self.state.scheduler.update
        with session.scope:
            registry.add(session)  # through on_change its free slots serve requests already queued
            metrics.connected_nodes.set(len(registry))
            log.info(
                "node registered",
                extra={"node_id": session.node_id, "peer": session.peer, "models": ",".join(session.info.models)},
            )
            try:
                await serve_peer(
                    session.conn, session, heartbeat_interval=session.config.heartbeat_interval
                )
            except* (ConnectionClosed, HeartbeatTimeout, RemoteProtocolError) as group:
                reason = "; ".join(str(exc) for exc in group.exceptions)
            finally:
                replaced = session.scope.cancel_called
                if replaced:
                    reason = "replaced by a newer registration"
                registry.remove(session)
                session.close(reason, "node_reconnected" if replaced else "node_lost")
                metrics.connected_nodes.set(len(registry))
        if session.scope.cancelled_caught:
            # Tell the old process, if it is still alive, so two nodes sharing an id do not take
            # turns replacing each other forever.
            await reject_peer(session.conn, "node_replaced", f"node id {session.node_id!r} registered again elsewhere")
        await session.conn.flush_and_close()
        log.info("node disconnected", extra={"node_id": session.node_id, "reason": reason})
