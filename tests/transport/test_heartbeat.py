"""heartbeat.py on virtual time: who is declared dead, exactly when, and how often we ping.

All of these use ``autojump_clock`` with memory streams (never real sockets): virtual time only
advances when every task is blocked, so the instants asserted below are exact.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from iop_trio.transport import FramedConnection, HeartbeatTimeout, keep_alive, serve_peer
from iop_trio.transport.heartbeat import MISSED_INTERVALS, send_heartbeats, watch_silence
from iop_trio.wire import Heartbeat, Message, RunEvent

EPSILON = 1e-6


class Ignore:
    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        pass


async def drain(conn: FramedConnection, log: list[tuple[float, Message]]) -> None:
    """Read forever, recording (virtual time, message)."""
    while True:
        message = await conn.receive()
        log.append((trio.current_time(), message))


def test_three_missed_intervals() -> None:
    assert MISSED_INTERVALS == 3


async def test_silent_peer_declared_dead_after_exactly_three_intervals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, _right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left, peer="node-1")
    start = trio.current_time()
    with pytest.raises(HeartbeatTimeout, match="node-1") as info:
        await watch_silence(conn, 30)
    elapsed = trio.current_time() - start
    assert 90 <= elapsed < 90 + EPSILON
    assert "90s" in str(info.value)


async def test_a_frame_postpones_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    peer = FramedConnection(right)
    received: list[tuple[float, Message]] = []
    died_at: list[float] = []

    async def watch() -> None:
        with pytest.raises(HeartbeatTimeout):
            await watch_silence(conn, 30)
        died_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        nursery.start_soon(drain, conn, received)
        await trio.sleep(50)
        await peer.send_now(RunEvent(run_id="r", kind="delta", text="any frame counts"))
        await trio.sleep(139.9 - 50)
        assert died_at == []  # 89.9 s after the last frame: still alive
        await trio.sleep(1)
        assert died_at == [pytest.approx(140)]
        nursery.cancel_scope.cancel()
    assert [t for t, _ in received] == [50]


async def test_peer_sending_every_20s_stays_alive_past_200s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    server = FramedConnection(server_raw, peer="client")
    client = FramedConnection(client_raw)
    from_server: list[tuple[float, Message]] = []
    server_died_at: list[float] = []

    async def serve() -> None:
        with pytest.RaisesGroup(HeartbeatTimeout, flatten_subgroups=True):
            await serve_peer(server, Ignore(), heartbeat_interval=30)
        server_died_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        nursery.start_soon(drain, client, from_server)
        for seq in range(1, 12):  # t = 20, 40, ... 220
            await trio.sleep(20)
            await client.send_now(Heartbeat(seq=seq))
        assert server_died_at == []
        # Now the client goes quiet (but keeps the connection open and keeps reading).
        await trio.sleep(89)
        assert server_died_at == []
        await trio.sleep(2)
        assert server_died_at == [pytest.approx(220 + 90)]
        nursery.cancel_scope.cancel()

    # Meanwhile the server pinged every 30 s, from t=30 until it gave up at t=310.
    assert [t for t, _ in from_server] == [pytest.approx(30 * k) for k in range(1, 11)]


async def test_keep_alive_times_out_a_silent_peer_even_though_it_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Our own heartbeats going out are no sign of life from the peer.
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    peer = FramedConnection(right)
    seen_by_peer: list[tuple[float, Message]] = []
    start = trio.current_time()
    with pytest.RaisesGroup(HeartbeatTimeout, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            nursery.start_soon(drain, peer, seen_by_peer)
            await keep_alive(conn, 10)
    assert trio.current_time() - start == pytest.approx(30)
    # Pings at 10 and 20 s went out; the one due at 30 s races the verdict at 30 s.
    pings = [m for _, m in seen_by_peer]
    assert pings[:2] == [Heartbeat(seq=1), Heartbeat(seq=2)]
    assert len(pings) in (2, 3)


async def test_send_heartbeats_every_interval(autojump_clock: trio.testing.MockClock) -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    peer = FramedConnection(right)
    received: list[tuple[float, Message]] = []
    async with trio.open_nursery() as nursery:
        conn.start_writer(nursery)
        nursery.start_soon(drain, peer, received)
        nursery.start_soon(send_heartbeats, conn, 10)
        await trio.sleep(105)
        nursery.cancel_scope.cancel()
    assert [t for t, _ in received] == [pytest.approx(10 * k) for k in range(1, 11)]
    assert [m for _, m in received] == [Heartbeat(seq=k) for k in range(1, 11)]


@pytest.mark.parametrize("interval", [0.5, 5, 45])
async def test_heartbeat_count_scales_with_interval(
    autojump_clock: trio.testing.MockClock, interval: float
) -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    peer = FramedConnection(right)
    received: list[tuple[float, Message]] = []
    span = 1000.0
    async with trio.open_nursery() as nursery:
        conn.start_writer(nursery)
        nursery.start_soon(drain, peer, received)
        nursery.start_soon(partial(send_heartbeats, conn, interval))
        await trio.sleep(span + interval / 2)
        nursery.cancel_scope.cancel()
    assert len(received) == int(span // interval)


async def test_serve_peer_drops_a_peer_silent_from_the_start(
    autojump_clock: trio.testing.MockClock,
) -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    server = FramedConnection(server_raw)
    client = FramedConnection(client_raw)
    pings: list[tuple[float, Message]] = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain, client, pings)
        with pytest.RaisesGroup(HeartbeatTimeout, flatten_subgroups=True):
            await serve_peer(server, Ignore(), heartbeat_interval=30)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    assert 90 <= elapsed < 90 + EPSILON
    assert [m for _, m in pings][:2] == [Heartbeat(seq=1), Heartbeat(seq=2)]
