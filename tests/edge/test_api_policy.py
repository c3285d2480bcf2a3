"""The HTTP API's policy layer with a real node behind it: API keys, model allow-lists, rate
limits, priorities, the admin API, backpressure (queue full, queue timeout, a queued client
leaving) and per-node overrides of max_concurrency.

Each test holds one trio run: an httpx client, the edge (hypercorn + quart-trio) and a node with
the mock adapter, over loopback with mutual TLS on the IOP side.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from attrs import define

from iop_trio.certs import init_certs
from iop_trio.config import (
    ApiKeyConfig,
    EdgeConfig,
    HttpConfig,
    IopListenConfig,
    ModelConfig,
    NodeDefaults,
    NodeOverride,
    NodeSettings,
    QueueConfig,
)
from iop_trio.controlplane import KeyLimits
from iop_trio.edge.api import request_priority
from iop_trio.edge.errors import ApiError
from iop_trio.edge.iop import NodeAcceptor
from iop_trio.edge.server import run_edge
from iop_trio.edge.state import EdgeState
from iop_trio.node.runner import NodeRunner, build_node
from iop_trio.wire import RegisterRequest
from tests.adapters.test_cancellation_chain import poll, tls

TEST_LIMIT = 30  # every test: the whole trio run, stack start included
NODE_ID = "node-1"
KEYS = (
    ApiKeyConfig(key="sk-a", models=("m",), requests_per_minute=2, priority=5),
    ApiKeyConfig(key="sk-b", name="batch"),
)
A = {"Authorization": "Bearer sk-a"}
B = {"Authorization": "Bearer sk-b"}
ADMIN = {"Authorization": "Bearer adm"}
FAST = {"tokens": 3}
#: A model that runs until the client leaves or ``max_tokens`` stops it (20 ms a token).
SLOW = {"tokens": 100_000, "token_delay": 0.02}


def chat(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], **extra}


@define
class Stack:
    url: str
    state: EdgeState
    runner: NodeRunner | None

    @property
    def session(self):
        (session,) = self.state.registry.sessions()
        return session


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("certs")
    init_certs(directory, nodes=[NODE_ID])
    return directory


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery cancelled when the test ends: whatever a test starts, it stops."""
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()


async def start_stack(
    nursery: trio.Nursery,
    certs: Path,
    tmp_path: Path,
    *,
    options: dict[str, Any] | None = None,
    model: ModelConfig | None = None,
    capacity: int = 16,
    labels: dict[str, str] | None = None,
    with_node: bool = True,
    **edge: Any,
) -> Stack:
    edge_config = EdgeConfig(
        **{
            "http": HttpConfig(listen="127.0.0.1:0", graceful_timeout=1),
            "iop": IopListenConfig(listen="127.0.0.1:0"),
            "tls": tls(certs, "edge"),
            "data_dir": str(tmp_path / "edge"),
            **edge,
        }
    )
    state = EdgeState.from_config(edge_config)
    stop = trio.Event()
    addresses = await nursery.start(run_edge, edge_config, stop.wait, state)
    if not with_node:
        return Stack(addresses["http"], state, None)
    settings = NodeSettings(
        node_id=NODE_ID,
        edge=addresses["iop"],
        server_name="localhost",
        token=state.tokens.create(NODE_ID).token,
        tls=tls(certs, NODE_ID),
        data_dir=str(tmp_path / NODE_ID),
        capacity=capacity,
        labels=labels or {},
        models=(model or ModelConfig(name="m", adapter="mock", options=FAST if options is None else options),),
    )
    runner = build_node(settings, "test")
    await nursery.start(runner.run, stop.wait)

    # The node reports "started" once accepted; the edge indexes it a moment later.
    async def registered() -> bool:
        return len(state.registry) == 1

    await poll(registered, 5)
    return Stack(addresses["http"], state, runner)


async def wait_until(check, limit: float = 5) -> None:
    async def condition() -> bool:
        return check()

    await poll(condition, limit)


