"""The raw ASGI fast path for the two hot routes, driven as hypercorn drives it: a scope, a
``receive`` fed from a channel, a ``send`` that records. Behind it, a node that is a script: the
test sends its run events and reads what the edge sent it (``run.request``, ``cancel.request``).

Over real sockets, tests/edge/test_api_policy.py, tests/adapters/test_cancellation_chain.py and
tests/e2e cover the same routes end to end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from iop_trio.config import ApiKeyConfig, EdgeConfig, HttpConfig
from iop_trio.controlplane import NodeSession
from iop_trio.edge.api import create_app
from iop_trio.edge.openai_asgi import BODY_TIMEOUT, OpenAIFastPath
from iop_trio.edge.state import EdgeState
from iop_trio.transport import TlsConfig
from iop_trio.wire import CancelRequest, NodeConfig, RegisterRequest, RunEvent, RunRequest, Usage
from tests.edge.test_run_deadline import SilentNode

LIMIT = 1024  # http.max_body_size in these tests
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def run_ids(node: SilentNode) -> list[str]:
    return [message.run_id for message in node.sent if isinstance(message, RunRequest)]


def cancelled(node: SilentNode) -> list[str]:
    return [message.run_id for message in node.sent if isinstance(message, CancelRequest)]


class Client:
    """One request to an ASGI app, as hypercorn makes it."""

    def __init__(self, app: Any, method: str, path: str, headers: dict[str, str] | None = None) -> None:
        self.app = app
        self.scope = {
            "type": "http", "http_version": "1.1", "method": method, "path": path, "scheme": "http",
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "query_string": b"", "root_path": "", "raw_path": path.encode(), "client": None, "server": None,
        }
        self.to_app, self.inbox = trio.open_memory_channel[dict[str, Any]](10)
        self.messages: list[dict[str, Any]] = []
        self.received = 0  # how many messages the app took from ``receive``
        self.finished = trio.Event()
        self._changed = trio.Event()

    async def receive(self) -> dict[str, Any]:
        message = await self.inbox.receive()
        self.received += 1
        return message

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        self._changed.set()
        self._changed = trio.Event()

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)
        self.finished.set()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    @property
    def status(self) -> int:
        return self.messages[0]["status"]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.messages[1:])

    @property
    def complete(self) -> bool:
        return bool(self.messages) and self.messages[-1].get("more_body") is False

    def events(self) -> list[str]:
        return [line for line in self.body.decode().split("\n") if line]


@pytest.fixture
def state(tmp_path) -> Iterator[EdgeState]:
    config = EdgeConfig(tls=TlsConfig(enabled=False), data_dir=str(tmp_path), http=HttpConfig(max_body_size=LIMIT))
    state = EdgeState.from_config(config, in_thread=False)
    yield state
    state.close()


@pytest.fixture
def node(state: EdgeState) -> SilentNode:
    """A node whose run events are the test's to send."""
    conn = SilentNode()
    info = RegisterRequest(token="t", node_id="n", version="test", models=("m",), capacity=4)
    session = NodeSession(info, NodeConfig(max_concurrency=4, heartbeat_interval=30), conn, "x")  # type: ignore[arg-type]
    session.on_change = state.scheduler.update
    state.registry.add(session)
    return conn


async def emit(state: EdgeState, run_id: str, kind: str, **fields: Any) -> None:
    (session,) = state.registry.sessions()
    await session.on_message(RunEvent(run_id=run_id, kind=kind, **fields), None)  # type: ignore[arg-type]


async def post(nursery: trio.Nursery, app: Any, path: str, body: dict[str, Any], **headers: str) -> Client:
    client = Client(app, "POST", path, headers)
    await client.to_app.send({"type": "http.request", "body": json.dumps(body).encode(), "more_body": False})
    nursery.start_soon(client.run)
    return client


def requests_counted(state: EdgeState, route: str, status: int) -> float | None:
    return state.metrics.registry.get_sample_value("iop_http_requests_total", {"route": route, "status": str(status)})


def durations_observed(state: EdgeState, route: str) -> float | None:
    return state.metrics.registry.get_sample_value("iop_request_duration_seconds_count", {"route": route})


def error_of(client: Client) -> dict[str, Any]:
    assert client.headers[b"content-type"] == b"application/json"
    assert int(client.headers[b"content-length"]) == len(client.body)
    body = json.loads(client.body)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


