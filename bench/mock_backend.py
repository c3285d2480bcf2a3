"""A fast OpenAI-compatible mock backend for the bench (raw asyncio, no HTTP framework).

Why raw asyncio: the backend must never be what limits a measurement. A framework (quart,
starlette) costs 100-300 us per request; this one answers a non-streaming request, or a whole
16-token stream without delays, from ``data_received`` in one ``write`` with no task at all.

What it serves:
  POST /v1/chat/completions, POST /v1/completions   stream and non-stream, OpenAI's shapes and
                                                    SSE chunks, usage with stream_options.include_usage
  GET  /v1/models                                   one model per ``--model``
  GET  /_stats                                      counters and every recorded client disconnect
  POST /_reset                                      forget the disconnects

Per-request knobs ride in the prompt text (the only part every gateway forwards unchanged):
``bench:tag=abc bench:tokens=100 bench:delay=0.05 bench:ttft=2 bench:pool=q bench:slots=1``.
``pool``/``slots`` model a backend's waiting queue (vLLM's scheduler queue): at most ``slots``
requests of a pool generate at once, the others wait in phase ``queued``.

A client that disconnects while its request is in progress is recorded with the time
(``time.monotonic()``, CLOCK_MONOTONIC, comparable across processes on one host) and the phase:
``queued``, ``before_first_token``, ``mid_stream`` (stream with tokens sent) or ``non_stream``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

DIRECTIVE = re.compile(r"bench:(\w+)=([\w.\-]+)")
WORD = " tok"
MAX_HEADER = 64 * 1024


class Settings:
    def __init__(self, tokens: int = 16, delay: float = 0.0, ttft: float = 0.0, models: tuple[str, ...] = ("bench",)) -> None:
        self.tokens = tokens
        self.delay = delay
        self.ttft = ttft
        self.models = models


class Stats:
    """What the bench reads back: counters and the disconnect log."""

    def __init__(self) -> None:
        self.requests = 0
        self.completed = 0
        #: TCP connections accepted: a gateway that pools connections opens few.
        self.connections = 0
        self.disconnects: list[dict[str, Any]] = []
        self.pools: dict[str, asyncio.Semaphore] = {}

    def pool(self, name: str, slots: int) -> asyncio.Semaphore:
        if name not in self.pools:
            self.pools[name] = asyncio.Semaphore(slots)
        return self.pools[name]

    def as_json(self, tag: str | None) -> bytes:
        disconnects = [d for d in self.disconnects if tag is None or d["tag"] == tag]
        return json.dumps(
            {"requests": self.requests, "completed": self.completed, "connections": self.connections, "disconnects": disconnects}
        ).encode()


class Job:
    """One request's generation parameters and progress (its phase is what a disconnect records)."""

    __slots__ = ("chat", "stream", "usage", "model", "tokens", "finish", "delay", "ttft", "tag", "pool", "slots", "phase", "sent", "prompt_tokens")

    def __init__(self, chat: bool, body: dict[str, Any], settings: Settings) -> None:
        self.chat = chat
        self.stream = bool(body.get("stream"))
        self.usage = bool((body.get("stream_options") or {}).get("include_usage")) if self.stream else True
        self.model = str(body.get("model") or "bench")
        text = _prompt(body, chat)
        knobs = dict(DIRECTIVE.findall(text)) if "bench:" in text else {}
        self.prompt_tokens = len(text.split())
        tokens = int(knobs.get("tokens", settings.tokens))
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        self.finish = "stop"
        if isinstance(limit, int) and 0 < limit < tokens:
            tokens, self.finish = limit, "length"
        self.tokens = tokens
        self.delay = float(knobs.get("delay", settings.delay))
        self.ttft = float(knobs.get("ttft", settings.ttft))
        self.tag = knobs.get("tag", "")
        self.pool = knobs.get("pool", "")
        self.slots = int(knobs.get("slots", 1))
        self.phase = "queued" if self.pool else "before_first_token"
        self.sent = 0

    @property
    def instant(self) -> bool:
        return not (self.delay or self.ttft or self.pool)


