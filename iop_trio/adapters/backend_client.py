"""A small HTTP/1.1 client for the adapters' calls to their backend: :mod:`.http11` over trio
streams, with keep-alive connections reused last-in first-out.

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

import trio

from ..transport.errors import broken_reason
from .http11 import ProtocolError, ResponseReader, encode_request

RECEIVE_CHUNK = 64 * 1024
USER_AGENT = b"iop-trio"


class BackendUnreachable(Exception):
    """No connection to the backend could be made (refused, unresolvable, connect timeout)."""


class BackendConnectionError(Exception):
    """The connection broke, or the backend broke HTTP/1.1."""


class _Connection:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.reader = ResponseReader()

    async def receive(self) -> None:
        """Feed the reader what the connection delivers next."""
        try:
            data = await self.stream.receive_some(RECEIVE_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise BackendConnectionError(broken_reason(exc)) from exc
        self.reader.feed(data)

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class BackendResponse:
    """A response whose body is being received; read it with :meth:`receive_some`."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._reader = conn.reader
        self.status = conn.reader.status

    @property
    def complete(self) -> bool:
        return self._reader.complete

    async def receive_some(self) -> bytes:
        """The body bytes that arrived together (one network read, any number of chunks), or
        ``b""`` once the body has ended."""
        reader = self._reader
        while True:
            try:
                data = reader.read_body()
            except ProtocolError as exc:
                raise BackendConnectionError(f"backend broke HTTP/1.1: {exc}") from exc
            if data or reader.complete:
                return data
            await self._conn.receive()

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
        self._json_headers = [*self._headers, (b"Content-Type", b"application/json")]
        self._slots = trio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
        self.closed = False

    @asynccontextmanager
    async def request(self, method: str, path: str, body: bytes | None = None) -> AsyncIterator[BackendResponse]:
        """Send a request and yield its response once the status line and headers are in.

        Leaving before the body's end closes the connection (the backend sees its client go)."""
        if self.closed:
            raise RuntimeError("the backend client is closed")
        headers = self._headers if body is None else self._json_headers
        request = encode_request(method, (self._prefix + path).encode(), headers, body)
        async with self._slots:
            conn, response = await self._exchange(request)
            try:
                yield response
            finally:
                if response.complete and conn.reader.keep_alive and not self.closed:
                    conn.reader = ResponseReader()
                    self._idle.append(conn)
                else:
                    with trio.CancelScope(shield=True):
                        await conn.aclose()

    async def _exchange(self, request: bytes) -> tuple[_Connection, BackendResponse]:
        """Send on a pooled connection (or a new one) and read the response head."""
        while self._idle:
            conn = self._idle.pop()
            try:
                return conn, await self._send(conn, request)
            except _StaleConnection:
                pass  # closed by the backend while idle: it never saw this request
        conn = await self._connect()
        try:
            return conn, await self._send(conn, request)
        except _StaleConnection as exc:
            raise BackendConnectionError(str(exc)) from exc

    async def _send(self, conn: _Connection, request: bytes) -> BackendResponse:
        """Write the request, read the response head; on any failure the connection is closed."""
        try:
            await conn.stream.send_all(request)
            while not conn.reader.read_head():
                await conn.receive()
        except ProtocolError as exc:
            failure = BackendConnectionError(f"backend broke HTTP/1.1: {exc}")
        except BackendConnectionError as exc:
            failure = exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            failure = BackendConnectionError(broken_reason(exc))
        except BaseException:
            with trio.CancelScope(shield=True):
                await conn.aclose()
            raise
        else:
            return BackendResponse(conn)
        await conn.aclose()
        if not conn.reader.received:
            raise _StaleConnection(str(failure)) from failure
        raise failure

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

