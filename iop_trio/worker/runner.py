"""The worker role: its store, its HTTP client to the edge, and the :class:`Worker`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..config import WorkerConfig
from ..store.batches import BatchStore
from .edge_client import EdgeClient, edge_http_client
from .worker import Worker


async def run_worker(
    config: WorkerConfig,
    shutdown: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Work until ``shutdown`` returns, then drain; reports ``{"worker": id, "edge": url}``."""
    store = BatchStore.for_data_dir(config.data_dir)
    try:
        async with edge_http_client(
            config.edge_url, config.api_key, concurrency=config.concurrency, request_timeout=config.request_timeout
        ) as http, trio.open_nursery() as nursery:
            edge = EdgeClient(
                http, priority=config.priority, retry_initial=config.retry_initial, retry_maximum=config.retry_maximum
            )
            owner = await nursery.start(Worker(store, edge, config).run, shutdown)
            task_status.started({"worker": owner, "edge": config.edge_url})
    finally:
        store.close()
