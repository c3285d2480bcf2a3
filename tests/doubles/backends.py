"""Doubles of an OpenAI-compatible server and of Ollama, served over real HTTP (hypercorn).

They speak the documented wire formats (OpenAI SSE chunks with ``data: [DONE]``, Ollama NDJSON
with ``done``/``done_reason``/``eval_count``), take configurable delays for each phase of a
request, and record when and in which phase a client went away, so tests can prove that a
cancelled run really stopped the backend.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import trio
from attrs import define, field
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()


@define
class Behaviour:
    tokens: int = 8
    queue_delay: float = 0.0  # before the response headers (the backend's own queue)
    ttft: float = 0.0  # after the headers, before the first token
    token_delay: float = 0.0
    models: tuple[str, ...] = ("double-model",)
    #: Answer every generation request with this HTTP status and error body.
    fail_status: int | None = None
    #: Send this many tokens, then garbage instead of a well-formed line.
    malformed_after: int | None = None


@define
class Disconnect:
    phase: str  # "queued" | "before_first_token" | "mid_stream"
    at: float  # trio.current_time()
    tokens_sent: int


@define
class Recorder:
    requests: list[dict[str, Any]] = field(factory=list)
    disconnects: list[Disconnect] = field(factory=list)
    completed: int = 0
    disconnected: trio.Event = field(factory=trio.Event)
    #: Phase markers, so a test can act at an exact point of a request's life.
    received: trio.Event = field(factory=trio.Event)
    streaming: trio.Event = field(factory=trio.Event)  # headers sent, waiting for the first token
    first_token: trio.Event = field(factory=trio.Event)

    def record_disconnect(self, phase: str, tokens_sent: int) -> None:
        self.disconnects.append(Disconnect(phase, trio.current_time(), tokens_sent))
        self.disconnected.set()


class _Generation:
    """One request's life on the double: queue, first token, tokens; disconnects recorded."""

    def __init__(self, behaviour: Behaviour, recorder: Recorder, max_tokens: int | None) -> None:
        self.behaviour = behaviour
        self.recorder = recorder
        self.count = behaviour.tokens if max_tokens is None else min(max_tokens, behaviour.tokens)
        self.sent = 0

    async def queue(self) -> None:
        self.recorder.received.set()
        try:
            await trio.sleep(self.behaviour.queue_delay)
        except trio.Cancelled:
            self.recorder.record_disconnect("queued", 0)
            raise

    async def words(self) -> AsyncGenerator[str, None]:
        phase = "before_first_token"
        self.recorder.streaming.set()
        try:
            await trio.sleep(self.behaviour.ttft)
            for index in range(self.count):
                if index:
                    await trio.sleep(self.behaviour.token_delay)
                yield WORDS[index % len(WORDS)] if index == 0 else " " + WORDS[index % len(WORDS)]
                self.sent += 1
                phase = "mid_stream"
                self.recorder.first_token.set()
        except trio.Cancelled:
            self.recorder.record_disconnect(phase, self.sent)
            raise
        except GeneratorExit:
            self.recorder.record_disconnect(phase, self.sent)
            raise
        self.recorder.completed += 1

    @property
    def finish_reason(self) -> str:
        return "length" if self.count < self.behaviour.tokens else "stop"


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def openai_app(behaviour: Behaviour, recorder: Recorder) -> QuartTrio:
    app = QuartTrio(__name__)

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "double"} for m in behaviour.models]
        return _json({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return await generate(chat=True)

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generate(chat=False)

    async def generate(chat: bool) -> Response:
        body = await request.get_json()
        recorder.requests.append(body)
        if behaviour.fail_status:
            return _json({"error": {"message": "double says no", "type": "server_error"}}, behaviour.fail_status)
        if body.get("model") not in behaviour.models:
            error = {"message": f"The model `{body.get('model')}` does not exist.", "type": "invalid_request_error"}
            return _json({"error": error}, 404)
        gen = _Generation(behaviour, recorder, body.get("max_tokens"))
        await gen.queue()
        ident, created, model = "chatcmpl-double", int(time.time()), body["model"]
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": gen.count,
                 "total_tokens": _prompt_tokens(body) + gen.count}
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        if not body.get("stream"):
            text = "".join([w async for w in gen.words()])
            message = {"index": 0, "finish_reason": gen.finish_reason, "logprobs": None}
            message.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return _json({"id": ident, "object": kind, "created": created, "model": model,
                          "choices": [message], "usage": usage})

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def sse() -> AsyncIterator[bytes]:
            envelope = {"id": ident, "object": kind + (".chunk" if chat else ""), "created": created, "model": model}
            async with aclosing(gen.words()) as words:
                async for word in words:
                    if behaviour.malformed_after is not None and gen.sent >= behaviour.malformed_after:
                        yield b"data: {not json\n\n"
                        return
                    yield _sse({**envelope, "choices": [choice(word, None)]})
            yield _sse({**envelope, "choices": [choice(None, gen.finish_reason)]})
            if include_usage:
                yield _sse({**envelope, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return Response(sse(), content_type="text/event-stream")

    return app


def ollama_app(behaviour: Behaviour, recorder: Recorder) -> QuartTrio:
    app = QuartTrio(__name__)

    @app.get("/api/tags")
    async def tags() -> Response:
        models = [{"name": m, "model": m, "modified_at": "2026-11-01T00:00:00Z", "size": 1,
                   "digest": "0" * 64, "details": {"format": "gguf", "family": "double"}} for m in behaviour.models]
        return _json({"models": models})

    @app.post("/api/chat")
    async def chat() -> Response:
        return await generate(lambda word: {"message": {"role": "assistant", "content": word}})

    @app.post("/api/generate")
    async def generate_route() -> Response:
        return await generate(lambda word: {"response": word})

    async def generate(piece: Callable[[str], dict[str, Any]]) -> Response:
        body = await request.get_json()
        recorder.requests.append(body)
        if behaviour.fail_status:
            return _json({"error": "double says no"}, behaviour.fail_status)
        if body.get("model") not in behaviour.models:
            return _json({"error": f"model '{body.get('model')}' not found"}, 404)
        options = body.get("options") or {}
        gen = _Generation(behaviour, recorder, options.get("num_predict"))
        await gen.queue()
        model = body["model"]

        def line(data: dict[str, Any]) -> bytes:
            stamp = {"model": model, "created_at": "2026-11-29T00:00:00.000000Z"}
            return json.dumps({**stamp, **data}).encode() + b"\n"

        final = {"done": True, "done_reason": gen.finish_reason, "total_duration": 1, "load_duration": 1,
                 "prompt_eval_count": _prompt_tokens(body), "prompt_eval_duration": 1,
                 "eval_count": gen.count, "eval_duration": 1}
        if body.get("stream") is False:
            text = "".join([w async for w in gen.words()])
            return Response(line({**piece(text), **final}), content_type="application/json")

        async def ndjson() -> AsyncIterator[bytes]:
            async with aclosing(gen.words()) as words:
                async for word in words:
                    if behaviour.malformed_after is not None and gen.sent >= behaviour.malformed_after:
                        yield b"{not json\n"
                        return
                    yield line({**piece(word), "done": False})
            yield line({**piece(""), **final})

        return Response(ndjson(), content_type="application/x-ndjson")

    return app


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status=status, content_type="application/json")


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def serve_double(
    app: QuartTrio, host: str = "127.0.0.1", port: int = 0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on a loopback port; reports ``http://host:port``."""
    config = HypercornConfig()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = None

    async def started(task_status: trio.TaskStatus[list[str]]) -> None:
        await serve(app, config, task_status=task_status)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(started)
        task_status.started(binds[0])
