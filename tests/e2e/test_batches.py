"""The Files and Batch API end to end, with the official openai SDK: an edge and a mock node
(tests/e2e/conftest.py's Cluster) plus ``iop-trio worker`` processes that run each line through
the edge. Each test starts its own worker, so killing one never disturbs another test."""

from __future__ import annotations

import json
import signal
import sqlite3
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from .conftest import Cluster, Process, eventually, iop_trio

pytestmark = pytest.mark.e2e

API_KEY = "sk-test"
MAX_BODY = 256 * 1024
NODE_CAPACITY = 8
MODELS = [
    {"name": "fast", "adapter": "mock", "options": {"tokens": 4}},
    # ~0.5 s a line: time to cancel or kill the worker while lines are in flight.
    {"name": "slow", "adapter": "mock", "options": {"tokens": 10, "token_delay": 0.05}},
    {"name": "slow-resume", "adapter": "mock", "options": {"tokens": 10, "token_delay": 0.05}},
    # ~0.2 s a line, shared by the large batch and the interactive requests measured against it.
    {"name": "steady", "adapter": "mock", "options": {"tokens": 5, "token_delay": 0.04}},
]
CHAT = "/v1/chat/completions"


class Batches:
    """The cluster, plus what batch tests need: workers, uploads, polling."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.tmp = tmp
        self.client = cluster.client(API_KEY)
        self._workers = 0

    def start_worker(self, **overrides: Any) -> Process:
        self._workers += 1
        name = f"worker-{self._workers}"
        config = {
            "edge_url": self.cluster.url, "api_key": API_KEY, "data_dir": "data/edge",
            "concurrency": 4, "poll_interval": 0.1, "lease_ttl": 2.0,
            "retry_initial": 0.05, "retry_maximum": 0.5, "shutdown_grace": 2.0, **overrides,
        }
        path = self.cluster.write_config(f"{name}.yaml", config)
        return self.cluster.start(name, iop_trio("worker", "--config", str(path)))

    def upload(self, lines: list[dict[str, Any]] | str, name: str = "input.jsonl") -> str:
        path = self.tmp / name
        path.write_text(lines if isinstance(lines, str) else "".join(json.dumps(line) + "\n" for line in lines))
        with path.open("rb") as handle:
            return self.client.files.create(file=handle, purpose="batch").id

    def submit(self, lines: list[dict[str, Any]], endpoint: str = CHAT) -> str:
        input_file_id = self.upload(lines)
        return self.client.batches.create(input_file_id=input_file_id, endpoint=endpoint, completion_window="24h").id

    def wait(self, batch_id: str, *statuses: str, timeout: float = 30.0) -> Any:
        def reached() -> Any:
            batch = self.client.batches.retrieve(batch_id)
            return batch if batch.status in statuses else None

        return eventually(reached, timeout, lambda: f"batch {batch_id} never reached {statuses}")

    def wait_completed(self, batch_id: str, at_least: int, timeout: float = 20.0) -> Any:
        def completed() -> Any:
            batch = self.client.batches.retrieve(batch_id)
            return batch if batch.request_counts and batch.request_counts.completed >= at_least else None

        return eventually(completed, timeout, lambda: f"batch {batch_id} never completed {at_least} lines")

    def read(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        return [json.loads(line) for line in self.client.files.content(file_id).text.splitlines()]

    def wait_node_run(self, model: str, status: str, timeout: float = 10.0) -> None:
        eventually(lambda: self.node_runs(model)[status], timeout, lambda: f"no {status} run of {model}: {self.node_runs(model)}")

    def node_runs(self, model: str) -> Counter[str]:
        db = self.cluster.workdir / "data" / "node-a" / "runs.db"
        with sqlite3.connect(db) as conn:
            return Counter(status for (status,) in conn.execute("SELECT status FROM runs WHERE model = ?", (model,)))


@pytest.fixture(scope="module")
def batches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Batches]:
    workdir = tmp_path_factory.mktemp("batches")
    cluster = Cluster(workdir, api_keys=(API_KEY,))
    edge = yaml.safe_load(cluster.edge_config.read_text())
    edge["http"]["max_body_size"] = MAX_BODY
    cluster.edge_config = cluster.write_config("edge.yaml", edge)
    try:
        cluster.start_edge()
        cluster.start_node("node-a", MODELS, capacity=NODE_CAPACITY)
        cluster.wait_for_models(*(model["name"] for model in MODELS))
        yield Batches(cluster, workdir)
    finally:
        cluster.stop()


@pytest.fixture
def worker(batches: Batches) -> Iterator[Process]:
    process = batches.start_worker()
    try:
        yield process
    finally:
        process.stop()


def chat_line(custom_id: str, content: str, model: str = "fast", **body: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": content}]
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {"model": model, "messages": messages, **body}}


def test_upload_create_poll_and_download(batches: Batches, worker: Process) -> None:
    client = batches.client
    lines = [chat_line(f"request-{n}", f"prompt number {n}", max_tokens=3) for n in range(12)]
    lines.append(chat_line("bad-role", "x") | {"body": {"model": "fast", "messages": [{"role": "wizard", "content": "x"}]}})
    input_file_id = batches.upload(lines)
    uploaded = client.files.retrieve(input_file_id)
    assert (uploaded.purpose, uploaded.filename, uploaded.object) == ("batch", "input.jsonl", "file")
    assert uploaded.bytes == (batches.tmp / "input.jsonl").stat().st_size
    assert input_file_id in {f.id for f in client.files.list(purpose="batch")}

    created = client.batches.create(
        input_file_id=input_file_id, endpoint=CHAT, completion_window="24h", metadata={"job": "nightly"}
    )
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    assert created.expires_at == created.created_at + 24 * 3600
    batch = batches.wait(created.id, "completed", "failed")
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (13, 12, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert created.id in {b.id for b in client.batches.list(limit=100)}

    output = batches.read(batch.output_file_id)
    assert Counter(line["custom_id"] for line in output) == Counter(f"request-{n}" for n in range(12))
    for line in output:
        assert line["error"] is None and line["id"].startswith("batch_req_")
        assert line["response"]["status_code"] == 200
        n = int(line["custom_id"].split("-")[1])
        direct = client.chat.completions.create(model="fast", messages=[{"role": "user", "content": f"prompt number {n}"}], max_tokens=3)
        assert line["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
        assert line["response"]["body"]["object"] == "chat.completion"
    [failed] = batches.read(batch.error_file_id)
    assert failed["custom_id"] == "bad-role" and failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["param"] == "messages.[0].role"
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_a_completions_batch(batches: Batches, worker: Process) -> None:
    lines = [
        {"custom_id": f"c{n}", "method": "POST", "url": "/v1/completions", "body": {"model": "fast", "prompt": f"once {n}"}}
        for n in range(3)
    ]
    batch = batches.wait(batches.submit(lines, endpoint="/v1/completions"), "completed", "failed")
    assert batch.status == "completed" and batch.request_counts.completed == 3
    bodies = [line["response"]["body"] for line in batches.read(batch.output_file_id)]
    assert [body["object"] for body in bodies] == ["text_completion"] * 3
    assert all(len(body["choices"][0]["text"].split()) == 4 for body in bodies)


def test_invalid_requests_get_openai_errors(batches: Batches) -> None:
    client = batches.client
    path = batches.tmp / "other.jsonl"
    path.write_text("{}\n")
    with path.open("rb") as handle, pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=handle, purpose="fine-tune")
    assert info.value.body["param"] == "purpose"

    path.write_bytes(b"x" * (MAX_BODY + 1))
    with path.open("rb") as handle, pytest.raises(openai.APIStatusError) as too_large:
        client.files.create(file=handle, purpose="batch")
    assert too_large.value.status_code == 413

    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(input_file_id="file-nope", endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        assert missing.value.body["type"] == "invalid_request_error"

    file_id = batches.upload([chat_line("a", "b")])
    for kwargs, param in (
        ({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
        ({"endpoint": CHAT, "completion_window": "1h"}, "completion_window"),
        ({"endpoint": CHAT, "completion_window": "24h", "metadata": {"k" * 65: "v"}}, "metadata"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.batches.create(input_file_id=file_id, **kwargs)
        assert bad.value.body["param"] == param

    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        client.files.content(file_id)


def test_an_invalid_input_file_fails_the_batch_with_its_errors(batches: Batches, worker: Process) -> None:
    lines = [
        json.dumps(chat_line("one", "x")),
        "{this is not json",
        json.dumps(chat_line("one", "again")),
        json.dumps(chat_line("two", "x") | {"url": "/v1/completions"}),
        json.dumps(chat_line("three", "x") | {"method": "GET"}),
        json.dumps(chat_line("four", "x", model="no-such-model")),
    ]
    input_file_id = batches.upload("\n".join(lines) + "\n", name="invalid.jsonl")
    created = batches.client.batches.create(input_file_id=input_file_id, endpoint=CHAT, completion_window="24h")
    batch = batches.wait(created.id, "failed", "completed")
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("mismatched_endpoint", 4),
        ("invalid_method", 5), ("model_not_found", 6),
    ]
    with pytest.raises(openai.BadRequestError):
        batches.client.batches.cancel(created.id)


def test_cancel_mid_batch_keeps_finished_lines_and_cancels_runs_on_the_node(batches: Batches) -> None:
    worker = batches.start_worker(concurrency=2)
    try:
        batch_id = batches.submit([chat_line(f"line-{n}", f"slow {n}", model="slow") for n in range(20)])
        batches.wait_completed(batch_id, at_least=2)
        cancelling = batches.client.batches.cancel(batch_id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        batch = batches.wait(batch_id, "cancelled", timeout=10)
    finally:
        worker.stop()
    output = batches.read(batch.output_file_id)
    assert 2 <= len(output) < 20 and len(output) == batch.request_counts.completed
    assert len({line["custom_id"] for line in output}) == len(output)
    assert batch.cancelled_at and batch.error_file_id is None
    assert batches.client.batches.cancel(batch_id).status == "cancelled", "cancelling again is harmless"
    batches.wait_node_run("slow", "cancelled")  # the in-flight lines were cancelled on their node
    # A line answered between the cancel request and the worker noticing it is not recorded.
    assert len(output) <= batches.node_runs("slow")["complete"] <= len(output) + 2


def test_a_worker_killed_mid_batch_resumes_after_restart_and_runs_each_line_once(batches: Batches) -> None:
    lines = [chat_line(f"line-{n}", f"resume {n}", model="slow-resume") for n in range(16)]
    first = batches.start_worker()
    batch_id = batches.submit(lines)
    batches.wait_completed(batch_id, at_least=4)
    first.signal(signal.SIGKILL)
    assert first.popen.wait(10) == -signal.SIGKILL
    done_when_killed = batches.client.batches.retrieve(batch_id).request_counts.completed

    second = batches.start_worker()
    try:
        batch = batches.wait(batch_id, "completed", timeout=30)
    finally:
        second.stop()
    output = batches.read(batch.output_file_id)
    assert Counter(line["custom_id"] for line in output) == Counter(line["custom_id"] for line in lines)
    assert batch.request_counts.completed == 16 and done_when_killed < 16
    complete_runs = batches.node_runs("slow-resume")["complete"]
    # Finished lines never run again; only a line cut off between its answer and its commit might.
    assert 16 <= complete_runs <= 16 + 4, complete_runs


def test_a_large_batch_leaves_interactive_latency_bounded(batches: Batches) -> None:
    client = batches.client
    prompt = [{"role": "user", "content": "interactive"}]

    def interactive_latency() -> float:
        began = time.perf_counter()
        client.chat.completions.create(model="steady", messages=prompt)
        return time.perf_counter() - began

    baseline = statistics.median(interactive_latency() for _ in range(5))
    worker = batches.start_worker(concurrency=8 * NODE_CAPACITY)
    try:
        batch_id = batches.submit([chat_line(f"line-{n}", f"large {n}", model="steady") for n in range(200)])
        batches.wait_completed(batch_id, at_least=NODE_CAPACITY)  # every slot busy, the queue full of batch lines
        under_load = [interactive_latency() for _ in range(5)]
        loaded_batch = client.batches.retrieve(batch_id)
        batch = batches.wait(batch_id, "completed", timeout=40)
    finally:
        worker.stop()
    assert loaded_batch.status == "in_progress", "the interactive requests were measured while the batch ran"
    # Served ahead of the queued batch lines: at most about one line's time more than when idle.
    # (First in, first out would wait for ~7 rounds of lines: ~1.4 s.)
    assert max(under_load) < 2 * baseline + 0.75, (baseline, under_load)
    output = batches.read(batch.output_file_id)
    assert batch.request_counts.completed == 200 and len({line["custom_id"] for line in output}) == 200


def test_up_embeds_a_worker(tmp_path: Path) -> None:
    up = Process("up", iop_trio("up", "--http", "127.0.0.1:0", "--data-dir", "data"), tmp_path)
    try:
        ready = up.wait_ready()
        with openai.OpenAI(base_url=f"{ready['http']}/v1", api_key="unused", max_retries=0, timeout=20) as client:
            path = tmp_path / "input.jsonl"
            path.write_text("".join(json.dumps(chat_line(f"l{n}", f"up {n}", model="mock-fast")) + "\n" for n in range(3)))
            with path.open("rb") as handle:
                input_file_id = client.files.create(file=handle, purpose="batch").id
            batch_id = client.batches.create(input_file_id=input_file_id, endpoint=CHAT, completion_window="24h").id

            def completed() -> Any:
                batch = client.batches.retrieve(batch_id)
                return batch if batch.status == "completed" else None

            batch = eventually(completed, 20, lambda: f"batch {batch_id} never completed")
            assert batch.status == "completed" and batch.request_counts.completed == 3
            assert (tmp_path / "data" / "edge" / "files" / batch.output_file_id).is_file()
        up.signal(signal.SIGINT)
        assert up.popen.wait(20) == 0
    finally:
        up.stop()
