"""A small HTTP/1.1 client for the adapters' calls to their backend: h11 over trio streams, with
keep-alive connections reused last-in first-out.

Why not httpx here (it stays the client of the worker, the CLI and the tests): on the node's hot
path httpx + httpcore were a third of the node's CPU per run, their pool scans every pooled
connection on each request, and closing a stream early (as the adapters did at ``[DONE]``) threw
the connection away, so every run paid a new TCP connection (bench/results/findings.md). A run
needs one POST, a streamed body and, on cancellation, a hung-up connection; that is what this does.

- A response's body is read in the pieces the network delivers (``receive_some``), so an adapter
  can forward what arrived together as one delta.
- A connection goes back to the pool only when its response was read to the end; a response
  left early (the run was cancelled, the body was bad) closes its connection, which is how the
  backend learns to stop generating.
- A pooled connection the backend closed while idle fails before any byte of a response; that
  request is retried once on a new connection (the backend never saw it).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import h11
import trio

from ..transport.errors import broken_reason

RECEIVE_CHUNK = 64 * 1024
USER_AGENT = b"iop-trio"


class BackendUnreachable(Exception):
    """No connection to the backend could be made (refused, unresolvable, connect timeout)."""


class BackendConnectionError(Exception):
    """The connection broke, or the backend broke HTTP/1.1."""


class _Connection:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.http = h11.Connection(h11.CLIENT)
        #: Bytes received so far: a request that failed before any came back was never answered.
        self.received = 0

    async def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        while True:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as exc:
                raise BackendConnectionError(f"backend broke HTTP/1.1: {exc}") from exc
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(RECEIVE_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise BackendConnectionError(broken_reason(exc)) from exc
            self.received += len(data)
            self.http.receive_data(bytes(data))

    def reusable(self) -> bool:
        return self.http.our_state is h11.DONE and self.http.their_state is h11.DONE

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class BackendResponse:
    """A response whose body is being received; read it with :meth:`receive_some`."""

    def __init__(self, conn: _Connection, status: int) -> None:
        self._conn = conn
        self.status = status
        self.complete = False

    async def receive_some(self) -> bytes:
        """The body bytes that arrived together (one network read, any number of chunks), or
        ``b""`` once the body has ended."""
        pieces: list[bytes] = []
        http = self._conn.http
        while not self.complete:
            try:
                event = http.next_event()
            except h11.RemoteProtocolError as exc:
                raise BackendConnectionError(f"backend broke HTTP/1.1: {exc}") from exc
            if event is h11.NEED_DATA:
                if pieces:
                    break
                event = await self._conn.next_event()
            if isinstance(event, h11.Data):
                pieces.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                self.complete = True
            elif isinstance(event, h11.ConnectionClosed):
                raise BackendConnectionError("backend closed the connection before the end of the body")
        return b"".join(pieces)

    async def read(self, limit: int) -> bytes:
        """The rest of the body, up to about ``limit`` bytes (error bodies, small JSON)."""
        pieces: list[bytes] = []
        size = 0
        while size < limit and (piece := await self.receive_some()):
            pieces.append(piece)
            size += len(piece)
        return b"".join(pieces)


class BackendClient:
    """Connections to one backend (``base_url``'s scheme, host and port), at most
    ``max_connections`` open at once; more requests wait for one to be free."""

    def __init__(
        self, base_url: str, *, headers: dict[str, str], max_connections: int, connect_timeout: float
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"backend URL must be http(s)://host[:port][/path], got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if url.scheme == "https" else None
        self._prefix = url.path.rstrip("/")
        self._connect_timeout = connect_timeout
        host_header = url.netloc.rpartition("@")[2]
        self._headers = [
            (b"Host", host_header.encode()),
            (b"User-Agent", USER_AGENT),
            (b"Accept", b"*/*"),
            *((name.encode(), value.encode()) for name, value in headers.items()),
        ]
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self.closed = False

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes | None = None) -> AsyncIterator[BackendResponse]:
        """Send a request and yield its response once the status line and headers are in.

        Leaving before the body's end closes the connection (the backend sees its client go)."""
        if self.closed:
            raise RuntimeError("the backend client is closed")
        headers = list(self._headers)
        if body is not None:
            headers += [(b"Content-Type", b"application/json"), (b"Content-Length", str(len(body)).encode())]
        request = h11.Request(method=method, target=(self._prefix + path).encode(), headers=headers)
        async with self._slots:
            conn, response = await self._exchange(request, body)
            try:
                yield response
            finally:
                if response.complete and conn.reusable() and not self.closed:
                    conn.http.start_next_cycle()
                    self._idle.append(conn)
                else:
                    with trio.CancelScope(shield=True):
                        await conn.aclose()

    async def _exchange(self, request: h11.Request, body: bytes | None) -> tuple[_Connection, BackendResponse]:
        """Send on a pooled connection (or a new one) and read the response head."""
        while self._idle:
            conn = self._idle.pop()
            try:
                return conn, await self._send(conn, request, body)
            except _StaleConnection:
                await conn.aclose()  # closed by the backend while idle: it never saw this request
        conn = await self._connect()
        try:
            return conn, await self._send(conn, request, body)
        except _StaleConnection as exc:
            await conn.aclose()
            raise BackendConnectionError(str(exc)) from exc
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise

    async def _send(self, conn: _Connection, request: h11.Request, body: bytes | None) -> BackendResponse:
        http = conn.http
        received_before = conn.received
        data = http.send(request) or b""
        if body is not None:
            data += http.send(h11.Data(data=body)) or b""
        data += http.send(h11.EndOfMessage()) or b""
        try:
            await conn.stream.send_all(data)
            event = await conn.next_event()
            while isinstance(event, h11.InformationalResponse):
                event = await conn.next_event()
        except BackendConnectionError as exc:
            if conn.received == received_before:  # not one byte of a response came back
                raise _StaleConnection(str(exc)) from exc
            raise
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise _StaleConnection(broken_reason(exc)) from exc
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise
        if isinstance(event, h11.ConnectionClosed):
            raise _StaleConnection("backend closed the connection without answering")
        assert isinstance(event, h11.Response)
        return BackendResponse(conn, event.status_code)

    async def _connect(self) -> _Connection:
        try:
            with trio.fail_after(self._connect_timeout):
                stream: trio.abc.Stream = await trio.open_tcp_stream(self._host, self._port)
                if self._tls is not None:
                    tls = trio.SSLStream(stream, self._tls, server_hostname=self._host, https_compatible=True)
                    await tls.do_handshake()
                    stream = tls
        except trio.TooSlowError as exc:
            raise BackendUnreachable(f"no connection within {self._connect_timeout:g}s") from exc
        except (OSError, trio.BrokenResourceError) as exc:
            raise BackendUnreachable(broken_reason(exc)) from exc
        return _Connection(stream)

    async def aclose(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


class _StaleConnection(Exception):
    """The connection failed before any byte of a response: safe to retry on a new one."""

