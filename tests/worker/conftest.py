"""The worker against an in-memory edge, on a store that runs on the event loop (MockClock)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from iop_trio.config import WorkerConfig
from iop_trio.store.batches import Batch, BatchStore
from iop_trio.worker import Worker
from iop_trio.worker.edge_client import EdgeUnavailable
from iop_trio.worker.results import LineResponse

CHAT = "/v1/chat/completions"
TTL = 9.0
CONFIG = WorkerConfig(concurrency=3, poll_interval=0.5, lease_ttl=TTL, shutdown_grace=5.0)


class FakeEdge:
    """Answers a line after ``delay`` virtual seconds (``slow[prompt]`` for some) with a body that
    echoes its prompt; prompts starting with ``bad`` get a 400. Records what ran and what was
    cancelled."""

    def __init__(self, delay: float = 1.0) -> None:
        self.delay = delay
        self.slow: dict[str, float] = {}
        self.available = True
        self.started: list[str] = []
        self.finished: list[str] = []
        self.cancelled: list[str] = []
        self.started_at: dict[str, float] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        #: Set (and replaced) whenever a line starts, finishes or is cancelled.
        self.changed = trio.Event()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        with trio.fail_after(10_000):
            while not predicate():
                await self.changed.wait()

    async def models(self) -> frozenset[str]:
        await trio.lowlevel.checkpoint()
        if not self.available:
            raise EdgeUnavailable("edge down")
        return frozenset({"m"})

    async def execute(self, endpoint: str, body: dict[str, Any]) -> LineResponse:
        prompt = body["messages"][0]["content"]
        self.started.append(prompt)
        self.started_at[prompt] = trio.current_time()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._notify()
        try:
            await trio.sleep(self.slow.get(prompt, self.delay))
        except trio.Cancelled:
            self.cancelled.append(prompt)
            raise
        finally:
            self.in_flight -= 1
            self._notify()
        self.finished.append(prompt)
        status = 400 if prompt.startswith("bad") else 200
        return LineResponse(status, f"req-{prompt}", {"echo": prompt, "endpoint": endpoint})


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BatchStore]:
    batches = BatchStore.for_data_dir(tmp_path / "edge", in_thread=False)
    try:
        yield batches
    finally:
        batches.close()


def body(prompt: str, model: str = "m") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": prompt}]}


def request_line(prompt: str, model: str = "m") -> str:
    return json.dumps({"custom_id": f"id-{prompt}", "method": "POST", "url": CHAT, "body": body(prompt, model)})


async def submit(store: BatchStore, prompts: list[str], *, window: float = 86400.0, content: str | None = None) -> str:
    text = content if content is not None else "\n".join(request_line(p) for p in prompts) + "\n"
    record = await store.save_upload(io.BytesIO(text.encode()), "in.jsonl", "batch", trio.current_time())
    batch = await store.create_batch(
        input_file_id=record.id, endpoint=CHAT, completion_window="24h", window_seconds=window,
        metadata=None, now=trio.current_time(),
    )
    return batch.id


async def start_worker(
    nursery: trio.Nursery, store: BatchStore, edge: FakeEdge, config: WorkerConfig = CONFIG, owner: str | None = None
) -> trio.Event:
    """Start a worker; setting the returned event shuts it down."""
    stop = trio.Event()
    worker = Worker(store, edge, config, clock=trio.current_time, owner=owner)
    await nursery.start(worker.run, stop.wait)
    return stop


async def wait_status(store: BatchStore, batch_id: str, *statuses: str) -> Batch:
    with trio.fail_after(10_000):
        while True:
            batch = await store.get_batch(batch_id)
            assert batch is not None
            if batch.status in statuses:
                return batch
            await trio.sleep(0.05)


async def read_jsonl(store: BatchStore, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await store.read_file(file_id)
    assert content is not None
    return [json.loads(line) for line in content.decode().splitlines()]
