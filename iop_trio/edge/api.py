"""The edge's HTTP API as a quart-trio app: health, metrics, the admin API, models, and the Files
and Batch API. The two hot routes, chat and text completions, do not come here:
:mod:`~iop_trio.edge.openai_asgi` serves them as raw ASGI in front of this app, sharing its key
and priority helpers below.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from quart import Response, g, request
from quart_trio import QuartTrio

from ..controlplane import KeyLimits
from .batch_api import batch_blueprint
from .errors import ApiError, body_too_large, error_body, method_not_allowed
from .openai_format import json_bytes
from .state import EdgeState


def json_response(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json_bytes(body), status=status, headers=headers, content_type="application/json")


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
        if request.path.startswith("/admin/"):
            return None if admin_allowed(state, request.headers) else error_response(admin_refusal(state))
        if request.path.startswith("/v1/"):
            api_key_limits(state, request.headers)
        return None

    @app.after_request
    async def count(response: Response) -> Response:
        route = route_label()
        metrics.count_request(route, response.status_code)
        metrics.observe_request(route, time.perf_counter() - g.started)
        return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(404)
    async def not_found(_error: Exception) -> Response:
        return json_response(error_body(f"Unknown request URL: {request.method} {request.path}."), 404)

    @app.errorhandler(405)
    async def not_allowed(_error: Exception) -> Response:
        return error_response(method_not_allowed(request.method, request.path))

    @app.errorhandler(413)
    async def too_large(_error: Exception) -> Response:
        return error_response(body_too_large(state.config.http.max_body_size))

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

    return app


def bearer(headers: Any) -> str | None:
    scheme, _, presented = headers.get("Authorization", "").partition(" ")
    return presented if scheme.lower() == "bearer" else None


def api_key_limits(state: EdgeState, headers: Any) -> KeyLimits | None:
    """The limits of the request's API key, None when the API needs no key; a 401 ApiError when
    keys are configured and the bearer is none of them."""
    if not state.keys:
        return None
    presented = bearer(headers)
    if presented is not None:
        for key, limits in state.keys.items():
            if hmac.compare_digest(presented, key):
                return limits
    raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")


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

