"""Failure handling with real processes: a node killed with -9, a node drained with SIGTERM,
and a saturated fleet answering 429."""

from __future__ import annotations

import signal
import threading

import openai
import pytest

from .conftest import Cluster, eventually

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "user", "content": "hello"}]
STALLING = {"name": "m", "adapter": "mock", "options": {"tokens": 5, "ttft": 60}}
QUICK = {"name": "m", "adapter": "mock", "options": {"tokens": 5}}
STREAMING = {"name": "s", "adapter": "mock", "options": {"tokens": 400, "token_delay": 0.05}}


def in_thread(target, **kwargs):
    """Run a blocking SDK call in a thread; join() returns its result or raises its error."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = target(**kwargs)
        except Exception as exc:  # noqa: BLE001 - handed back to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: float = 30):
        thread.join(timeout)
        assert not thread.is_alive(), "request hung"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return join


def test_kill_9_retries_runs_before_first_token_and_fails_streams_mid_way(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_edge()
        doomed = cluster.start_node("node-a", [STALLING, STREAMING])
        cluster.wait_for_models("m", "s")
        client = cluster.client(timeout=30)
        waiting = [in_thread(client.chat.completions.create, model="m", messages=MESSAGES) for _ in range(2)]
        eventually(lambda: len([r for r in cluster.runs("node-a") if r["status"] == "running"]) == 2)
        stream = client.chat.completions.create(model="s", messages=MESSAGES, stream=True)
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        cluster.start_node("node-b", [QUICK])
        doomed.signal(signal.SIGKILL)
        for join in waiting:
            reply = join()
            assert len(reply.choices[0].message.content.split()) == 5  # completed on node-b
        with pytest.raises(openai.APIError, match="node-a was lost"):
            for _ in chunks:
                pass
        assert [r["status"] for r in cluster.wait_for_ended_runs("node-b", 2)] == ["complete", "complete"]
    finally:
        cluster.stop()


def test_sigterm_drains_a_node_while_the_fleet_keeps_serving(tmp_path) -> None:
    cluster = Cluster(tmp_path, edge_extra={"admin_key": "adm"})
    try:
        cluster.start_edge()
        draining = cluster.start_node("node-a", [{**STREAMING, "options": {"tokens": 40, "token_delay": 0.05}}])
        cluster.wait_for_models("s")
        client = cluster.client()
        stream = client.chat.completions.create(model="s", messages=MESSAGES, stream=True)
        chunks = iter(stream)
        next(chunks)
        cluster.start_node("node-b", [{**STREAMING, "options": {"tokens": 3}}])
        draining.signal(signal.SIGTERM)
        eventually(lambda: cluster.node_state("node-a") == "draining")  # requests now must avoid node-a
        for _ in range(4):
            reply = client.chat.completions.create(model="s", messages=MESSAGES)
            assert len(reply.choices[0].message.content.split()) == 3
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(text.split()) == 40  # the in-flight stream finished on the draining node
        assert draining.popen.wait(15) == 0
        assert [r["status"] for r in cluster.runs("node-a")] == ["complete"]
        assert [r["status"] for r in cluster.wait_for_ended_runs("node-b", 4)] == ["complete"] * 4
    finally:
        cluster.stop()


def test_a_saturated_fleet_answers_429_with_retry_after(tmp_path) -> None:
    cluster = Cluster(tmp_path, edge_extra={"queue": {"max_waiting": 1, "timeout": 30}})
    try:
        cluster.start_edge()
        cluster.start_node("node-a", [{**STREAMING, "options": {"tokens": 20, "token_delay": 0.05}}], capacity=1)
        cluster.wait_for_models("s")
        client = cluster.client()
        running = in_thread(client.chat.completions.create, model="s", messages=MESSAGES)
        eventually(lambda: cluster.runs("node-a"))
        queued = in_thread(client.chat.completions.create, model="s", messages=MESSAGES)
        eventually(lambda: cluster.metric("iop_queued_requests") == 1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="s", messages=MESSAGES)
        assert refused.value.code == "queue_full"
        assert refused.value.response.headers["Retry-After"] == "1"
        assert len(running().choices[0].message.content.split()) == 20
        assert len(queued().choices[0].message.content.split()) == 20  # served once a slot freed
    finally:
        cluster.stop()
