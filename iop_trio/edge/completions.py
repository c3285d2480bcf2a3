"""Serving one chat or text completion, whatever the HTTP layer: the key's policy, the run, and
the response (one JSON body, or an SSE stream) handed to a :class:`Reply`.

A streaming response waits for the node's ``start`` event before sending headers, so a request
that fails at once (unknown model on the node, node busy) still gets a proper HTTP status. After
that, errors arrive as an SSE ``error`` event and the stream ends without ``[DONE]``.

``serve`` owns the run: whatever ends it (the end of the response, an error, the handler being
cancelled because the client went away), ``EdgeRun.close`` in its ``finally`` runs, and that is
what sends ``cancel.request`` to the node.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from ..controlplane import KeyLimits, NoNodeAvailable, RateLimited
from .errors import ApiError
from .openai_format import SSE_DONE, ResponseShaper, sse
from .openai_requests import ParsedRequest
from .runs import EdgeRun
from .state import EdgeState


class Reply(Protocol):
    """The HTTP side of one response."""

    async def json(self, body: dict[str, Any]) -> None:
        """A whole 200 JSON response."""

    async def open_stream(self) -> None:
        """The headers of a 200 SSE response; the body follows through ``write``."""

    async def write(self, chunk: bytes) -> None: ...


async def serve(
    state: EdgeState, parsed: ParsedRequest, priority: int, limits: KeyLimits | None, reply: Reply
) -> None:
    """Answer one request through ``reply``; a refusal before any byte is sent raises ApiError."""
    if limits is not None:
        admit(limits, parsed.model)
    try:
        run = await EdgeRun.open(state, parsed, priority, limits)
    except NoNodeAvailable as exc:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        kind = "invalid_request_error" if exc.status == 404 else "server_error"
        raise ApiError(exc.status, exc.message, type=kind, code=exc.code, headers=headers) from exc
    prefix = "chatcmpl-" if parsed.kind == "chat" else "cmpl-"
    shaper = ResponseShaper(parsed.kind, prefix + run.id, parsed.model, int(time.time()), parsed.include_usage)
    try:
        # Wait for the node to start the run: an immediate failure is still an HTTP status.
        await run.next_event()
        if not parsed.stream:
            body = await collect(run, shaper)
            # Closed before the reply: its history row and token charge land before the client
            # can send its next request.
            await run.close()
            await reply.json(body)
            return
        await reply.open_stream()
        await stream(run, shaper, reply.write)
    finally:
        await run.close()


def admit(limits: KeyLimits, model: str) -> None:
    """The key's model allow-list (403), then its rate limits (429)."""
    if not limits.allows_model(model):
        raise ApiError(403, f"This API key may not use the model `{model}`.", code="model_not_allowed", param="model")
    try:
        limits.admit()
    except RateLimited as exc:
        raise ApiError(
            429, exc.message, type="requests", code="rate_limit_exceeded",
            headers={"Retry-After": str(exc.retry_after)},
        ) from exc


async def collect(run: EdgeRun, shaper: ResponseShaper) -> dict[str, Any]:
    pieces: list[str] = []
    while (event := await run.next_event()).kind != "complete":
        pieces.append(event.text)
    return shaper.complete("".join(pieces), run.finish_reason, run.final_usage())


async def stream(run: EdgeRun, shaper: ResponseShaper, write: Callable[[bytes], Awaitable[None]]) -> None:
    """The SSE body. What is ready goes out in one write (one trip through the HTTP server and
    one syscall, not one per chunk); a write happens only before waiting for the node, so
    nothing that has arrived is ever held back."""
    pending: list[bytes] = [shaper.chunk("", first=True)] if shaper.kind == "chat" else []
    try:
        while True:
            if pending and not run.event_ready():
                await write(b"".join(pending))
                pending = []
            event = await run.next_event()
            if event.kind == "complete":
                break
            pending.append(shaper.chunk(event.text))
        pending.append(shaper.chunk(None if shaper.kind == "chat" else "", run.finish_reason))
        if shaper.include_usage:
            pending.append(shaper.usage_chunk(run.final_usage()))
        pending.append(SSE_DONE)
    except ApiError as error:
        pending.append(sse(error.body()))
    await write(b"".join(pending))
