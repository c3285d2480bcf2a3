"""The OpenAI-compatible HTTP API (quart-trio on hypercorn).

A streaming response waits for the node's ``start`` event before sending headers, so a request
that fails at once (unknown model on the node, node busy) still gets a proper HTTP status. After
that, errors arrive as an SSE ``error`` event and the stream ends without ``[DONE]``.

The cancel chain starts here: when the client disconnects, hypercorn cancels the task running the
handler (or iterating the stream); ``EdgeRun.close`` in its ``finally`` sends ``cancel.request``.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio

from ..controlplane import KeyLimits, NoNodeAvailable, RateLimited
from .batch_api import batch_blueprint
from .errors import ApiError, error_body
from .openai_format import SSE_DONE, ResponseShaper, sse
from .openai_requests import ParsedRequest, parse_chat, parse_completion, parse_json_object
from .runs import EdgeRun
from .state import EdgeState

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":")),
        status=status,
        headers=headers,
        content_type="application/json",
    )


def error_response(error: ApiError) -> Response:
    return json_response(error.body(), error.status, error.headers)


def create_app(state: EdgeState) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = state.config.http.max_body_size
    app.register_blueprint(batch_blueprint(state.config))  # Files and Batch API (worker runs them)
    metrics = state.metrics

    def route_label() -> str:
        return request.url_rule.rule if request.url_rule is not None else "unmatched"

    @app.before_request
    async def authenticate() -> Response | None:
        g.started = time.perf_counter()
        g.limits = None
        if request.path.startswith("/admin/"):
            return None if admin_allowed(state, request.headers) else error_response(admin_refusal(state))
        if not state.keys or not request.path.startswith("/v1/"):
            return None
        limits = find_key(state, request.headers)
        if limits is None:
            return error_response(ApiError(401, "Incorrect API key provided.", code="invalid_api_key"))
        g.limits = limits
        return None

    @app.after_request
    async def count(response: Response) -> Response:
        route = route_label()
        metrics.requests.labels(route=route, status=str(response.status_code)).inc()
        if not g.get("streaming"):
            metrics.request_duration.labels(route=route).observe(time.perf_counter() - g.started)
        return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        return json_response(error_body(f"Unknown request URL: {request.method} {request.path}."), 404)

    @app.errorhandler(405)
    async def not_allowed(_error: Exception) -> Response:
        return json_response(error_body(f"Method {request.method} not allowed for {request.path}."), 405)

    @app.errorhandler(413)
    async def too_large(_error: Exception) -> Response:
        limit = state.config.http.max_body_size
        # Connection: close: the unread body is still on the wire, and hypercorn would otherwise
        # keep the connection waiting for it (the next request on it would hang).
        body = error_body(f"Request body exceeds the limit of {limit} bytes.")
        return json_response(body, 413, {"Connection": "close"})

    @app.get("/healthz")
    async def healthz() -> Response:
        return json_response({"status": "ok", "nodes": len(state.registry)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), content_type=metrics.content_type)

    @app.get("/admin/nodes")
    async def admin_nodes() -> Response:
        nodes = state.registry.describe()
        for node in nodes:
            node["queued"] = {m: state.scheduler.waiting(m) for m in node["models"] if state.scheduler.waiting(m)}
        return json_response({"object": "list", "data": nodes})

    @app.get("/v1/models")
    async def list_models() -> Response:
        data = [model_card(model) for model in state.registry.models()]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/models/<path:model>")
    async def get_model(model: str) -> Response:
        if model not in state.registry.models():
            raise ApiError(404, f"The model `{model}` does not exist.", code="model_not_found", param="model")
        return json_response(model_card(model))

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await serve(parse_chat(parse_json_object(await request.get_data())))

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await serve(parse_completion(parse_json_object(await request.get_data())))

    async def serve(parsed: ParsedRequest) -> Response:
        limits: KeyLimits | None = g.limits
        priority = request_priority(request.headers, limits)
        if limits is not None:
            if not limits.allows_model(parsed.model):
                raise ApiError(
                    403, f"This API key may not use the model `{parsed.model}`.",
                    code="model_not_allowed", param="model",
                )
            try:
                limits.admit()
            except RateLimited as exc:
                raise ApiError(
                    429, exc.message, type="requests", code="rate_limit_exceeded",
                    headers={"Retry-After": str(exc.retry_after)},
                ) from exc
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
                return json_response(await collect(run, shaper))
        except BaseException:
            await run.close()
            raise
        g.streaming = True  # its duration is observed when the stream ends
        response = Response(stream(run, shaper, g.started, route_label()), content_type="text/event-stream", headers=SSE_HEADERS)
        response.timeout = None  # a long generation is not a stuck response
        return response

    async def collect(run: EdgeRun, shaper: ResponseShaper) -> dict[str, Any]:
        pieces: list[str] = []
        try:
            while (event := await run.next_event()).kind != "complete":
                pieces.append(event.text)
        finally:
            await run.close()
        return shaper.complete("".join(pieces), run.finish_reason, run.final_usage())

    async def stream(run: EdgeRun, shaper: ResponseShaper, started: float, route: str) -> AsyncIterator[bytes]:
        try:
            if shaper.kind == "chat":
                yield shaper.chunk("", first=True)
            while (event := await run.next_event()).kind != "complete":
                chunks = [shaper.chunk(event.text)]
                # Deltas that arrived meanwhile go out in the same write: one syscall, not many.
                while (ready := run.ready_delta()) is not None:
                    chunks.append(shaper.chunk(ready.text))
                yield b"".join(chunks)
            yield shaper.chunk(None if shaper.kind == "chat" else "", run.finish_reason)
            if shaper.include_usage:
                yield shaper.usage_chunk(run.final_usage())
            yield SSE_DONE
        except ApiError as error:
            yield sse(error.body())
        finally:
            await run.close()
            metrics.request_duration.labels(route=route).observe(time.perf_counter() - started)

    return app


def bearer(headers: Any) -> str | None:
    scheme, _, presented = headers.get("Authorization", "").partition(" ")
    return presented if scheme.lower() == "bearer" else None


def find_key(state: EdgeState, headers: Any) -> KeyLimits | None:
    presented = bearer(headers)
    if presented is None:
        return None
    for key, limits in state.keys.items():
        if hmac.compare_digest(presented, key):
            return limits
    return None


def admin_allowed(state: EdgeState, headers: Any) -> bool:
    presented, admin_key = bearer(headers), state.config.admin_key
    return bool(admin_key) and presented is not None and hmac.compare_digest(presented, admin_key)


def admin_refusal(state: EdgeState) -> ApiError:
    if not state.config.admin_key:
        return ApiError(403, "The admin API is disabled: set admin_key in the edge config.", code="admin_disabled")
    return ApiError(401, "Incorrect admin key provided.", code="invalid_api_key")


PRIORITY_HEADER = "X-IOP-Priority"


def request_priority(headers: Any, limits: KeyLimits | None) -> int:
    """The key's priority (0 without keys); the ``X-IOP-Priority`` header may only lower it, so
    a batch job can step aside for interactive traffic but no client can jump the queue."""
    ceiling = limits.config.priority if limits is not None else 0
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return ceiling
    try:
        asked = int(raw)
    except ValueError as exc:
        raise ApiError(400, f"{PRIORITY_HEADER} must be an integer.", param=PRIORITY_HEADER) from exc
    return min(asked, ceiling)


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "iop-trio"}

