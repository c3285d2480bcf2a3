"""``POST /v1/chat/completions`` and ``POST /v1/completions`` as raw ASGI, in front of the Quart app.

Why: profiling put Quart (request and app contexts, before/after hooks, Werkzeug routing,
Response objects) at about 35% of the edge's CPU per request, and these two routes carry nearly
all of the traffic. Every other request, and the lifespan events, go to the Quart app unchanged.
On these two routes a client sees what the Quart app answered: the same checks in the same order
(API key, method, body size, JSON, priority, then the key's policy), the same bodies and headers,
the same metrics labels.

Cancellation: hypercorn does not cancel an ASGI app whose client went away; it reports
``http.disconnect`` on ``receive``. Once the body is read, a watcher task waits for that and
cancels the request's scope, so the ``finally`` in :func:`~.completions.serve` closes the run and
``cancel.request`` reaches the node. A ``send`` that fails because the connection is gone ends
the request the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import trio
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
    HTTPScope,
    Scope,
)

from ..metrics import EdgeMetrics
from .api import api_key_limits, request_priority
from .completions import serve
from .errors import ApiError, body_too_large, method_not_allowed
from .openai_format import json_bytes
from .openai_requests import ParsedRequest, parse_chat, parse_completion, parse_json_object
from .state import EdgeState

Headers = Iterable[tuple[bytes, bytes]]

ROUTES: dict[str, Callable[[dict[str, Any]], ParsedRequest]] = {
    "/v1/chat/completions": parse_chat,
    "/v1/completions": parse_completion,
}
#: How long a request body may take to arrive (Quart's BODY_TIMEOUT, which these routes had).
BODY_TIMEOUT = 60.0
JSON_TYPE = (b"content-type", b"application/json")
SSE_HEADERS: Headers = (
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream"),
)
#: OPTIONS as Quart answered it for a route (and counted it under the route).
OPTIONS_HEADERS: Headers = (
    (b"allow", b"POST, OPTIONS"),
    (b"content-type", b"text/html; charset=utf-8"),
    (b"content-length", b"0"),
)


class OpenAIFastPath:
    """The ASGI app hypercorn serves: the two hot routes here, everything else to ``app``."""

    def __init__(self, state: EdgeState, app: ASGIFramework) -> None:
        self.state = state
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http" or (parse := ROUTES.get(scope["path"])) is None:
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        # Quart labelled a request by the route it matched: POST, and the OPTIONS it answered.
        route = scope["path"] if method in ("POST", "OPTIONS") else "unmatched"
        async with trio.open_nursery() as nursery:
            exchange = Exchange(self.state.metrics, route, send, nursery.cancel_scope)
            try:
                await self._handle(exchange, scope, receive, parse, nursery)
            except ApiError as error:
                await exchange.json(error.body(), error.status, encode_headers(error.headers))
            finally:
                if exchange.streaming:  # however the stream ended
                    exchange.observe()
            nursery.cancel_scope.cancel()  # the disconnect watcher

    async def _handle(
        self,
        exchange: Exchange,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        parse: Callable[[dict[str, Any]], ParsedRequest],
        nursery: trio.Nursery,
    ) -> None:
        headers = HeaderView(scope["headers"])
        limits = api_key_limits(self.state, headers)
        if scope["method"] != "POST":
            if scope["method"] != "OPTIONS":
                raise method_not_allowed(scope["method"], scope["path"])
            await exchange.respond(200, OPTIONS_HEADERS)
            return
        body = await read_body(receive, headers, self.state.config.http.max_body_size)
        if body is None:
            return  # the client left while sending it
        parsed = parse(parse_json_object(body))
        priority = request_priority(headers, limits)
        nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope)
        await serve(self.state, parsed, priority, limits, exchange)
        if exchange.streaming:
            await exchange.write(b"", more=False)


class Exchange:
    """One request's response (the :class:`~.completions.Reply` ``serve`` writes to) and its
    metrics: counted when the response starts, timed then or, for a stream, when it ends."""

    __slots__ = ("_send", "gone", "metrics", "route", "started", "streaming")

    def __init__(self, metrics: EdgeMetrics, route: str, send: ASGISendCallable, gone: trio.CancelScope) -> None:
        self.metrics = metrics
        self.route = route
        self._send = send
        self.gone = gone
        self.started = time.perf_counter()
        self.streaming = False

    async def json(self, body: dict[str, Any], status: int = 200, headers: Headers = ()) -> None:
        data = json_bytes(body)
        await self.respond(status, (JSON_TYPE, (b"content-length", b"%d" % len(data)), *headers), data)

    async def respond(self, status: int, headers: Headers, body: bytes = b"") -> None:
        self.observe()
        await self.start(status, headers)
        await self.write(body, more=False)

    async def open_stream(self) -> None:
        self.streaming = True
        await self.start(200, SSE_HEADERS)

    async def start(self, status: int, headers: Headers) -> None:
        self.metrics.count_request(self.route, status)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def write(self, chunk: bytes, more: bool = True) -> None:
        await self.send({"type": "http.response.body", "body": chunk, "more_body": more})

    async def send(self, message: ASGISendEvent) -> None:
        try:
            await self._send(message)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            # The ASGI spec has a server raise OSError on a send to a closed connection (hypercorn
            # reports http.disconnect instead): the client is gone, so end the request as if
            # that had arrived. BusyResourceError: hypercorn closing the connection (at its
            # keep_alive_max_requests) from another task while this send is in flight; seen when
            # a client sends its next request the moment the last response arrives.
            self.gone.cancel()
            await trio.lowlevel.checkpoint()

    def observe(self) -> None:
        self.metrics.observe_request(self.route, time.perf_counter() - self.started)


class HeaderView:
    """Case-insensitive ``get`` over ASGI's header pairs (names arrive lowercased): all that the
    key and priority helpers ask of a request's headers."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: Headers) -> None:
        self.pairs = pairs

    def get(self, name: str, default: str | None = None) -> str | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self.pairs:
            if key == wanted:
                return value.decode("latin-1")
        return default


async def read_body(receive: ASGIReceiveCallable, headers: HeaderView, limit: int) -> bytes | None:
    """The whole body, or None if the client left first. Past ``limit`` (announced up front, or
    counted while reading) a 413; slower than BODY_TIMEOUT a 408."""
    length = headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(BODY_TIMEOUT):
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # http.disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
    raise ApiError(408, f"The request body did not arrive within {BODY_TIMEOUT:g} seconds.")


async def cancel_on_disconnect(receive: ASGIReceiveCallable, scope: trio.CancelScope) -> None:
    """Run once the body is read: all that ``receive`` has left to say is the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def encode_headers(headers: dict[str, str]) -> Headers:
    return [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
