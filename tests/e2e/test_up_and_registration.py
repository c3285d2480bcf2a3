"""`iop-trio up` as a newcomer runs it, and node ids that register twice."""

from __future__ import annotations

import signal

import openai
import pytest

from .conftest import MOCK, Cluster, Process, iop_trio

pytestmark = pytest.mark.e2e


def test_up_serves_the_openai_sdk_and_drains_on_sigint(tmp_path) -> None:
    up = Process("up", iop_trio("up", "--http", "127.0.0.1:0", "--nodes", "2", "--data-dir", "data"), tmp_path)
    try:
        ready = up.wait_ready()
        assert set(ready) == {"http", "iop"}
        with openai.OpenAI(base_url=f"{ready['http']}/v1", api_key="unused", max_retries=0, timeout=20) as client:
            assert {m.id for m in client.models.list()} == {"mock", "mock-fast"}
            reply = client.chat.completions.create(model="mock-fast", messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 16
        up.signal(signal.SIGINT)
        assert up.popen.wait(20) == 0
    finally:
        up.stop()
    assert (tmp_path / "data" / "node-1" / "runs.db").is_file()
    assert (tmp_path / "data" / "node-2" / "runs.db").is_file()
    assert not list(tmp_path.glob("**/*.key")), "up's certificates are ephemeral"


def test_a_node_id_registering_again_replaces_the_old_process(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_edge()
        first = cluster.start_node("node-a", [MOCK])
        token = cluster.create_token("node-a")
        config = cluster.node_config("node-a", [MOCK, {"name": "second", "adapter": "mock"}], token=token)
        cluster.start("node-a-again", iop_trio("node", "--config", str(config)))
        cluster.wait_for_models("second")
        assert first.popen.wait(10) == 1
        assert "another node registered with this node id" in first.logs()
        client = cluster.client()
        assert client.chat.completions.create(model="second", messages=[{"role": "user", "content": "x"}]).choices
    finally:
        cluster.stop()
