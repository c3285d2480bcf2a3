"""The HTTP adapters (vllm: any OpenAI-compatible server; ollama: Ollama's native API) against
backend doubles served over real loopback sockets.

- request mapping: what the backend receives for an :class:`ExecutionSpec`, read back from the
  double's recorder;
- response mapping: deltas, finish reason and usage as the backend reported them;
- errors: every failure is a :class:`BackendError` with a stable code, including a backend that
  is not there, one that never answers and one that goes silent mid-stream;
- discovery: ``advertise_all`` and the node's :class:`Router` adding what a backend lists;
- ``aclose`` closes the pooled client.

Every test is bounded by ``trio.fail_after``; the timeout tests use real, short read timeouts
against much longer backend delays, so they finish in well under a second each.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
from attrs import define

from iop_trio.adapters import ADAPTERS, BackendError, Completion, ExecutionSpec
from iop_trio.adapters.http import HttpAdapter
from iop_trio.adapters.ollama import OllamaOptions
from iop_trio.adapters.vllm import VllmOptions
from iop_trio.config import ModelConfig, NodeSettings
from iop_trio.node.router import Router
from iop_trio.wire import ChatMessage, RunRequest, SamplingParams, Usage
from tests.adapters.sinks import RecordingSink
from tests.doubles.backends import WORDS, Behaviour, Recorder, ollama_app, openai_app, serve_double

#: The double's app and the path prefix its adapter's base_url needs.
DOUBLES = {"vllm": (openai_app, "/v1"), "ollama": (ollama_app, "")}
MODEL = "double-model"  # the double's default model
MESSAGES = (ChatMessage("system", "be brief"), ChatMessage("user", "hello there"))
PROMPT = "once upon a time"
PROMPT_WORDS = 4  # what the doubles count as prompt tokens for MESSAGES and for PROMPT
LIMIT = 5.0  # per-test bound for everything that does not wait on purpose


def words(count: int) -> str:
    return " ".join(WORDS[:count])


def make_spec(
    kind: str = "chat",
    *,
    backend_model: str = MODEL,
    params: SamplingParams | None = None,
    options: Any = None,
) -> ExecutionSpec:
    return ExecutionSpec(
        run_id="run-1",
        model="client-model",
        backend_model=backend_model,
        kind=kind,  # type: ignore[arg-type]
        messages=MESSAGES if kind == "chat" else (),
        prompt=PROMPT if kind == "completion" else "",
        params=params or SamplingParams(),
        options=options,
    )


@define
class Backend:
    url: str  # what the adapter's base_url must be
    recorder: Recorder


async def serve_backend(nursery: trio.Nursery, name: str, behaviour: Behaviour) -> Backend:
    app_factory, suffix = DOUBLES[name]
    recorder = Recorder()
    url = await nursery.start(partial(serve_double, app_factory(behaviour, recorder)))
    return Backend(url + suffix, recorder)


def make_adapter(name: str, base_url: str, **config: Any) -> HttpAdapter:
    entry = ADAPTERS[name]
    adapter = entry.factory(entry.config_type(base_url=base_url, **config), {})
    assert isinstance(adapter, HttpAdapter)
    return adapter


@asynccontextmanager
async def adapter_on(
    nursery: trio.Nursery, name: str, behaviour: Behaviour, **config: Any
) -> AsyncIterator[tuple[HttpAdapter, Recorder]]:
    """A double with ``behaviour`` and an adapter pointed at it, closed on the way out."""
    backend = await serve_backend(nursery, name, behaviour)
    adapter = make_adapter(name, backend.url, **config)
    try:
        yield adapter, backend.recorder
    finally:
        await adapter.aclose()


async def closed_port_url() -> str:
    """A loopback URL where nothing listens: bind a port, then give it back."""
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


async def execute_error(adapter: HttpAdapter, spec: ExecutionSpec, sink: RecordingSink) -> BackendError:
    with pytest.raises(BackendError) as info:
        await adapter.execute(spec, sink)
    return info.value


@pytest.fixture(params=sorted(DOUBLES))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


# -- request mapping --------------------------------------------------------------------------

FULL_PARAMS = SamplingParams(max_tokens=3, temperature=0.0, top_p=0.9, stop=("\n", "END"), seed=0)


async def test_vllm_chat_request_carries_every_set_param_and_extra_body(nursery) -> None:
    options = VllmOptions(extra_body={"top_k": 5, "repetition_penalty": 1.1})
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "vllm", Behaviour()) as (adapter, recorder):
            await adapter.execute(make_spec("chat", params=FULL_PARAMS, options=options), RecordingSink())
    (body,) = recorder.requests
    assert body == {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        # falsy but set (temperature 0.0, seed 0) is still sent
        "max_tokens": 3,
        "temperature": 0.0,
        "top_p": 0.9,
        "seed": 0,
        "stop": ["\n", "END"],
        "top_k": 5,
        "repetition_penalty": 1.1,
    }


async def test_vllm_completion_request_sends_only_what_is_set(nursery) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "vllm", Behaviour(tokens=3)) as (adapter, recorder):
            await adapter.execute(make_spec("completion"), sink)
    (body,) = recorder.requests
    assert body == {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": PROMPT,
    }
    # Only /v1/completions answers with choices[].text, which is what the adapter read.
    assert sink.text == words(3)


async def test_vllm_uses_the_backend_model_name(nursery) -> None:
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "vllm", Behaviour(models=("org/Real-7B",))) as (adapter, recorder):
            await adapter.execute(make_spec(backend_model="org/Real-7B"), RecordingSink())
    assert recorder.requests[0]["model"] == "org/Real-7B"


async def test_ollama_chat_request_maps_params_into_options(nursery) -> None:
    # Request params win over the model's options; the model's other options ride along.
    options = OllamaOptions(options={"num_ctx": 4096, "temperature": 0.7, "num_predict": 100})
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "ollama", Behaviour()) as (adapter, recorder):
            await adapter.execute(make_spec("chat", params=FULL_PARAMS, options=options), RecordingSink())
    (body,) = recorder.requests
    assert body == {
        "model": MODEL,
        "stream": True,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        "options": {
            "num_ctx": 4096,
            "num_predict": 3,
            "temperature": 0.0,
            "top_p": 0.9,
            "seed": 0,
            "stop": ["\n", "END"],
        },
    }


async def test_ollama_generate_request_sends_only_what_is_set(nursery) -> None:
    sink = RecordingSink()
    options = OllamaOptions(options={"temperature": 0.7})
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "ollama", Behaviour(tokens=3)) as (adapter, recorder):
            await adapter.execute(make_spec("completion", options=options), sink)
    (body,) = recorder.requests
    # No request temperature: the model's own stays; no keep_alive configured: none sent.
    assert body == {"model": MODEL, "stream": True, "prompt": PROMPT, "options": {"temperature": 0.7}}
    # Only /api/generate answers with "response", which is what the adapter read.
    assert sink.text == words(3)


@pytest.mark.parametrize(
    ("adapter_keep_alive", "model_keep_alive", "sent"),
    [("", "", None), ("10m", "", "10m"), ("10m", "1h", "1h"), ("", "-1", "-1")],
)
async def test_ollama_keep_alive(nursery, adapter_keep_alive, model_keep_alive, sent) -> None:
    options = OllamaOptions(keep_alive=model_keep_alive)
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, "ollama", Behaviour(), keep_alive=adapter_keep_alive) as (adapter, recorder):
            await adapter.execute(make_spec(options=options), RecordingSink())
    assert recorder.requests[0].get("keep_alive") == sent


@pytest.mark.parametrize("backend", ["vllm", "ollama"])
async def test_client_sampling_params_win_over_model_options(nursery, backend) -> None:
    defaults = {"max_tokens": 100, "temperature": 0.7}
    options = (
        VllmOptions(extra_body=defaults)
        if backend == "vllm"
        else OllamaOptions(options={"num_predict": 100, "temperature": 0.7})
    )
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=8)) as (adapter, _):
            completion = await adapter.execute(
                make_spec(params=SamplingParams(max_tokens=2, temperature=0.0), options=options), sink
            )
    assert sink.text == words(2)
    assert completion.finish_reason == "length"


# -- response mapping -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_deltas_usage_and_prompt_tokens(nursery, backend, kind) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=5)) as (adapter, _):
            completion = await adapter.execute(make_spec(kind), sink)
    assert sink.text == words(5)
    assert sink.tokens == 5  # what arrived together is one delta
    assert sink.started_at is not None and sink.started_at <= sink.times[0]
    assert completion == Completion("stop", Usage(PROMPT_WORDS, 5))
    assert sink.prompt_tokens == [PROMPT_WORDS]


@pytest.mark.parametrize(
    ("max_tokens", "finish_reason", "generated"),
    [(3, "length", 3), (5, "stop", 5), (9, "stop", 5), (None, "stop", 5)],
)
async def test_finish_reason_follows_max_tokens(nursery, backend, max_tokens, finish_reason, generated) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=5)) as (adapter, _):
            completion = await adapter.execute(make_spec(params=SamplingParams(max_tokens=max_tokens)), sink)
    assert completion.finish_reason == finish_reason
    assert completion.usage == Usage(PROMPT_WORDS, generated)
    assert sink.text == words(generated)


async def test_one_adapter_serves_runs_concurrently(nursery, backend) -> None:
    sinks = [RecordingSink() for _ in range(4)]
    results: list[Completion] = []

    async def run(adapter: HttpAdapter, sink: RecordingSink, tokens: int) -> None:
        results.append(await adapter.execute(make_spec(params=SamplingParams(max_tokens=tokens)), sink))

    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=6, token_delay=0.01)) as (adapter, recorder):
            async with trio.open_nursery() as runs:
                for index, sink in enumerate(sinks):
                    runs.start_soon(run, adapter, sink, index + 2)
    assert [sink.text for sink in sinks] == [words(n) for n in (2, 3, 4, 5)]
    assert len(recorder.requests) == 4
    assert sorted(c.usage.completion_tokens for c in results if c.usage) == [2, 3, 4, 5]


# -- errors -----------------------------------------------------------------------------------


async def test_unknown_model_is_model_not_found(nursery, backend) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour()) as (adapter, _):
            error = await execute_error(adapter, make_spec(backend_model="no-such-model"), sink)
    assert error.code == "model_not_found"
    assert "no-such-model" in error.message
    assert sink.deltas == []


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (500, "backend_error"),
        (503, "backend_error"),
        (429, "backend_busy"),
        (400, "invalid_request"),
        (422, "invalid_request"),
        (401, "backend_auth"),
        (403, "backend_auth"),
    ],
)
async def test_error_status_maps_to_a_stable_code(nursery, backend, status, code) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(fail_status=status)) as (adapter, _):
            error = await execute_error(adapter, make_spec(), sink)
    assert error.code == code
    assert sink.started_at is None  # refused: the run never started, the client gets a status
    assert "double says no" in error.message  # the backend's own words, from either error shape
    assert sink.deltas == []


# The double itself leaves its token generator un-closed when it sends the garbage line
# (``return`` inside ``async for`` over ``gen.words()``); that is the double's, not the adapter's.
@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_malformed_stream_is_a_protocol_error_after_the_good_deltas(nursery, backend, kind) -> None:
    sink = RecordingSink()
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=8, malformed_after=2)) as (adapter, _):
            error = await execute_error(adapter, make_spec(kind), sink)
    assert error.code == "backend_protocol_error"
    assert sink.text == words(2)
    assert sink.tokens == 2


async def test_nothing_listening_is_backend_unavailable(backend) -> None:
    url = await closed_port_url()
    adapter = make_adapter(backend, url + DOUBLES[backend][1], connect_timeout=2.0)
    sink = RecordingSink()
    try:
        with trio.fail_after(LIMIT):
            error = await execute_error(adapter, make_spec(), sink)
    finally:
        await adapter.aclose()
    assert error.code == "backend_unavailable"
    assert sink.deltas == []


@pytest.mark.parametrize(
    ("behaviour", "text", "phase", "message"),
    [
        # Headers never come: the backend is still queueing the request.
        (Behaviour(queue_delay=5), "", "queued", "no response from backend within 0.3s"),
        # Headers came, then silence before the first token.
        (Behaviour(ttft=5), "", "before_first_token", "backend silent for 0.3s mid-stream"),
        # One token, then silence.
        (Behaviour(tokens=3, token_delay=5), WORDS[0], "mid_stream", "backend silent for 0.3s mid-stream"),
    ],
    ids=["queue_delay", "ttft", "token_delay"],
)
async def test_silent_backend_times_out_and_is_hung_up_on(
    nursery, backend, behaviour, text, phase, message
) -> None:
    sink = RecordingSink()
    with trio.fail_after(3):  # the backend would take 5 s: only the read timeout ends this early
        async with adapter_on(nursery, backend, behaviour, read_timeout=0.3) as (adapter, recorder):
            started = trio.current_time()
            error = await execute_error(adapter, make_spec(), sink)
            elapsed = trio.current_time() - started
            # The adapter closed the connection: the backend saw its client go.
            await recorder.disconnected.wait()
    assert error.code == "backend_timeout"
    assert error.message == message
    assert 0.3 <= elapsed < 2
    assert sink.text == text
    assert [d.phase for d in recorder.disconnects] == [phase]
    assert recorder.completed == 0


# -- discovery --------------------------------------------------------------------------------


async def test_discovery_is_opt_in(nursery, backend) -> None:
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(models=("a", "b"))) as (adapter, _):
            assert await adapter.discover_models() == ()


async def test_discovery_without_opt_in_does_not_ask_the_backend(backend) -> None:
    adapter = make_adapter(backend, await closed_port_url())
    try:
        with trio.fail_after(LIMIT):
            assert await adapter.discover_models() == ()
    finally:
        await adapter.aclose()


async def test_discovery_lists_the_backend_models(nursery, backend) -> None:
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(models=("a", "b")), advertise_all=True) as (adapter, _):
            assert await adapter.discover_models() == ("a", "b")


async def test_discovery_from_a_backend_that_is_down_is_unavailable(backend) -> None:
    adapter = make_adapter(backend, await closed_port_url() + DOUBLES[backend][1], advertise_all=True)
    try:
        with trio.fail_after(LIMIT), pytest.raises(BackendError) as info:
            await adapter.discover_models()
    finally:
        await adapter.aclose()
    assert info.value.code == "backend_unavailable"


def request_for(model: str) -> RunRequest:
    return RunRequest(run_id="run-1", model=model, messages=MESSAGES)


OPTIONS = {
    "vllm": ({"extra_body": {"top_k": 5}}, VllmOptions(extra_body={"top_k": 5})),
    "ollama": ({"keep_alive": "1h", "options": {"num_ctx": 4096}}, OllamaOptions("1h", {"num_ctx": 4096})),
}


async def test_router_adds_discovered_models(nursery, backend) -> None:
    double = await serve_backend(nursery, backend, Behaviour(models=("a", "b")))
    settings = NodeSettings(adapters={backend: {"base_url": double.url, "advertise_all": True}})
    router = Router.from_settings(settings)
    try:
        assert router.models == ()
        with trio.fail_after(LIMIT):
            await router.discover()
        assert router.models == ("a", "b")
        route, spec = router.resolve(request_for("b"))
        assert route.adapter.name == backend
        assert (spec.backend_model, spec.options) == ("b", ADAPTERS[backend].options_type())
        # A discovered model runs like a configured one.
        sink = RecordingSink()
        with trio.fail_after(LIMIT):
            completion = await route.adapter.execute(spec, sink)
        assert completion.finish_reason == "stop"
        assert double.recorder.requests[-1]["model"] == "b"
    finally:
        await router.aclose()


async def test_router_discovery_keeps_configured_models(nursery, backend) -> None:
    raw_options, options = OPTIONS[backend]
    double = await serve_backend(nursery, backend, Behaviour(models=("a", "b", "real-a")))
    settings = NodeSettings(
        adapters={backend: {"base_url": double.url, "advertise_all": True}},
        models=(ModelConfig(name="a", adapter=backend, backend_model="real-a", options=raw_options),),
    )
    router = Router.from_settings(settings)
    try:
        with trio.fail_after(LIMIT):
            await router.discover()
            await router.discover()  # asking again changes nothing
        assert router.models == ("a", "b", "real-a")
        _, spec = router.resolve(request_for("a"))
        assert (spec.backend_model, spec.options) == ("real-a", options)
        _, spec = router.resolve(request_for("real-a"))
        assert (spec.backend_model, spec.options) == ("real-a", ADAPTERS[backend].options_type())
    finally:
        await router.aclose()


async def test_router_skips_a_backend_that_is_down(nursery, caplog) -> None:
    caplog.set_level(logging.INFO, logger="iop_trio.node")
    double = await serve_backend(nursery, "ollama", Behaviour(models=("from-ollama",)))
    settings = NodeSettings(
        adapters={
            "vllm": {"base_url": await closed_port_url() + "/v1", "advertise_all": True},
            "ollama": {"base_url": double.url, "advertise_all": True},
        },
        models=(ModelConfig(name="configured", adapter="vllm"),),
    )
    router = Router.from_settings(settings)
    try:
        with trio.fail_after(LIMIT):
            await router.discover()  # no exception
        # The backend that is down is skipped; the next one is still asked.
        assert router.models == ("configured", "from-ollama")
    finally:
        await router.aclose()
    failures = [r for r in caplog.records if r.getMessage() == "model discovery failed"]
    assert len(failures) == 1
    assert failures[0].levelno == logging.WARNING
    assert failures[0].adapter == "vllm"  # type: ignore[attr-defined]


# -- aclose -----------------------------------------------------------------------------------


async def test_aclose_closes_the_client(nursery, backend) -> None:
    with trio.fail_after(LIMIT):
        async with adapter_on(nursery, backend, Behaviour(tokens=2)) as (adapter, recorder):
            await adapter.execute(make_spec(), RecordingSink())
            assert not adapter._client.closed
            await adapter.aclose()
            assert adapter._client.closed
            with pytest.raises(RuntimeError, match="closed"):
                await adapter.execute(make_spec(), RecordingSink())
    assert len(recorder.requests) == 1  # the closed adapter sent nothing


async def test_router_aclose_closes_every_adapter() -> None:
    router = Router.from_settings(NodeSettings(adapters={"vllm": {}, "ollama": {}}))
    adapters = list(router._adapters.values())
    assert sorted(type(a).__name__ for a in adapters) == ["OllamaAdapter", "VllmAdapter"]
    with trio.fail_after(LIMIT):
        await router.aclose()
    assert all(isinstance(a, HttpAdapter) and a._client.closed for a in adapters)
