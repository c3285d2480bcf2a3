"""The worker role: its store, its HTTP client to the edge, and the :class:`Worker`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..config import ConfigError, WorkerConfig
from ..store.batches import BatchStore
from .edge_client import EdgeClient, edge_http_client
from .worker import Worker


async def run_worker(
    config: WorkerConfig,
    shutdown: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[dict[str, str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Work until ``shutdown`` returns, then drain; reports ``{"worker": id, "edge": url}``."""
    if not await (trio.Path(config.data_dir) / "edge.db").is_file():
        # Opening it would create an empty store that no edge ever writes to: a silent no-op.
        raise ConfigError(f"data_dir: no edge database in {config.data_dir} (use the edge's data_dir; start the edge first)")
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