async def test_every_other_request_and_lifespan_reach_the_app_unchanged(state) -> None:
    calls: list[tuple[Any, Any, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append((scope, receive, send))

    fast = OpenAIFastPath(state, app)
    scopes = [
        {"type": "lifespan"},
        {"type": "http", "method": "GET", "path": "/v1/models"},
        {"type": "http", "method": "POST", "path": "/v1/chat/completions/"},
        {"type": "websocket", "path": "/v1/completions"},
    ]
    for scope in scopes:
        receive, send = object(), object()
        await fast(scope, receive, send)  # type: ignore[arg-type]
        assert calls[-1][0] is scope and calls[-1][1] is receive and calls[-1][2] is send
    assert len(calls) == len(scopes)


async def test_an_unknown_path_gets_quarts_json_404(state) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "GET", "/v1/nope")
    await client.to_app.send({"type": "http.request", "body": b"", "more_body": False})
    with trio.fail_after(5):
        await client.run()
    assert client.status == 404
    assert error_of(client)["message"] == "Unknown request URL: GET /v1/nope."
    assert requests_counted(state, "unmatched", 404) == 1


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
async def test_other_methods_are_405_in_quarts_shape(state, method) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), method, "/v1/completions")
    with trio.fail_after(1):
        await client.run()
    assert client.status == 405
    error = error_of(client)
    assert error == {
        "message": f"Method {method} not allowed for /v1/completions.",
        "type": "invalid_request_error", "param": None, "code": None,
    }
    assert client.received == 0  # the body was never read
    assert requests_counted(state, "unmatched", 405) == 1


async def test_options_is_answered_as_quart_did(state) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "OPTIONS", "/v1/chat/completions")
    await client.run()
    assert client.status == 200
    assert client.headers[b"allow"] == b"POST, OPTIONS" and client.body == b""
    assert requests_counted(state, "/v1/chat/completions", 200) == 1


async def test_the_api_key_is_checked_before_the_method(tmp_path) -> None:
    config = EdgeConfig(tls=TlsConfig(enabled=False), data_dir=str(tmp_path), api_keys=(ApiKeyConfig(key="sk-a"),))
    state = EdgeState.from_config(config, in_thread=False)
    try:
        app = OpenAIFastPath(state, create_app(state))
        for headers, status in (({}, 401), ({"Authorization": "Bearer sk-b"}, 401), ({"Authorization": "Bearer sk-a"}, 405)):
            client = Client(app, "GET", "/v1/chat/completions", headers)
            await client.run()
            assert client.status == status
            if status == 401:
                assert error_of(client)["code"] == "invalid_api_key"
        assert requests_counted(state, "unmatched", 401) == 2
    finally:
        state.close()


async def test_a_content_length_over_the_limit_is_413_before_reading(state) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "POST", "/v1/chat/completions", {"Content-Length": str(LIMIT + 1)})
    with trio.fail_after(1):
        await client.run()  # nothing was fed to receive(): it must not wait for the body
    assert client.status == 413
    assert client.headers[b"connection"] == b"close"
    assert error_of(client)["message"] == f"Request body exceeds the limit of {LIMIT} bytes."
    assert client.received == 0
    assert requests_counted(state, "/v1/chat/completions", 413) == 1