def assert_openai_error(response: httpx.Response, status: int, code: str | None, type: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == code
    if type is not None:
        assert error["type"] == type
    return error


class Streamer:
    """A streaming chat request that holds a node slot until told to leave (or it ends)."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> None:
        self.client, self.url, self.body, self.headers = client, url, body, headers or {}
        self.first_token = trio.Event()
        self.leave = trio.Event()
        self.done = trio.Event()
        self.status: int | None = None
        self.lines: list[str] = []
        self.finished: str | None = None  # "done" ([DONE] seen), "left", or "ended" (cut short)
        self.ended_at: float | None = None

    async def run(self) -> None:
        try:
            async with self.client.stream(
                "POST", f"{self.url}/v1/chat/completions", json={**self.body, "stream": True}, headers=self.headers
            ) as response:
                self.status = response.status_code
                async with aclosing(response.aiter_lines()) as lines, trio.open_nursery() as nursery:

                    async def read() -> None:
                        async for line in lines:
                            self.lines.append(line)
                            if '"content":"' in line and '"content":""' not in line:
                                self.first_token.set()
                            if line == "data: [DONE]":
                                self.finished = "done"
                                break
                        else:
                            self.finished = "ended"  # an error body, or a stream cut short
                        nursery.cancel_scope.cancel()

                    async def leave() -> None:
                        await self.leave.wait()
                        self.finished = "left"
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(read)
                    nursery.start_soon(leave)
        finally:
            self.ended_at = trio.current_time()
            self.first_token.set()
            self.done.set()


class Poster:
    """A non-streaming chat request in its own cancel scope (cancelling it = the client leaves)."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> None:
        self.client, self.url, self.body, self.headers = client, url, body, headers or {}
        self.scope = trio.CancelScope()
        self.response: httpx.Response | None = None
        self.done = trio.Event()
        self.ended_at: float | None = None

    async def run(self) -> None:
        try:
            with self.scope:
                self.response = await self.client.post(
                    f"{self.url}/v1/chat/completions", json=self.body, headers=self.headers
                )
        finally:
            self.ended_at = trio.current_time()
            self.done.set()


# --- authentication ------------------------------------------------------------------------


async def test_api_keys_are_required_on_v1(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(nursery, certs, tmp_path, api_keys=KEYS)
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for headers in (
                {},
                {"Authorization": "Bearer sk-wrong"},
                {"Authorization": "Bearer"},
                {"Authorization": "Basic sk-a"},
                {"Authorization": "sk-a"},
                {"Authorization": "Bearer sk-ab"},
                {"Authorization": "Bearer SK-A"},
            ):
                response = await client.get("/v1/models", headers=headers)
                error = assert_openai_error(response, 401, "invalid_api_key", "invalid_request_error")
                assert "sk-" not in error["message"]
            response = await client.post("/v1/chat/completions", json=chat())
            assert_openai_error(response, 401, "invalid_api_key")

            # The right keys, in either scheme spelling.
            assert (await client.get("/v1/models", headers=A)).status_code == 200
            assert (await client.get("/v1/models", headers={"Authorization": "bearer sk-b"})).status_code == 200
            # Outside /v1/ nothing needs a key.
            health = await client.get("/healthz")
            assert health.status_code == 200
            assert health.json() == {"status": "ok", "nodes": 1}
            # The admin key is not an API key.
            assert_openai_error(await client.get("/v1/models", headers=ADMIN), 401, "invalid_api_key")
        # Refused requests were not charged to sk-a's limit (2 a minute): both still pass.
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for _ in range(2):
                assert (await client.post("/v1/chat/completions", json=chat(), headers=A)).status_code == 200


async def test_model_allow_list_and_rate_limit(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(nursery, certs, tmp_path, api_keys=KEYS)
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            # sk-a may only use "m": anything else is 403, whether or not some node serves it.
            error = assert_openai_error(
                await client.post("/v1/chat/completions", json=chat("other"), headers=A),
                403, "model_not_allowed", "invalid_request_error",
            )
            assert error["param"] == "model"
            assert "other" in error["message"]
            assert_openai_error(
                await client.post("/v1/completions", json={"model": "other", "prompt": "x"}, headers=A),
                403, "model_not_allowed",
            )
            # sk-b may use every model: an unknown one is the usual 404.
            assert_openai_error(
                await client.post("/v1/chat/completions", json=chat("other"), headers=B), 404, "model_not_found"
            )

            # Two requests a minute for sk-a; the refusals above did not count.
            for _ in range(2):
                response = await client.post("/v1/chat/completions", json=chat(), headers=A)
                assert response.status_code == 200
                assert response.json()["choices"][0]["message"]["content"]
            response = await client.post("/v1/chat/completions", json=chat(), headers=A)
            error = assert_openai_error(response, 429, "rate_limit_exceeded", "requests")
            assert "requests per minute (2)" in error["message"]
            retry_after = int(response.headers["Retry-After"])
            assert 25 <= retry_after <= 30  # one request back every 30 s
            # Streaming requests are limited the same way, before any SSE starts.
            response = await client.post("/v1/chat/completions", json=chat(stream=True), headers=A)
            assert_openai_error(response, 429, "rate_limit_exceeded")
            assert "Retry-After" in response.headers

            # Keys have their own buckets.
            for _ in range(3):
                assert (await client.post("/v1/chat/completions", json=chat(), headers=B)).status_code == 200
        # Nothing refused ever reached the node or took a slot.
        assert stack.state.scheduler.total_waiting() == 0
        await wait_until(lambda: stack.session.outstanding == 0)


async def test_priority_header(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(nursery, certs, tmp_path, api_keys=KEYS)
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for value in ("high", "1.5", ""):
                response = await client.post(
                    "/v1/chat/completions", json=chat(), headers={**A, "X-IOP-Priority": value}
                )
                error = assert_openai_error(response, 400, None, "invalid_request_error")
                assert error["param"] == "X-IOP-Priority"
            # An integer is accepted, and the 400s above did not use up sk-a's two requests.
            for value in ("-3", "99"):
                response = await client.post(
                    "/v1/chat/completions", json=chat(), headers={**A, "X-IOP-Priority": value}
                )
                assert response.status_code == 200


async def test_request_priority_may_only_lower_the_keys_priority() -> None:
    limits = KeyLimits(ApiKeyConfig(key="k", priority=5))
    assert request_priority({}, limits) == 5
    assert request_priority({"X-IOP-Priority": "2"}, limits) == 2
    assert request_priority({"X-IOP-Priority": "-10"}, limits) == -10
    assert request_priority({"X-IOP-Priority": "5"}, limits) == 5
    assert request_priority({"X-IOP-Priority": "100"}, limits) == 5  # no jumping the queue
    # Without API keys the ceiling is 0.
    assert request_priority({}, None) == 0
    assert request_priority({"X-IOP-Priority": "7"}, None) == 0
    assert request_priority({"X-IOP-Priority": "-1"}, None) == -1
    with pytest.raises(ApiError) as info:
        request_priority({"X-IOP-Priority": "urgent"}, limits)
    assert info.value.status == 400


async def test_priority_orders_the_queue_over_http(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, options=SLOW, capacity=1, api_keys=KEYS,
            queue=QueueConfig(max_waiting=5, timeout=20),
        )
        scheduler = stack.state.scheduler
        order: list[str] = []
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as client:
            # The holder runs for about two seconds (100 tokens, 20 ms each), then completes.
            holder = Streamer(client, stack.url, chat(max_tokens=100), B)
            nursery.start_soon(holder.run)
            await holder.first_token.wait()

            posters: dict[str, Poster] = {}

            async def post(name: str, headers: dict) -> None:
                poster = posters[name] = Poster(client, stack.url, chat(max_tokens=2), headers)
                await poster.run()
                order.append(name)

            queued = [
                ("b-first", B),  # priority 0
                ("a-lowered", {**A, "X-IOP-Priority": "-1"}),  # sk-a stepping aside
                ("a", A),  # priority 5: first to be served
                ("b-second", B),
            ]
            for count, (name, headers) in enumerate(queued, 1):
                nursery.start_soon(post, name, headers)
                await wait_until(lambda count=count: scheduler.waiting("m") == count)
            assert not holder.done.is_set(), "the holder ended before the queue was built"

            # Its slot frees up: the queue is served in priority order, then arrival.
            await wait_until(lambda: len(order) == len(queued), 15)
        assert holder.finished == "done"
        assert order == ["a", "b-first", "b-second", "a-lowered"]
        for poster in posters.values():
            assert poster.response is not None and poster.response.status_code == 200


# --- admin API -----------------------------------------------------------------------------


async def test_admin_nodes(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, capacity=6, labels={"zone": "eu", "gpu": "t4"},
            api_keys=KEYS, admin_key="adm",
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for headers in ({}, {"Authorization": "Bearer wrong"}, A, {"Authorization": "Basic adm"}):
                assert_openai_error(await client.get("/admin/nodes", headers=headers), 401, "invalid_api_key")
            response = await client.get("/admin/nodes", headers=ADMIN)
            assert response.status_code == 200
            body = response.json()
        assert body["object"] == "list"
        (node,) = body["data"]
        assert node["node_id"] == NODE_ID
        assert node["state"] == "ready"
        assert node["models"] == ["m"]
        assert node["labels"] == {"zone": "eu", "gpu": "t4"}
        assert node["max_concurrency"] == 6  # the node's capacity caps the edge default (64)
        assert node["outstanding"] == 0
        assert node["queued"] == {}
        assert isinstance(node["last_heartbeat_age_s"], float | int)
        assert 0 <= node["last_heartbeat_age_s"] < 30
        assert {"peer", "adapters", "connected_at"} <= set(node)


async def test_admin_api_is_disabled_without_an_admin_key(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(nursery, certs, tmp_path, with_node=False, api_keys=KEYS)
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            for headers in ({}, {"Authorization": "Bearer"}, ADMIN, A):
                error = assert_openai_error(await client.get("/admin/nodes", headers=headers), 403, "admin_disabled")
                assert "admin_key" in error["message"]


async def test_node_override_sets_max_concurrency(nursery, certs, tmp_path) -> None:
    overrides = (
        NodeOverride(max_concurrency=5, labels={"gpu": "a100"}),  # does not match
        NodeOverride(max_concurrency=3, node_id=NODE_ID),  # the first that matches
        NodeOverride(max_concurrency=2, labels={"zone": "eu"}),
    )
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, capacity=16, labels={"zone": "eu"}, admin_key="adm",
            nodes=NodeDefaults(max_concurrency=10, overrides=overrides),
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            (node,) = (await client.get("/admin/nodes", headers=ADMIN)).json()["data"]
        assert node["max_concurrency"] == 3
        assert stack.session.config.max_concurrency == 3
        assert stack.runner is not None
        assert stack.runner.core.max_concurrency == 3  # the node applied it too


@pytest.mark.parametrize(
    ("overrides", "node_id", "labels", "capacity", "expected"),
    [
        ((), "n1", {}, 16, 8),  # the default
        ((), "n1", {}, 4, 4),  # capped by the node's capacity
        ((NodeOverride(3, node_id="n1"),), "n1", {}, 16, 3),
        ((NodeOverride(3, node_id="n2"),), "n1", {}, 16, 8),
        ((NodeOverride(12, node_id="n1"),), "n1", {}, 16, 12),  # above the default is allowed
        ((NodeOverride(50, node_id="n1"),), "n1", {}, 16, 16),  # but never above capacity
        ((NodeOverride(2, labels={"gpu": "t4"}),), "n1", {"gpu": "t4", "zone": "eu"}, 16, 2),
        ((NodeOverride(2, labels={"gpu": "t4", "zone": "us"}),), "n1", {"gpu": "t4", "zone": "eu"}, 16, 8),
        ((NodeOverride(2, labels={"gpu": "t4"}), NodeOverride(5, node_id="n1")), "n1", {"gpu": "t4"}, 16, 2),
        ((NodeOverride(5, node_id="n1"), NodeOverride(2, labels={"gpu": "t4"})), "n1", {"gpu": "t4"}, 16, 5),
        # An entry with a node_id matches by id only, whatever its labels.
        ((NodeOverride(2, node_id="n2", labels={"gpu": "t4"}),), "n1", {"gpu": "t4"}, 16, 8),
        # An entry with neither id nor labels matches nothing.
        ((NodeOverride(2),), "n1", {"gpu": "t4"}, 16, 8),
    ],
)
def test_node_config_overrides(overrides, node_id, labels, capacity, expected) -> None:
    config = EdgeConfig(nodes=NodeDefaults(max_concurrency=8, heartbeat_interval=7, overrides=overrides))
    acceptor = NodeAcceptor(SimpleNamespace(config=config))  # type: ignore[arg-type]
    request = RegisterRequest(
        token="t", node_id=node_id, version="test", models=("m",), capacity=capacity, labels=labels
    )
    node_config = acceptor._node_config(request)
    assert node_config.max_concurrency == expected
    assert node_config.heartbeat_interval == 7
    assert node_config.models == ("m",)
    assert node_config.labels == labels


# --- backpressure --------------------------------------------------------------------------


async def test_saturation_queue_full_and_the_waiter_is_served(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, options=SLOW, capacity=1, admin_key="adm",
            queue=QueueConfig(max_waiting=1, timeout=15),
        )
        scheduler = stack.state.scheduler
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as client:
            # The first request runs (about a second: 50 tokens, 20 ms each).
            first = Streamer(client, stack.url, chat(max_tokens=50))
            nursery.start_soon(first.run)
            await first.first_token.wait()
            assert first.status == 200
            # The second waits for it.
            second = Poster(client, stack.url, chat(max_tokens=3))
            nursery.start_soon(second.run)
            await wait_until(lambda: scheduler.waiting("m") == 1)

            (node,) = (await client.get("/admin/nodes", headers=ADMIN)).json()["data"]
            assert (node["max_concurrency"], node["outstanding"], node["queued"]) == (1, 1, {"m": 1})

            # The third finds the queue full: 429 at once.
            started = trio.current_time()
            response = await client.post("/v1/chat/completions", json=chat(max_tokens=3))
            assert trio.current_time() - started < 0.5
            assert not first.done.is_set()
            error = assert_openai_error(response, 429, "queue_full", "server_error")
            assert "busy" in error["message"]
            assert response.headers["Retry-After"] == "1"
            # So does a streaming one, before any SSE.
            response = await client.post("/v1/chat/completions", json=chat(stream=True))
            assert_openai_error(response, 429, "queue_full")
            assert scheduler.waiting("m") == 1

            await first.done.wait()
            await second.done.wait()
        assert first.finished == "done"
        assert second.response is not None and second.response.status_code == 200
        reply = second.response.json()
        assert reply["usage"]["completion_tokens"] == 3
        assert reply["choices"][0]["finish_reason"] == "length"
        assert first.ended_at is not None and second.ended_at is not None
        assert second.ended_at >= first.ended_at
        assert scheduler.waiting("m") == 0
        # Two attempts got a slot (the refused ones are not observed); the second waited for the
        # first to end, most of the first's second-long run.
        registry = stack.state.metrics.registry
        assert registry.get_sample_value("iop_schedule_wait_seconds_count") == 2
        assert registry.get_sample_value("iop_schedule_wait_seconds_sum") > 0.5
        assert registry.get_sample_value("iop_schedule_wait_seconds_bucket", {"le": "0.0025"}) == 1
        await wait_until(lambda: stack.session.outstanding == 0 and stack.state.runs_in_flight == 0)


async def test_queue_timeout_is_429(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, options=SLOW, capacity=1, queue=QueueConfig(max_waiting=1, timeout=0.5)
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as client:
            holder = Streamer(client, stack.url, chat())
            nursery.start_soon(holder.run)
            await holder.first_token.wait()
            started = trio.current_time()
            response = await client.post("/v1/chat/completions", json=chat(max_tokens=3))
            waited = trio.current_time() - started
            assert 0.45 <= waited < 3
            error = assert_openai_error(response, 429, "queue_timeout", "server_error")
            assert "0.5s" in error["message"]
            assert response.headers["Retry-After"] == "1"
            assert stack.state.scheduler.waiting("m") == 0
            assert not holder.done.is_set()
            holder.leave.set()
            await holder.done.wait()
        await wait_until(lambda: stack.session.outstanding == 0 and stack.state.runs_in_flight == 0)


async def test_a_queued_client_that_leaves_leaves_the_queue(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, options=SLOW, capacity=1, queue=QueueConfig(max_waiting=1, timeout=20)
        )
        scheduler = stack.state.scheduler
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as client:
            # The holder runs for about a second (50 tokens, 20 ms each), then completes.
            holder = Streamer(client, stack.url, chat(max_tokens=50))
            nursery.start_soon(holder.run)
            await holder.first_token.wait()

            queued = Poster(client, stack.url, chat(max_tokens=3))
            nursery.start_soon(queued.run)
            await wait_until(lambda: scheduler.waiting("m") == 1)
            queued.scope.cancel()  # the client disconnects while queued
            await queued.done.wait()
            await wait_until(lambda: scheduler.waiting("m") == 0, 1)
            assert queued.response is None
            # Its place in the (1-deep) queue is free again.
            replacement = Poster(client, stack.url, chat(max_tokens=3))
            nursery.start_soon(replacement.run)
            await wait_until(lambda: scheduler.waiting("m") == 1)
            assert not holder.done.is_set(), "the holder ended before the test was done queueing"

            # The holder ends: its slot goes to the replacement, not to the departed client.
            await replacement.done.wait()
            assert holder.finished == "done"
            assert replacement.response is not None
            assert replacement.response.status_code == 200, replacement.response.text
            assert replacement.response.json()["usage"]["completion_tokens"] == 3
        await wait_until(lambda: stack.session.outstanding == 0 and stack.state.runs_in_flight == 0)
        assert scheduler.waiting("m") == 0
        # The departed client never became a run on the node: two runs in all, holder and replacement.
        assert stack.runner is not None
        await wait_until(lambda: len(stack.runner.store.list_runs()) == 2)
        assert [row["status"] for row in stack.runner.store.list_runs()] == ["complete", "complete"]


async def test_streaming_error_bodies_are_json_not_sse(nursery, certs, tmp_path) -> None:
    """A stream refused before it starts gets a plain JSON error (what OpenAI clients parse)."""
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(nursery, certs, tmp_path, api_keys=KEYS)
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            response = await client.post("/v1/chat/completions", json=chat("other", stream=True), headers=A)
        assert response.headers["content-type"].startswith("application/json")
        assert json.loads(response.text)["error"]["code"] == "model_not_allowed"


#: A program that shrugs off SIGTERM: its run ends only when the cli adapter's kill_grace is over
#: and SIGKILL comes. Any backend that takes a moment to stop a cancelled run behaves alike.
STUBBORN_PROGRAM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
for index in range(100000):
    print(f"w{index}", end=" ", flush=True)
    time.sleep(0.02)
"""


async def test_a_slot_freed_by_a_leaving_client_is_free_on_the_node_too(nursery, certs, tmp_path) -> None:
    """The edge keeps a cancelled run's slot until the node confirms the run is over: the node
    counts it against the same max_concurrency until then, and would refuse the next run."""
    model = ModelConfig(
        name="m", adapter="cli",
        options={"argv": [sys.executable, "-c", STUBBORN_PROGRAM], "kill_grace": 1.0},
    )
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, model=model, capacity=1, queue=QueueConfig(max_waiting=1, timeout=20)
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=20) as client:
            holder = Streamer(client, stack.url, chat())
            nursery.start_soon(holder.run)
            await holder.first_token.wait()
            waiter = Streamer(client, stack.url, chat())
            nursery.start_soon(waiter.run)
            await wait_until(lambda: stack.state.scheduler.waiting("m") == 1)

            holder.leave.set()  # the client goes away; its program takes a second to die
            left_at = trio.current_time()
            await waiter.first_token.wait()
            # The queued request waited its turn: it is served, not refused as node_busy...
            assert waiter.status == 200, waiter.lines
            # ...because its slot was handed over only once the node had ended the cancelled run.
            assert trio.current_time() - left_at >= 0.9
            waiter.leave.set()
            await waiter.done.wait()
        await wait_until(lambda: stack.session.outstanding == 0 and stack.state.runs_in_flight == 0)


async def test_a_request_too_large_for_a_frame_does_not_take_a_slot_for_good(nursery, certs, tmp_path) -> None:
    with trio.fail_after(TEST_LIMIT):
        stack = await start_stack(
            nursery, certs, tmp_path, capacity=1,
            iop=IopListenConfig(listen="127.0.0.1:0", max_frame_size=16 * 1024),
            queue=QueueConfig(max_waiting=4, timeout=1),
        )
        async with httpx.AsyncClient(base_url=stack.url, timeout=10) as client:
            huge = {"model": "m", "messages": [{"role": "user", "content": "word " * 10_000}]}
            response = await client.post("/v1/chat/completions", json=huge)
            assert_openai_error(response, 413, "request_too_large")
            # The node never saw that run: the slot must be free for the next request.
            response = await client.post("/v1/chat/completions", json=chat())
            assert response.status_code == 200, response.text
        assert stack.session.outstanding == 0
