"""An in-process node core wired to a scripted "edge" over memory streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from iop_trio.config import ModelConfig, NodeSettings
from iop_trio.node.core import NodeCore
from iop_trio.node.router import Router
from iop_trio.store import RunStore
from iop_trio.transport import ConnectionClosed, FramedConnection, serve_peer
from iop_trio.wire import Message, RunEvent

# Heartbeats are tested in tests/transport; here they must never fire.
NO_HEARTBEAT = 1e9


class EdgeDouble:
    """The edge end of the connection: sends requests, reads what the node sends back."""

    def __init__(self, conn: FramedConnection) -> None:
        self.conn = conn

    async def send(self, message: Message) -> None:
        await self.conn.send(message)

    async def receive(self) -> Message:
        return await self.conn.receive()

    async def events_until_end(self, run_id: str) -> list[RunEvent]:
        events: list[RunEvent] = []
        while True:
            message = await self.receive()
            if isinstance(message, RunEvent) and message.run_id == run_id:
                events.append(message)
                if message.is_terminal:
                    return events


class NodeHarness:
    def __init__(self, core: NodeCore, edge: EdgeDouble, store: RunStore) -> None:
        self.core = core
        self.edge = edge
        self.store = store
        self.connection_ended = trio.Event()

    def row(self, run_id: str) -> dict[str, Any]:
        rows = [r for r in self.store.list_runs(limit=1000) if r["run_id"] == run_id]
        assert len(rows) == 1, rows
        return rows[0]


def make_router(**options: Any) -> Router:
    settings = NodeSettings(models=(ModelConfig(name="m", adapter="mock", options=options),))
    return Router.from_settings(settings, "test")


@pytest.fixture
def store(tmp_path: Any) -> Any:
    run_store = RunStore(tmp_path / "runs.db", in_thread=False)
    yield run_store
    run_store.close()


async def start_harness(
    nursery: trio.Nursery, store: RunStore, max_concurrency: int = 8, **options: Any
) -> NodeHarness:
    core = NodeCore("node-t", make_router(**options), store, max_concurrency)
    node_stream, edge_stream = trio.testing.memory_stream_pair()
    node_conn = FramedConnection(node_stream, peer="edge")
    edge_conn = FramedConnection(edge_stream, peer="node")
    harness = NodeHarness(core, EdgeDouble(edge_conn), store)

    async def serve_node() -> None:
        try:
            await serve_peer(node_conn, core.handler(node_conn), heartbeat_interval=NO_HEARTBEAT)
        except* ConnectionClosed:
            pass
        finally:
            harness.connection_ended.set()

    nursery.start_soon(serve_node)
    edge_conn.start_writer(nursery)
    return harness


@pytest.fixture
def start_node():
    """``await start_node(nursery, store, max_concurrency=8, **mock_options) -> NodeHarness``."""
    return start_harness


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()
