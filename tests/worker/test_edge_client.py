"""EdgeClient against a scripted edge (httpx.MockTransport): priority and key headers, retries of
429/503/unreachable with backoff (virtual time), any other answer is the line's result."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import trio

from iop_trio.worker.edge_client import EdgeClient, EdgeUnavailable, edge_http_client
from iop_trio.worker.results import LineFailure, LineResponse

Handler = Callable[[httpx.Request], httpx.Response]


def client(handler: Handler) -> EdgeClient:
    http = httpx.AsyncClient(base_url="http://edge.test", transport=httpx.MockTransport(handler))
    return EdgeClient(http, priority=-10, retry_initial=0.5, retry_maximum=4.0)


async def test_the_http_client_sends_the_key_and_never_times_out_waiting_for_a_slot() -> None:
    async with edge_http_client("http://edge.test", "sk-batch", concurrency=2, request_timeout=30.0) as http:
        assert http.headers["authorization"] == "Bearer sk-batch"
        assert (http.timeout.read, http.timeout.pool) == (30.0, None)
    async with edge_http_client("http://edge.test", "", concurrency=2, request_timeout=30.0) as http:
        assert "authorization" not in http.headers


def scripted(*answers: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    remaining = list(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = remaining.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handler, seen


async def test_busy_unavailable_and_unreachable_are_retried_until_an_answer(autojump_clock) -> None:
    handler, seen = scripted(
        httpx.Response(429, json={"error": {"message": "queue full"}}),
        httpx.Response(503, json={"error": {"message": "no node"}}),
        httpx.ConnectError("refused"),
        httpx.Response(200, json={"id": "chatcmpl-1"}, headers={"x-request-id": "req_abc"}),
    )
    began = trio.current_time()
    answer = await client(handler).execute("/v1/chat/completions", {"model": "m"})
    assert answer == LineResponse(200, "req_abc", {"id": "chatcmpl-1"})
    assert len(seen) == 4
    assert 0.25 + 0.5 + 1.0 <= trio.current_time() - began <= 0.5 + 1.0 + 2.0, "backoff doubles, with jitter"
    first = seen[0]
    assert first.url == "http://edge.test/v1/chat/completions" and first.method == "POST"
    assert first.headers["x-iop-priority"] == "-10"
    assert first.content == b'{"model":"m"}'


async def test_other_errors_are_the_lines_answer() -> None:
    handler, _ = scripted(
        httpx.Response(400, json={"error": {"message": "bad"}}),
        httpx.Response(502, text="<html>bad gateway</html>"),
    )
    edge = client(handler)
    bad = await edge.execute("/v1/completions", {})
    assert isinstance(bad, LineResponse) and bad.status_code == 400 and bad.body == {"error": {"message": "bad"}}
    assert bad.request_id.startswith("req_")
    gateway = await edge.execute("/v1/completions", {})
    assert isinstance(gateway, LineResponse) and gateway.status_code == 502
    assert gateway.body["error"]["message"] == "<html>bad gateway</html>"


async def test_a_request_that_times_out_fails_the_line() -> None:
    handler, _ = scripted(httpx.ReadTimeout("slow"))
    assert await client(handler).execute("/v1/completions", {}) == LineFailure(
        "request_timeout", "The request did not finish within the worker's request_timeout."
    )


async def test_models_lists_ids_or_says_the_edge_is_unavailable() -> None:
    handler, _ = scripted(
        httpx.Response(200, json={"object": "list", "data": [{"id": "a"}, {"id": "b"}]}),
        httpx.ConnectError("refused"),
        httpx.Response(500, json={}),
    )
    edge = client(handler)
    assert await edge.models() == {"a", "b"}
    for _ in range(2):
        with pytest.raises(EdgeUnavailable):
            await edge.models()
