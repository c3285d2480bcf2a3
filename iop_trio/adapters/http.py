"""What the HTTP adapters share: one pooled backend client each, deadlines as cancel scopes, the
body read as batches of lines, and backend failures mapped to stable :class:`BackendError` codes.

Upstream calls always stream, even for a client's non-streaming request: closing the connection
is then the one way to tell the backend to stop, and it happens as soon as the run's scope is
cancelled (``async with`` exits before the body's end, the client hangs up).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
from attrs import field, frozen
from attrs.validators import gt

from .backend_client import (
    BackendClient,
    BackendConnectionError,
    BackendResponse,
    BackendUnreachable,
)
from .base import BackendError, Capabilities

ERROR_BODY_LIMIT = 4096
LISTING_LIMIT = 8 * 1024 * 1024
#: After the stream's last event, how long the body's end may take before we hang up instead
#: (the connection is then not reused; a backend that keeps the body open must not hold a run).
BODY_END_GRACE = 1.0
#: ``raw_decode`` on a stripped line: half the cost of ``json.loads`` (which wraps it in two more
#: calls and two whitespace regexes), paid once per streamed chunk.
_JSON_DECODE = json.JSONDecoder().raw_decode


@frozen
class HttpBackendConfig:
    """The ``adapters.<name>`` block of an HTTP backend."""

    base_url: str
    api_key: str = ""
    #: Seconds to establish the TCP connection.
    connect_timeout: float = field(default=5.0, validator=gt(0))
    #: Longest silence tolerated from the backend: before the response headers (queueing and
    #: prompt processing included) and between two chunks of the stream.
    read_timeout: float = field(default=300.0, validator=gt(0))
    max_connections: int = field(default=64, validator=gt(0))
    #: Also serve every model the backend lists, under its own name (opt-in).
    advertise_all: bool = False


class HttpAdapter:
    """What every HTTP adapter shares: its pooled client, its model table, model discovery.

    Subclasses set ``models_path`` and ``models_key``/``model_name_key`` to say where the
    backend's model list is (``GET /models`` -> ``data[].id``; Ollama's ``/api/tags`` ->
    ``models[].name``) and implement ``execute``.
    """

    name: str
    models_path: str
    models_key: str
    model_name_key: str

    def __init__(self, config: HttpBackendConfig, models: dict[str, Any]) -> None:
        self.config = config
        self._models = models
        self._client = make_client(config)

    def capabilities(self) -> Capabilities:
        return Capabilities(models=tuple(self._models))

    async def discover_models(self) -> tuple[str, ...]:
        if not self.config.advertise_all:
            return ()
        listing = await get_json(self._client, self.models_path, self.config.read_timeout)
        try:
            return tuple(str(model[self.model_name_key]) for model in listing[self.models_key])
        except (KeyError, TypeError) as exc:
            raise BackendError("backend_protocol_error", f"GET {self.models_path}: unexpected shape") from exc

    async def aclose(self) -> None:
        await self._client.aclose()


def make_client(config: HttpBackendConfig) -> BackendClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return BackendClient(
        config.base_url, headers=headers, max_connections=config.max_connections,
        connect_timeout=config.connect_timeout,
    )


def status_error(status: int, detail: str) -> BackendError:
    """Map a backend's HTTP error status to the code the edge turns into an OpenAI error."""
    if status == 404:
        return BackendError("model_not_found", detail)
    if status in (400, 422):
        return BackendError("invalid_request", detail)
    if status in (401, 403):
        return BackendError("backend_auth", f"backend refused our credentials: {detail}")
    if status == 429:
        return BackendError("backend_busy", detail)
    return BackendError("backend_error", f"backend answered {status}: {detail}")


def error_detail(body: bytes) -> str:
    """The human part of an error body: OpenAI's ``error.message``, Ollama's ``error``, or text."""
    text = body[:ERROR_BODY_LIMIT].decode("utf-8", errors="replace").strip()
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError):
        return text or "(empty body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or text)