def _prompt(body: dict[str, Any], chat: bool) -> str:
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else " ".join(map(str, prompt or ()))
    parts = []
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
    return "\n".join(parts)


# ---- response bodies -----------------------------------------------------------------------

def _usage(job: Job) -> dict[str, int]:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.tokens, "total_tokens": job.prompt_tokens + job.tokens}


def full_body(job: Job, rid: str) -> bytes:
    text = (WORD * job.tokens)[1:]
    if job.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": job.finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": job.model, "choices": [choice], "usage": _usage(job)}
    return json.dumps(body, separators=(",", ":")).encode()


class ChunkMaker:
    """SSE events of one stream, each wrapped as one HTTP/1.1 chunk."""

    def __init__(self, job: Job, rid: str) -> None:
        self.job = job
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        self.head = f'data: {{"id":"{rid}","object":"{obj}","created":{int(time.time())},"model":{json.dumps(job.model)},"choices":['

    def _event(self, payload: str) -> bytes:
        data = (payload + "\n\n").encode()
        return b"%x\r\n%b\r\n" % (len(data), data)

    def _choice(self, content: str | None, finish: str | None, role: bool = False) -> bytes:
        fin = "null" if finish is None else f'"{finish}"'
        if self.job.chat:
            delta = {} if content is None else ({"role": "assistant", "content": content} if role else {"content": content})
            inner = f'{{"index":0,"delta":{json.dumps(delta, separators=(",", ":"))},"finish_reason":{fin}}}'
        else:
            inner = f'{{"index":0,"text":{json.dumps(content or "")},"logprobs":null,"finish_reason":{fin}}}'
        return self._event(self.head + inner + "]}")

    def first(self) -> bytes:
        return self._choice("", None, role=True) if self.job.chat else b""

    def token(self, index: int) -> bytes:
        return self._choice(WORD if index else WORD[1:], None)

    def tail(self) -> bytes:
        out = self._choice(None if self.job.chat else "", self.job.finish)
        if self.job.usage:
            out += self._event(self.head + '],"usage":' + json.dumps(_usage(self.job), separators=(",", ":")) + "}")
        return out + self._event("data: [DONE]") + b"0\r\n\r\n"


