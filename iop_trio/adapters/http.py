"""What the HTTP adapters share: one pooled client per backend, deadlines as cancel scopes, and
backend failures mapped to stable :class:`BackendError` codes.

Upstream calls always stream, even for a client's non-streaming request: closing the response is
then the one way to tell the backend to stop, and it happens as soon as the run's scope is
cancelled (``async with`` exits, httpx closes the connection).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import httpx
import trio
from attrs import field, frozen
from attrs.validators import gt

from .base import BackendError, Capabilities

ERROR_BODY_LIMIT = 4096


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


def make_client(config: HttpBackendConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    return httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"),
        headers=headers,
        limits=httpx.Limits(
            max_connections=config.max_connections, max_keepalive_connections=config.max_connections
        ),
        # Connect is httpx's; reads are bounded by our own cancel scopes (see read_lines).
        timeout=httpx.Timeout(None, connect=config.connect_timeout),
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
    except ValueError:
        return text or "(empty body)"
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or text)


@asynccontextmanager
async def open_stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], read_timeout: float
) -> AsyncIterator[httpx.Response]:
    """POST ``body`` and yield the streaming response once its headers say success."""
    request = client.build_request("POST", path, json=body)
    try:
        with trio.fail_after(read_timeout):
            response = await client.send(request, stream=True)
    except trio.TooSlowError as exc:
        raise BackendError("backend_timeout", f"no response from backend within {read_timeout:g}s") from exc
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise BackendError("backend_unavailable", f"cannot reach backend at {client.base_url}: {exc}") from exc
    except httpx.TransportError as exc:
        raise BackendError("backend_error", f"backend connection failed: {exc!r}") from exc
    try:
        if response.status_code >= 400:
            detail = await _read_error(response, read_timeout)
            raise status_error(response.status_code, detail)
        yield response
    except httpx.TransportError as exc:
        raise BackendError("backend_error", f"backend connection broke mid-stream: {exc!r}") from exc
    finally:
        # Closing the stream is what stops generation on the backend when the run is cancelled.
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await response.aclose()


async def _read_error(response: httpx.Response, read_timeout: float) -> str:
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(min(read_timeout, 5.0)):
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size >= ERROR_BODY_LIMIT:
                break
    return error_detail(b"".join(chunks))


async def read_lines(response: httpx.Response, read_timeout: float) -> AsyncGenerator[str, None]:
    """The response's non-empty lines; a backend silent for ``read_timeout`` is an error."""
    lines: Any = response.aiter_lines()  # typed as an iterator, but it is an async generator
    async with aclosing(lines):
        while True:
            with trio.move_on_after(read_timeout) as silence:
                try:
                    line = await lines.__anext__()
                except StopAsyncIteration:
                    return
            if silence.cancelled_caught:
                raise BackendError("backend_timeout", f"backend silent for {read_timeout:g}s mid-stream")
            if line:
                yield line


def parse_json_line(line: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise BackendError("backend_protocol_error", f"malformed {what}: {line[:200]!r}") from exc
    if not isinstance(data, dict):
        raise BackendError("backend_protocol_error", f"malformed {what}: not an object")
    return data


async def get_json(client: httpx.AsyncClient, path: str, read_timeout: float) -> Any:
    """GET a small JSON document (model lists); failures are BackendErrors."""
    try:
        with trio.fail_after(read_timeout):
            response = await client.get(path)
    except trio.TooSlowError as exc:
        raise BackendError("backend_timeout", f"GET {path} took over {read_timeout:g}s") from exc
    except httpx.TransportError as exc:
        raise BackendError("backend_unavailable", f"cannot reach backend at {client.base_url}: {exc!r}") from exc
    if response.status_code >= 400:
        raise status_error(response.status_code, error_detail(response.content))
    try:
        return response.json()
    except ValueError as exc:
        raise BackendError("backend_protocol_error", f"GET {path} did not return JSON") from exc
