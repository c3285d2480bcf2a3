"""Errors the HTTP API answers with, in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

#: run.event error codes from nodes -> HTTP status of a non-streaming response.
RUN_ERROR_STATUS = {
    "model_not_found": 404,
    "invalid_request": 400,
    "request_too_large": 413,
    "node_busy": 429,
    "backend_busy": 429,
    "backend_unavailable": 502,
    "backend_error": 502,
    "backend_auth": 502,
    "backend_protocol_error": 502,
    "backend_timeout": 504,
    "node_draining": 503,
    "node_lost": 502,
    "node_reconnected": 502,
    "deadline_exceeded": 504,
    "cancelled": 499,
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def run_error(code: str, message: str) -> ApiError:
    """The HTTP error for a run that ended with a node-side error."""
    status = RUN_ERROR_STATUS.get(code, 502)
    kind = "invalid_request_error" if status < 500 and status != 429 else "server_error"
    headers = {"Retry-After": "1"} if status == 429 else None
    return ApiError(status, message, type=kind, code=code, headers=headers)


def method_not_allowed(method: str, path: str) -> ApiError:
    return ApiError(405, f"Method {method} not allowed for {path}.")


def body_too_large(limit: int) -> ApiError:
    """413 without reading the body: ``Connection: close``, since the unread body is still on the
    wire and the server would otherwise keep the connection waiting for it (the next request on it
    would hang)."""
    return ApiError(413, f"Request body exceeds the limit of {limit} bytes.", headers={"Connection": "close"})
