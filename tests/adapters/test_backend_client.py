"""BackendClient, the adapters' HTTP/1.1 client, against a loopback server written with h11 so
each test controls exactly what the backend does on the wire: keep-alive reuse, a connection the
backend closed while idle, a response left early, the connection limit, bodies read in the
pieces the network delivered."""

from __future__ import annotations

import ssl
from functools import partial

import h11
import pytest
import trio
import trustme

from iop_trio.adapters.backend_client import BackendClient, BackendUnreachable

LIMIT = 5.0


class Backend:
    """Answers every request with ``chunks`` (chunked encoding), written in one ``send_all``;
    with ``hold`` set it waits for it after the first chunk; with ``expect_hang_up`` it waits
    for the client to close the connection after the first chunk."""

    def __init__(self) -> None:
        self.chunks = [b"alpha ", b"bravo ", b"charlie"]
        self.hold: trio.Event | None = None
        self.expect_hang_up = False
        self.close_after_each_response = False  # like a keep-alive timeout, without saying so
        self.connections = 0
        self.requests = 0
        self.open = 0
        self.most_open = 0
        self.hung_up_on = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        conn = h11.Connection(h11.SERVER)
        try:
            while await self._serve_one(conn, stream):
                conn.start_next_cycle()
        finally:
            self.open -= 1
            await stream.aclose()

    async def _serve_one(self, conn: h11.Connection, stream: trio.SocketStream) -> bool:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive_some(65536))
                except trio.BrokenResourceError:
                    conn.receive_data(b"")
                continue
            if isinstance(event, h11.ConnectionClosed):
                return False
            if isinstance(event, h11.EndOfMessage):
                break
        self.requests += 1
        data = conn.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
        chunks = list(self.chunks)
        if self.hold is not None or self.expect_hang_up:
            await stream.send_all(data + conn.send(h11.Data(data=chunks.pop(0))))
            data = b""
            if self.expect_hang_up:
                if await stream.receive_some(1) == b"":
                    self.hung_up_on.set()
                return False
            assert self.hold is not None
            await self.hold.wait()
        data += b"".join(conn.send(h11.Data(data=chunk)) for chunk in chunks)
        await stream.send_all(data + conn.send(h11.EndOfMessage()))
        return not self.close_after_each_response


async def start(nursery: trio.Nursery, backend: Backend, **client: object) -> BackendClient:
    listeners = await nursery.start(partial(trio.serve_tcp, backend.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    options = {"headers": {}, "max_connections": 8, "connect_timeout": 2.0, **client}
    return BackendClient(f"http://127.0.0.1:{port}/v1", **options)  # type: ignore[arg-type]


async def fetch(client: BackendClient) -> bytes:
    async with client.request("POST", "/chat/completions", b"{}") as response:
        assert response.status == 200
        return await response.read(1 << 20)


async def test_requests_one_after_another_share_one_connection(nursery) -> None:
    backend = Backend()
    client = await start(nursery, backend)
    with trio.fail_after(LIMIT):
        for _ in range(3):
            assert await fetch(client) == b"alpha bravo charlie"
    assert (backend.connections, backend.requests) == (1, 3)
    await client.aclose()


async def test_chunks_that_arrive_together_are_read_together(nursery) -> None:
    client = await start(nursery, Backend())
    with trio.fail_after(LIMIT):
        async with client.request("POST", "/chat/completions", b"{}") as response:
            assert await response.receive_some() == b"alpha bravo charlie"
            assert await response.receive_some() == b""
            assert response.complete
    await client.aclose()


async def test_a_response_left_early_hangs_up_and_is_not_reused(nursery) -> None:
    backend = Backend()
    backend.expect_hang_up = True
    client = await start(nursery, backend)
    with trio.fail_after(LIMIT):
        async with client.request("POST", "/chat/completions", b"{}") as response:
            assert await response.receive_some() == b"alpha "
        await backend.hung_up_on.wait()  # the backend saw its client go: that stops generation
        backend.expect_hang_up = False
        assert await fetch(client) == b"alpha bravo charlie"
    assert backend.connections == 2
    await client.aclose()


async def test_a_connection_the_backend_closed_while_idle_is_replaced(nursery) -> None:
    backend = Backend()
    backend.close_after_each_response = True
    client = await start(nursery, backend)
    with trio.fail_after(LIMIT):
        assert await fetch(client) == b"alpha bravo charlie"
        await trio.testing.wait_all_tasks_blocked()  # the backend has closed its end
        assert await fetch(client) == b"alpha bravo charlie"
    assert (backend.connections, backend.requests) == (2, 2)  # retried on a new one, sent once
    await client.aclose()


async def test_no_more_than_max_connections_are_open(nursery) -> None:
    backend = Backend()
    backend.hold = trio.Event()
    client = await start(nursery, backend, max_connections=2)
    with trio.fail_after(LIMIT):
        async with trio.open_nursery() as requests:
            for _ in range(5):
                requests.start_soon(fetch, client)
            await trio.testing.wait_all_tasks_blocked()
            assert backend.open == 2
            backend.hold.set()
    assert backend.most_open == 2
    await client.aclose()


async def test_nothing_listening_is_unreachable() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = BackendClient(f"http://127.0.0.1:{port}", headers={}, max_connections=1, connect_timeout=2.0)
    with trio.fail_after(LIMIT), pytest.raises(BackendUnreachable):
        await fetch(client)


async def test_a_closed_client_refuses_requests() -> None:
    client = BackendClient("http://127.0.0.1:9", headers={}, max_connections=1, connect_timeout=2.0)
    await client.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await fetch(client)


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="http"):
        BackendClient("ftp://example", headers={}, max_connections=1, connect_timeout=1.0)


async def test_an_https_backend_is_reached_over_tls(nursery) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    backend = Backend()

    async def handle_tls(stream: trio.SocketStream) -> None:
        await backend.handle(trio.SSLStream(stream, server_context, server_side=True))  # type: ignore[arg-type]

    listeners = await nursery.start(partial(trio.serve_tcp, handle_tls, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    client = BackendClient(f"https://localhost:{port}/v1", headers={}, max_connections=2, connect_timeout=2.0)
    ca.configure_trust(client._tls)  # the system's CAs would not know this test CA
    with trio.fail_after(LIMIT):
        assert await fetch(client) == b"alpha bravo charlie"
        assert await fetch(client) == b"alpha bravo charlie"
    assert backend.connections == 1  # kept alive over TLS too
    await client.aclose()