def http_head(status: int, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    reason = {200: "OK", 404: "Not Found", 400: "Bad Request", 405: "Method Not Allowed"}.get(status, "OK")
    framing = f"content-length: {length}" if length is not None else "transfer-encoding: chunked\r\ncache-control: no-cache"
    conn = "keep-alive" if keep_alive else "close"
    return f"HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\n{framing}\r\nconnection: {conn}\r\n\r\n".encode()


# ---- the protocol --------------------------------------------------------------------------

class BackendProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, one request at a time per connection (what every client here does)."""

    counter = 0

    def __init__(self, settings: Settings, stats: Stats) -> None:
        self.settings = settings
        self.stats = stats
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.job: Job | None = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.stats.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.job is None:
            self._process()

    def eof_received(self) -> bool:
        self._client_gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._client_gone()

    def _client_gone(self) -> None:
        if self.closed:
            return
        self.closed = True
        job = self.job
        if job is not None:
            phase = job.phase
            if phase == "before_first_token" and not job.stream:
                phase = "non_stream"
            elif phase == "streaming":
                phase = "mid_stream" if job.stream else "non_stream"
            self.stats.disconnects.append(
                {"tag": job.tag, "phase": phase, "t": time.monotonic(), "tokens_sent": job.sent, "stream": job.stream}
            )
        if self.task is not None:
            self.task.cancel()

    def _process(self) -> None:
        while self.job is None and not self.closed:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEADER:
                    self._close()
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            method, target, _ = head[0].split(" ", 2)
            headers = {}
            for line in head[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            keep_alive = headers.get("connection", "").lower() != "close"
            self._dispatch(method, target, body, keep_alive)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _respond(self, status: int, body: bytes, keep_alive: bool, content_type: str = "application/json") -> None:
        self._write(http_head(status, content_type, len(body), keep_alive) + body)
        if not keep_alive:
            self._close()

    def _dispatch(self, method: str, target: str, raw: bytes, keep_alive: bool) -> None:
        path, _, query = target.partition("?")
        if path in ("/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions"):
            if method != "POST":
                self._respond(405, b'{"error":{"message":"method not allowed"}}', keep_alive)
                return
            try:
                body = json.loads(raw)
                job = Job("chat" in path, body, self.settings)
            except (ValueError, TypeError, AttributeError) as exc:
                self._respond(400, json.dumps({"error": {"message": f"bad request: {exc}"}}).encode(), keep_alive)
                return
            self.stats.requests += 1
            BackendProtocol.counter += 1
            rid = ("chatcmpl-" if job.chat else "cmpl-") + str(BackendProtocol.counter)
            if job.instant:
                self._instant(job, rid, keep_alive)
            else:
                self.job = job
                self.task = asyncio.get_running_loop().create_task(self._generate(job, rid, keep_alive))
        elif path in ("/v1/models", "/models"):
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "mock"} for m in self.settings.models]
            self._respond(200, json.dumps({"object": "list", "data": data}).encode(), keep_alive)
        elif path == "/_stats":
            tag = query[4:] if query.startswith("tag=") else None
            self._respond(200, self.stats.as_json(tag), keep_alive)
        elif path == "/_reset":
            self.stats.disconnects.clear()
            self._respond(200, b"{}", keep_alive)
        elif path == "/health":
            self._respond(200, b'{"status":"ok"}', keep_alive)
        else:
            self._respond(404, b'{"error":{"message":"not found"}}', keep_alive)

    def _instant(self, job: Job, rid: str, keep_alive: bool) -> None:
        """No delay anywhere: the whole response in one write, no task."""
        self.stats.completed += 1
        if not job.stream:
            self._respond(200, full_body(job, rid), keep_alive)
            return
        maker = ChunkMaker(job, rid)
        parts = [http_head(200, "text/event-stream", None, keep_alive), maker.first()]
        parts += [maker.token(i) for i in range(job.tokens)]
        parts.append(maker.tail())
        self._write(b"".join(parts))
        if not keep_alive:
            self._close()

    async def _generate(self, job: Job, rid: str, keep_alive: bool) -> None:
        try:
            if job.pool:
                async with self.stats.pool(job.pool, job.slots):
                    await self._run(job, rid, keep_alive)
            else:
                await self._run(job, rid, keep_alive)
        except asyncio.CancelledError:
            return
        self.stats.completed += 1
        self.job = None
        self.task = None
        if not keep_alive:
            self._close()
        elif self.buffer:
            self._process()

    async def _run(self, job: Job, rid: str, keep_alive: bool) -> None:
        job.phase = "before_first_token"
        if job.stream:
            maker = ChunkMaker(job, rid)
            # Like vLLM: headers at once, the role chunk only with the first token, so a gateway
            # that notices a gone client only when it next writes cannot notice before then.
            self._write(http_head(200, "text/event-stream", None, keep_alive))
        if job.ttft:
            await asyncio.sleep(job.ttft)
        for index in range(job.tokens):
            if index and job.delay:
                await asyncio.sleep(job.delay)
            job.phase = "streaming"
            job.sent += 1
            if job.stream:
                self._write((maker.first() if index == 0 else b"") + maker.token(index))
        if job.stream:
            self._write(maker.tail())
        else:
            body = full_body(job, rid)
            self._write(http_head(200, "application/json", len(body), keep_alive) + body)


async def serve(host: str, port: int, settings: Settings) -> None:
    loop = asyncio.get_running_loop()
    stats = Stats()
    server = await loop.create_server(lambda: BackendProtocol(settings, stats), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()
    print(f"ready: http=http://{bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0 picks one)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per response")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds between tokens")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before the first token")
    parser.add_argument("--model", action="append", dest="models", help="model id to list (repeatable)")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    settings = Settings(args.tokens, args.delay, args.ttft, tuple(args.models or ["bench"]))
    try:
        import uvloop  # optional: faster still, never required

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(host or "127.0.0.1", int(port), settings))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