async def test_a_chunked_body_over_the_limit_is_413_once_it_passes_it(state, nursery) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "POST", "/v1/completions")
    nursery.start_soon(client.run)
    for _ in range(2):
        await client.to_app.send({"type": "http.request", "body": b"x" * (LIMIT // 2), "more_body": True})
    assert not client.messages  # exactly at the limit: still reading
    await client.to_app.send({"type": "http.request", "body": b"x", "more_body": True})
    with trio.fail_after(1):
        await client.finished.wait()
    assert client.status == 413
    assert client.headers[b"connection"] == b"close"
    assert error_of(client)["message"] == f"Request body exceeds the limit of {LIMIT} bytes."


async def test_a_body_that_does_not_arrive_is_408(state, autojump_clock) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "POST", "/v1/completions")
    started = trio.current_time()
    await client.run()
    assert trio.current_time() - started == pytest.approx(BODY_TIMEOUT)
    assert client.status == 408
    error_of(client)


@pytest.mark.parametrize("body", [b"{nope", b"[" * (LIMIT - 1)], ids=["malformed", "nested too deep"])
async def test_invalid_json_is_400(state, nursery, body: bytes) -> None:
    client = Client(OpenAIFastPath(state, create_app(state)), "POST", "/v1/chat/completions")
    await client.to_app.send({"type": "http.request", "body": body, "more_body": False})
    await client.run()
    assert client.status == 400
    assert error_of(client)["code"] == "invalid_request"


async def test_a_stream_as_openai_sends_it(state, node, nursery) -> None:
    app = OpenAIFastPath(state, create_app(state))
    client = await post(nursery, app, "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked()
        (run_id,) = run_ids(node)
        assert not client.messages  # no headers before the node starts the run
        await emit(state, run_id, "start")
        await client.wait_for(lambda: len(client.messages) == 2)
        assert client.status == 200
        assert client.headers == {
            b"content-type": b"text/event-stream", b"cache-control": b"no-cache", b"x-accel-buffering": b"no",
        }
        # Two deltas already waiting go out in one write.
        await emit(state, run_id, "delta", text="Hel", tokens=1)
        await emit(state, run_id, "delta", text="lo", tokens=1)
        await client.wait_for(lambda: len(client.messages) == 3)
        assert client.messages[2]["body"].count(b"data: ") == 2
        await emit(state, run_id, "complete", finish_reason="stop", usage=Usage(3, 2))
        await client.finished.wait()
    assert client.messages[3]["body"].count(b"data: ") == 3  # finish, usage and [DONE]: one write
    events = [json.loads(line.removeprefix("data: ")) for line in client.events()[:-1]]
    assert client.events()[-1] == "data: [DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[3]["choices"][0]["finish_reason"] == "stop"
    assert events[4]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert client.complete
    assert requests_counted(state, "/v1/chat/completions", 200) == 1
    assert durations_observed(state, "/v1/chat/completions") == 1
    assert cancelled(node) == [] and state.runs_in_flight == 0


async def test_an_error_mid_stream_is_an_sse_error_event(state, node, nursery) -> None:
    client = await post(nursery, OpenAIFastPath(state, create_app(state)), "/v1/completions", {"model": "m", "prompt": "x", "stream": True})
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked()
        (run_id,) = run_ids(node)
        await emit(state, run_id, "start")
        await emit(state, run_id, "delta", text="a", tokens=1)
        await emit(state, run_id, "error", code="backend_error", message="the backend fell over")
        await client.finished.wait()
    *_, last = client.events()
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "backend_error"
    assert "data: [DONE]" not in client.events()
    assert client.complete


async def test_a_client_leaving_mid_stream_cancels_the_run(state, node, nursery) -> None:
    client = await post(nursery, OpenAIFastPath(state, create_app(state)), "/v1/chat/completions", {**CHAT, "stream": True})
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked()
        (run_id,) = run_ids(node)
        await emit(state, run_id, "start")
        await emit(state, run_id, "delta", text="a", tokens=1)
        await client.wait_for(lambda: b'"content":"a"' in client.body)
        await client.to_app.send({"type": "http.disconnect"})
        await client.finished.wait()  # the handler ended without an error
    assert cancelled(node) == [run_id]
    assert state.runs_in_flight == 0
    assert not client.complete
    assert state.metrics.registry.get_sample_value("iop_runs_total", {"status": "cancelled"}) == 1
    assert durations_observed(state, "/v1/chat/completions") == 1  # a stream is timed however it ends


async def test_a_client_leaving_before_the_run_starts_cancels_it(state, node, nursery) -> None:
    client = await post(nursery, OpenAIFastPath(state, create_app(state)), "/v1/chat/completions", CHAT)
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked()
        (run_id,) = run_ids(node)
        await client.to_app.send({"type": "http.disconnect"})
        await client.finished.wait()
    assert cancelled(node) == [run_id]
    assert client.messages == [] and state.runs_in_flight == 0
    assert requests_counted(state, "/v1/chat/completions", 200) is None  # no response, nothing counted


@pytest.mark.parametrize("failure", [OSError("the connection is closed"), trio.BusyResourceError("hypercorn is closing it")])
async def test_a_send_that_fails_ends_the_request_as_a_disconnect(state, node, nursery, failure) -> None:
    class GoneClient(Client):
        async def send(self, message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                raise failure
            await super().send(message)

    client = GoneClient(OpenAIFastPath(state, create_app(state)), "POST", "/v1/chat/completions")
    await client.to_app.send({"type": "http.request", "body": json.dumps({**CHAT, "stream": True}).encode(), "more_body": False})
    nursery.start_soon(client.run)
    with trio.fail_after(5):
        await trio.testing.wait_all_tasks_blocked()
        (run_id,) = run_ids(node)
        await emit(state, run_id, "start")
        await client.finished.wait()
    assert cancelled(node) == [run_id]
    assert state.runs_in_flight == 0
