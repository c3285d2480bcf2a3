"""System (e): hypercorn alone, serving a fixed chat completion from a bare ASGI app.

The floor under the edge: DESIGN.md fixes hypercorn as the edge's HTTP server, so no edge can
cost less per request than this. Nothing is forwarded anywhere; every POST gets the same answer
the edge would give for the bench's request (16 words, JSON or SSE when the body asks to
stream), sent as one ``http.response.body`` like the edge's fast path does when all is ready.

    python bench/http_floor.py --listen 127.0.0.1:0      # prints "ready: http=http://HOST:PORT"
"""

from __future__ import annotations

import argparse
import json
import socket
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

WORDS = " ".join(f"tok{i}" for i in range(16))
CREATED = 1700000000


def completion_body() -> bytes:
    return json.dumps({
        "id": "chatcmpl-floor", "object": "chat.completion", "created": CREATED, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": WORDS}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 16, "total_tokens": 24},
    }, separators=(",", ":")).encode()


def stream_body() -> bytes:
    def event(delta: dict[str, Any], finish: str | None) -> bytes:
        chunk = {"id": "chatcmpl-floor", "object": "chat.completion.chunk", "created": CREATED, "model": "bench",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

    events = [event({"role": "assistant", "content": WORDS}, None), event({}, "stop"), b"data: [DONE]\n\n"]
    return b"".join(events)


ANSWERS = {
    False: (b"application/json", completion_body()),
    True: (b"text/event-stream", stream_body()),
}


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    streaming = bool(body) and json.loads(body).get("stream") is True
    content_type, answer = ANSWERS[streaming]
    headers = [(b"content-type", content_type)]
    if not streaming:  # a stream goes out chunked, as the edge's does
        headers.append((b"content-length", str(len(answer)).encode()))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    args = parser.parse_args()
    host, port = args.listen.rsplit(":", 1)
    # Bind here so port 0 works and the ready line names the real port.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(1024)
    config = Config()
    config.bind = [f"fd://{sock.fileno()}"]
    config.accesslog = None
    config.keep_alive_timeout = 75  # as the edge's
    print(f"ready: http=http://{host}:{sock.getsockname()[1]}", flush=True)
    await serve(app, config)  # type: ignore[arg-type]


if __name__ == "__main__":
    trio.run(main)