@asynccontextmanager
async def open_stream(
    client: BackendClient, path: str, body: dict[str, Any], read_timeout: float
) -> AsyncIterator[BackendResponse]:
    """POST ``body`` and yield the streaming response once its headers say success."""
    payload = json.dumps(body, separators=(",", ":")).encode()
    async with AsyncExitStack() as stack:
        try:
            with trio.fail_after(read_timeout):
                response = await stack.enter_async_context(client.request("POST", path, payload))
        except trio.TooSlowError as exc:
            raise BackendError("backend_timeout", f"no response from backend within {read_timeout:g}s") from exc
        except BackendUnreachable as exc:
            raise BackendError("backend_unavailable", f"cannot reach backend at {client.base_url}: {exc}") from exc
        except BackendConnectionError as exc:
            raise BackendError("backend_error", f"backend connection failed: {exc}") from exc
        if response.status >= 400:
            raise status_error(response.status, await _error_body(response, min(read_timeout, 5.0)))
        try:
            yield response
        except BackendConnectionError as exc:
            raise BackendError("backend_error", f"backend connection broke mid-stream: {exc}") from exc


async def _error_body(response: BackendResponse, wait: float) -> str:
    """What the backend said about its error status, as far as it arrives within ``wait``."""
    with trio.move_on_after(wait):
        try:
            return error_detail(await response.read(ERROR_BODY_LIMIT))
        except BackendConnectionError as exc:
            return f"(error body cut off: {exc})"
    return f"(no error body within {wait:g}s)"


class LineReader:
    """A response body as batches of non-empty lines: each batch is what the network delivered
    together, so an adapter forwards it as one delta. A backend silent for ``read_timeout``
    is an error."""

    def __init__(self, response: BackendResponse, read_timeout: float) -> None:
        self._response = response
        self._read_timeout = read_timeout
        self._partial = b""

    async def next_batch(self) -> list[str] | None:
        """The next lines, or ``None`` at the end of the body."""
        while True:
            with trio.move_on_after(self._read_timeout) as silence:
                data = await self._response.receive_some()
            if silence.cancelled_caught:
                raise BackendError("backend_timeout", f"backend silent for {self._read_timeout:g}s mid-stream")
            if not data:
                last, self._partial = self._partial, b""
                return _decode_lines([last]) or None
            *lines, self._partial = (self._partial + data).split(b"\n")
            if batch := _decode_lines(lines):
                return batch

    async def finish(self) -> None:
        """Read what is left of the body (normally just its end), so the connection is reused;
        a backend that does not end it soon is hung up on instead."""
        with trio.move_on_after(BODY_END_GRACE):
            while await self._response.receive_some():
                pass


def _decode_lines(lines: list[bytes]) -> list[str]:
    decoded = (line.decode("utf-8", errors="replace").strip() for line in lines)
    return [line for line in decoded if line]


def parse_json_line(line: str, what: str) -> dict[str, Any]:
    """One JSON object from a line without surrounding whitespace (as LineReader gives them)."""
    try:
        data, end = _JSON_DECODE(line)
        if end != len(line):
            raise ValueError("extra data after the JSON value")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
        raise BackendError("backend_protocol_error", f"malformed {what}: {line[:200]!r}") from exc
    if not isinstance(data, dict):
        raise BackendError("backend_protocol_error", f"malformed {what}: not an object")
    return data


async def get_json(client: BackendClient, path: str, read_timeout: float) -> Any:
    """GET a small JSON document (model lists); failures are BackendErrors."""
    try:
        with trio.fail_after(read_timeout):
            async with client.request("GET", path) as response:
                status, body = response.status, await response.read(LISTING_LIMIT)
    except trio.TooSlowError as exc:
        raise BackendError("backend_timeout", f"GET {path} took over {read_timeout:g}s") from exc
    except (BackendUnreachable, BackendConnectionError) as exc:
        raise BackendError("backend_unavailable", f"cannot reach backend at {client.base_url}: {exc}") from exc
    if status >= 400:
        raise status_error(status, error_detail(body))
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BackendError("backend_protocol_error", f"GET {path} did not return JSON") from exc
