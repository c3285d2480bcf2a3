"""Heartbeats both ways: send one every interval, declare the peer dead after three silent ones.

Any received frame counts as a sign of life, so a busy connection needs no extra traffic to stay
up; the watchdog sleeps until the exact moment the peer would become overdue (MockClock-friendly).
"""

from __future__ import annotations

import trio

from ..wire import Heartbeat
from .errors import HeartbeatTimeout
from .framed import FramedConnection

MISSED_INTERVALS = 3


async def send_heartbeats(conn: FramedConnection, interval: float) -> None:
    seq = 0
    while True:
        await trio.sleep(interval)
        seq += 1
        await conn.send(Heartbeat(seq=seq))


async def watch_silence(conn: FramedConnection, interval: float) -> None:
    """Return never; raise HeartbeatTimeout once nothing arrived for three intervals."""
    limit = MISSED_INTERVALS * interval
    while True:
        deadline = conn.last_received + limit
        if trio.current_time() >= deadline:
            raise HeartbeatTimeout(
                f"{conn.peer} silent for {limit:g}s ({MISSED_INTERVALS} heartbeat intervals)"
            )
        await trio.sleep_until(deadline)


async def keep_alive(conn: FramedConnection, interval: float) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_heartbeats, conn, interval)
        await watch_silence(conn, interval)
