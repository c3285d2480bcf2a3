"""The edge role: the IOP listener for nodes and the HTTP API, in one nursery.

Nursery tree::

    run_edge
    ├── IOP listener ── per node connection: writer, heartbeats, read loop
    └── hypercorn ───── per HTTP request: handler / SSE stream (each owns one EdgeRun)

Hypercorn serves :class:`~.openai_asgi.OpenAIFastPath`: chat and text completions as raw ASGI,
every other request through the Quart app (``create_app``).

Shutdown: stop accepting HTTP, let in-flight requests finish within ``http.graceful_timeout``,
then close the node connections.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from ..config import EdgeConfig, parse_host_port
from ..transport import serve_iop, server_context
from .api import create_app
from .iop import NodeAcceptor
from .openai_asgi import OpenAIFastPath
from .state import EdgeState

log = logging.getLogger("iop_trio.edge")

FLUSH_AFTER_LAST_RUN = 0.5


def hypercorn_config(config: EdgeConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [config.http.listen]
    hc.graceful_timeout = config.http.graceful_timeout
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.keep_alive_timeout = 75
    return hc


async def run_edge(
    config: EdgeConfig,
    shutdown: Callable[[], Awaitable[None]],
    state: EdgeState | None = None,
    task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown`` returns; reports ``{"http": url, "iop": host:port}`` once bound."""
    owned = state is None
    state = state or EdgeState.from_config(config)
    host, port = parse_host_port(config.iop.listen, "iop.listen")
    ssl_context = server_context(config.tls) if config.tls.enabled else None
    http_stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(state.history.run)
            iop_address = await nursery.start(
                lambda task_status: serve_iop(
                    host,
                    port,
                    NodeAcceptor(state),
                    ssl_context=ssl_context,
                    handshake_timeout=config.iop.handshake_timeout,
                    task_status=task_status,
                )
            )
            http_done = trio.Event()
            http_scope = trio.CancelScope()

            async def serve_http(task_status: trio.TaskStatus[list[str]]) -> None:
                with http_scope:
                    try:
                        await hypercorn_serve(
                            OpenAIFastPath(state, create_app(state)), hypercorn_config(config),
                            shutdown_trigger=http_stop.wait, task_status=task_status,
                        )
                    except OSError as exc:
                        raise OSError(exc.errno, f"http.listen {config.http.listen}: {exc.strerror}") from exc
                http_done.set()

            binds = await nursery.start(serve_http)
            task_status.started({"http": binds[0], "iop": iop_address})
            await shutdown()
            log.info(
                "edge draining",
                extra={"runs_in_flight": state.runs_in_flight, "grace_s": config.http.graceful_timeout},
            )
            http_stop.set()
            with trio.move_on_after(config.http.graceful_timeout):
                await state.wait_no_runs()
            # Hypercorn would hold idle keep-alive connections open for the whole grace period:
            # once no run is left, give responses a moment to flush, then close the rest.
            with trio.move_on_after(FLUSH_AFTER_LAST_RUN):
                await http_done.wait()
            http_scope.cancel()
            # Hang up on the nodes properly (TLS close_notify), not by cancelling mid-stream.
            with trio.move_on_after(FLUSH_AFTER_LAST_RUN):
                async with trio.open_nursery() as closing:
                    for session in state.registry.sessions():
                        closing.start_soon(session.conn.flush_and_close)
            state.history.close()  # the writer flushes what is queued, then returns
            nursery.cancel_scope.cancel()
    finally:
        if owned:
            state.close()
