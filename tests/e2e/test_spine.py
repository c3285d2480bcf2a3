"""The spine end to end: the official openai SDK -> edge -> IOP/mTLS -> nodes -> mock adapter."""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import MOCK, SLOW, Cluster, eventually, iop_trio  # noqa: F401

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "hello from the test suite"}]


@pytest.fixture
def client(cluster: Cluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="sk-test", max_retries=0, timeout=20) as sdk:
        yield sdk


def test_models_lists_what_the_connected_nodes_serve(client: openai.OpenAI) -> None:
    ids = {model.id for model in client.models.list()}
    assert {"mock", "slow", "only-b"} <= ids
    assert client.models.retrieve("only-b").id == "only-b"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_completion_non_streaming(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model="mock", messages=MESSAGES)
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "mock"
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 8
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.total_tokens == 13


def test_chat_completion_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="mock", messages=MESSAGES, stream=True, stream_options={"include_usage": True}, max_tokens=5
    )
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 5
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_streamed_and_non_streamed_text_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="mock", messages=MESSAGES).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model="mock", messages=MESSAGES, stream=True)
    )
    assert whole == streamed


def test_completions_both_ways(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="only-b", prompt="one two three")
    assert completion.object == "text_completion"
    assert len(completion.choices[0].text.split()) == 3
    assert completion.usage.prompt_tokens == 3
    pieces = list(client.completions.create(model="only-b", prompt="one two", stream=True))
    assert "".join(p.choices[0].text for p in pieces) == client.completions.create(
        model="only-b", prompt="one two"
    ).choices[0].text


def test_bad_api_key_is_401(cluster: Cluster) -> None:
    bad = cluster.client(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as raised:
        bad.chat.completions.create(model="mock", messages=MESSAGES)
    assert raised.value.code == "invalid_api_key"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert raised.value.code == "model_not_found"


def test_invalid_requests_are_400_and_the_edge_keeps_serving(cluster: Cluster, client: openai.OpenAI) -> None:
    headers = {**cluster.auth_headers(), "Content-Type": "application/json"}
    url = f"{cluster.url}/v1/chat/completions"
    for body in (b"{not json", b"[1, 2]", b'{"model": "mock"}', b'{"model": "mock", "messages": [], "n": 1}',
                 b'{"model": "mock", "messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}'):
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="mock", messages=MESSAGES, n=2)
    assert client.chat.completions.create(model="mock", messages=MESSAGES).choices[0].message.content


def test_client_closing_a_stream_cancels_the_run_on_the_node(cluster: Cluster, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True)
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    row = cluster.wait_for_run("node-a", "cancelled")
    assert 3 <= row["completion_tokens"] < 400
    assert row["error"] == "cancelled by client"


def test_metrics_and_health(cluster: Cluster, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="mock", messages=MESSAGES)
    health = httpx.get(f"{cluster.url}/healthz").json()
    assert health == {"status": "ok", "nodes": 2}
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert "iop_connected_nodes 2.0" in metrics
    assert 'iop_runs_total{status="complete"}' in metrics
    assert 'iop_http_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    assert "iop_time_to_first_token_seconds_bucket" in metrics
    assert "iop_request_duration_seconds_bucket" in metrics


def test_a_client_without_a_certificate_is_refused_and_nodes_keep_serving(
    cluster: Cluster, client: openai.OpenAI
) -> None:
    host, port = cluster.edge.ready["iop"].rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(cluster.workdir / "certs" / "ca.crt"))
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with context.wrap_socket(raw, server_hostname="localhost") as tls:
                # TLS 1.3: the server's refusal arrives with the first read after the handshake.
                tls.sendall(b"\x00\x00\x00\x02{}")
                assert tls.recv(1) == b""
                raise ConnectionError("closed without data")
    assert client.chat.completions.create(model="mock", messages=MESSAGES).choices[0].message.content


def test_a_node_with_a_bad_token_is_refused_and_exits(cluster: Cluster, client: openai.OpenAI) -> None:
    config = cluster.node_config("node-c", [MOCK], token="iop_deadbeef.not-a-real-secret")
    result = subprocess.run(
        iop_trio("node", "--config", str(config)), cwd=cluster.workdir, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert "registration refused" in result.stderr
    assert "ready:" not in result.stdout
    assert client.chat.completions.create(model="mock", messages=MESSAGES).choices[0].message.content


def test_a_token_bound_to_another_node_is_refused(cluster: Cluster) -> None:
    config = cluster.node_config("node-c", [MOCK], token=cluster.create_token("node-a"))
    result = subprocess.run(
        iop_trio("node", "--config", str(config)), cwd=cluster.workdir, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1 and "bound to node" in result.stderr


def test_node_lost_mid_stream_ends_the_request_with_an_error(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_edge()
        node = cluster.start_node("node-a", [SLOW])
        cluster.wait_for_models("slow")
        client = cluster.client()
        stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as raised:
            for index, _chunk in enumerate(stream):
                if index == 3:
                    node.signal(signal.SIGKILL)
        assert time.monotonic() - started < 10
        assert "node-a was lost" in raised.value.message
        with pytest.raises(openai.APIStatusError) as no_node:
            client.chat.completions.create(model="slow", messages=MESSAGES)
        assert no_node.value.status_code == 503
    finally:
        cluster.stop()


def test_sigterm_drains_in_flight_runs_and_exits_zero(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_edge()
        slow = {"name": "slow", "adapter": "mock", "options": {"tokens": 40, "token_delay": 0.05}}
        cluster.start_node("node-a", [slow])
        cluster.wait_for_models("slow")
        client = cluster.client()
        stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True)
        next(iter(stream))
        cluster.edge.signal(signal.SIGTERM)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert len(text.split()) == 40
        assert cluster.edge.popen.wait(15) == 0
        assert [r["status"] for r in cluster.wait_for_ended_runs("node-a", 1)] == ["complete"]
    finally:
        cluster.stop()
    assert [p.popen.returncode for p in cluster.processes] == [0, 0]


def test_a_non_streaming_client_that_gives_up_cancels_the_run(cluster: Cluster) -> None:
    impatient = cluster.client(api_key="sk-test", timeout=0.5)
    before = len([r for r in cluster.runs("node-a") if r["status"] == "cancelled"])
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="slow", messages=MESSAGES)
    cancelled = eventually(lambda: [r for r in cluster.runs("node-a") if r["status"] == "cancelled"][before:])
    assert len(cancelled) == 1
    assert cancelled[-1]["completion_tokens"] < 400


def test_an_oversized_body_is_413_and_the_connection_stays_usable(client: openai.OpenAI) -> None:
    huge = "word " * 300_000  # 1.5 MB, over the cluster's 1 MiB http.max_body_size
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="mock", messages=[{"role": "user", "content": huge}])
    assert refused.value.status_code == 413
    assert "exceeds the limit" in refused.value.message
    assert client.chat.completions.create(model="mock", messages=MESSAGES).choices[0].message.content
