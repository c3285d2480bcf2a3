"""Many simulated nodes in one process: each dials the edge over mTLS, registers, heartbeats,
and answers runs at once (start, one delta, complete).

Why simulate: a thousand real ``iop-trio node`` processes would need ~50 GB and measure the
machine, not the edge. These speak the real protocol through the product's own
``iop_trio.wire`` and ``iop_trio.transport`` (framing, codec, TLS contexts, ``serve_peer`` with
its heartbeats), so the edge sees exactly what real nodes send.

Prints ``ready: nodes=N register_s=S`` once every node is registered, then serves until SIGTERM;
on exit prints ``served: <json>`` (runs per node) on stdout.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter

import trio

from iop_trio.transport import (
    ConnectionClosed,
    FramedConnection,
    TlsConfig,
    client_context,
    dial,
    serve_peer,
)
from iop_trio.wire import (
    CancelRequest,
    Heartbeat,
    Message,
    RegisterRequest,
    RegisterResponse,
    RunEvent,
    RunRequest,
    Usage,
)

SERVED: Counter[str] = Counter()


class SimHandler:
    def __init__(self, node_id: str, conn: FramedConnection) -> None:
        self.node_id = node_id
        self.conn = conn

    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        if isinstance(message, RunRequest):
            SERVED[self.node_id] += 1
            run_id = message.run_id
            await self.conn.send(RunEvent(run_id=run_id, kind="start"))
            await self.conn.send(RunEvent(run_id=run_id, kind="delta", text="tok", tokens=1))
            await self.conn.send(RunEvent(run_id=run_id, kind="complete", finish_reason="stop", usage=Usage(1, 1)))
        elif isinstance(message, (CancelRequest, Heartbeat)):
            pass


async def one_node(args: argparse.Namespace, index: int, ssl_context: object, gate: trio.Semaphore, registered: list[int], all_done: trio.Event) -> None:
    node_id = f"sim-{index:05d}"
    host, _, port = args.edge.rpartition(":")
    async with gate:
        stream = await dial(host, int(port), ssl_context=ssl_context, server_hostname="localhost", handshake_timeout=60)  # type: ignore[arg-type]
        conn = FramedConnection(stream, peer=args.edge)
        request = RegisterRequest(
            token=args.token, node_id=node_id, version="bench", adapters=("sim",), models=tuple(args.model), capacity=args.capacity,
        )
        await conn.send_now(request)
        with trio.fail_after(60):
            response = await conn.receive()
    if not isinstance(response, RegisterResponse) or not response.accepted:
        raise SystemExit(f"{node_id}: registration refused: {response}")
    registered[0] += 1
    if registered[0] == args.count:
        all_done.set()
    interval = response.config.heartbeat_interval if response.config else 30.0
    try:
        await serve_peer(conn, SimHandler(node_id, conn), heartbeat_interval=interval)
    except* ConnectionClosed:
        pass
    finally:
        await conn.flush_and_close()


async def main_async(args: argparse.Namespace) -> None:
    tls = TlsConfig(True, args.cert, args.key, args.ca)
    ssl_context = client_context(tls)
    gate = trio.Semaphore(args.parallel)
    registered = [0]
    all_done = trio.Event()
    started = time.monotonic()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            for index in range(args.count):
                nursery.start_soon(one_node, args, index, ssl_context, gate, registered, all_done)
            await all_done.wait()
            print(f"ready: nodes={args.count} register_s={time.monotonic() - started:.3f}", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break
    print("served: " + json.dumps(dict(SERVED)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge", required=True, help="the edge's IOP address HOST:PORT")
    parser.add_argument("--token", required=True, help="a registration token not bound to a node id")
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--capacity", type=int, default=16)
    parser.add_argument("--model", action="append", default=[], help="models every node serves (repeatable)")
    parser.add_argument("--parallel", type=int, default=32, help="registrations in flight at once")
    args = parser.parse_args()
    args.model = args.model or ["bench"]
    trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
