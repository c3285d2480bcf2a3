"""The node role: dial the edge, register, serve runs; reconnect with backoff; drain on shutdown.

Nursery tree::

    run_node
    ├── shutdown watcher (drain: refuse new runs, wait for in-flight ones, then cancel)
    └── connect loop
        └── one connection at a time: writer, heartbeats, read loop, one task per run
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from .. import __version__
from ..config import ConfigError, NodeSettings, parse_host_port
from ..store import RunRecorder, RunStore
from ..transport import (
    Backoff,
    ConnectionClosed,
    FramedConnection,
    HandshakeFailed,
    HeartbeatTimeout,
    client_context,
    dial,
    serve_peer,
)
from ..wire import Drain, Error, RegisterRequest, RegisterResponse, RemoteProtocolError
from .core import NodeCore, RegistrationRefused
from .router import Router

log = logging.getLogger("iop_trio.node")


Connect = Callable[[], Awaitable[trio.abc.Stream]]


class NodeRunner:
    """``connect`` opens the stream to the edge; by default TCP + TLS to ``settings.edge``
    (the deterministic cluster simulation passes memory streams instead)."""

    def __init__(
        self, settings: NodeSettings, router: Router, store: RunStore, connect: Connect | None = None
    ) -> None:
        self.settings = settings
        self.router = router
        self.store = store
        self.history = RunRecorder(store)
        self.core = NodeCore(settings.node_id, router, self.history, settings.capacity)
        self.host, self.port = parse_host_port(settings.edge, "edge")
        self.token = settings.resolve_token()
        self.ssl_context = client_context(settings.tls) if settings.tls.enabled else None
        self.backoff = Backoff(settings.reconnect.initial, settings.reconnect.maximum)
        self.connected = False
        self._reported_ready = False
        self._conn: FramedConnection | None = None
        self._connect: Connect = connect or self._dial

    async def run(
        self,
        shutdown: Callable[[], Awaitable[None]],
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until ``shutdown`` returns, then drain. Reports ``edge`` address once registered.
        The adapters are closed on the way out (pooled backend connections, child processes)."""
        try:
            async with trio.open_nursery() as outer:
                # The history writer outlives every run: it stops only once they have all ended.
                await outer.start(self.history.run)
                try:
                    async with trio.open_nursery() as nursery:
                        connect_scope = trio.CancelScope()

                        async def connect() -> None:
                            with connect_scope:
                                await self._connect_loop(task_status)

                        nursery.start_soon(connect)
                        await shutdown()
                        if not self._reported_ready:
                            self._reported_ready = True
                            task_status.started("")  # stopped before it ever registered
                        await self.drain(connect_scope)
                finally:
                    self.history.close()
        finally:
            with trio.CancelScope(shield=True):
                await self.router.aclose()

    async def drain(self, connect_scope: trio.CancelScope) -> None:
        """Tell the edge, refuse new runs, let in-flight ones finish within the grace period,
        cancel the rest."""
        self.core.draining = True
        if self._conn is not None:
            with trio.move_on_after(1.0):
                try:
                    await self._conn.send(Drain(reason="node shutting down"))
                except ConnectionClosed:
                    pass  # the edge is gone already; nothing will be scheduled here anyway
        log.info(
            "draining", extra={"active_runs": self.core.active_runs, "grace": self.settings.shutdown_grace}
        )
        with trio.move_on_after(self.settings.shutdown_grace):
            await self.core.wait_idle()
        self.core.cancel_all("node shut down before the run finished")
        await self.core.wait_idle()
        if self._conn is not None:
            # The runs' last events may still be queued: flush them before hanging up.
            await self._conn.flush_and_close()
        connect_scope.cancel()

    async def _connect_loop(self, task_status: trio.TaskStatus[str]) -> None:
        while True:
            try:
                await self._serve_once(task_status)
            except* RegistrationRefused:
                raise
            except* (ConnectionClosed, HandshakeFailed, HeartbeatTimeout, RemoteProtocolError, trio.TooSlowError) as group:
                reasons = "; ".join(str(exc) for exc in group.exceptions)
                if not self.core.draining:  # while draining, we are the ones hanging up
                    log.warning("connection to edge ended", extra={"edge": self.settings.edge, "reason": reasons})
            self.connected = False
            if self.core.draining:
                return  # shutting down: the edge went first, nothing left to reconnect for
            delay = self.backoff.next_delay()
            log.info("reconnecting", extra={"edge": self.settings.edge, "delay_s": round(delay, 3)})
            await trio.sleep(delay)

    async def _serve_once(self, task_status: trio.TaskStatus[str]) -> None:
        # Ask opted-in backends for their models before dialing: the edge's registration deadline
        # must not pay for a slow backend.
        with trio.move_on_after(self.settings.register_timeout):
            await self.router.discover()
        stream = await self._connect()
        conn = FramedConnection(stream, max_frame_size=self.settings.max_frame_size, peer=self.settings.edge)
        try:
            response = await self._register(conn)
            if response.config is not None:
                self.core.apply(response.config)
            heartbeat = response.config.heartbeat_interval if response.config else 30.0
            self.connected = True
            self.backoff.reset()
            log.info(
                "registered",
                extra={"edge": self.settings.edge, "node_id": self.settings.node_id, "models": ",".join(self.router.models)},
            )
            if not self._reported_ready:
                self._reported_ready = True
                task_status.started(self.settings.edge)
            self._conn = conn
            if self.core.draining:
                await conn.send(Drain(reason="node shutting down"))
            await serve_peer(conn, self.core.handler(conn), heartbeat_interval=heartbeat)
        finally:
            self._conn = None
            await conn.flush_and_close()

    async def _dial(self) -> trio.abc.Stream:
        return await dial(
            self.host,
            self.port,
            ssl_context=self.ssl_context,
            server_hostname=self.settings.server_name or None,
            handshake_timeout=self.settings.handshake_timeout,
        )

    async def _register(self, conn: FramedConnection) -> RegisterResponse:
        request = RegisterRequest(
            token=self.token,
            node_id=self.settings.node_id,
            version=__version__,
            adapters=self.router.adapter_names,
            models=self.router.models,
            capacity=self.settings.capacity,
            labels=dict(self.settings.labels),
        )
        with trio.fail_after(self.settings.register_timeout):
            await conn.send_now(request)
            response = await conn.receive()
        if isinstance(response, Error):
            # A protocol-level complaint (too slow, malformed, ...): worth another attempt. Only an
            # explicit refusal (accepted=false: bad or revoked token) is final.
            raise RemoteProtocolError(f"edge answered registration with {response.code}: {response.message}")
        if not isinstance(response, RegisterResponse):
            raise RemoteProtocolError(f"expected register.response, got {type(response).__name__}")
        if not response.accepted:
            raise RegistrationRefused(f"edge refused registration: {response.reason}")
        return response


def build_node(
    settings: NodeSettings, source: str, *, connect: Connect | None = None, in_thread: bool = True
) -> NodeRunner:
    """Everything a node needs, validated before any socket is opened."""
    if not settings.models and not any(block.get("advertise_all") for block in settings.adapters.values()):
        raise ConfigError(
            f"{source}: models: a node must serve at least one model (or set advertise_all on an adapter)"
        )
    router = Router.from_settings(settings, source)
    store = RunStore(settings.database, in_thread=in_thread)
    return NodeRunner(settings, router, store, connect)
