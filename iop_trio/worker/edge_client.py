"""The worker's only way to run anything: the edge's OpenAI API, like any other client.

Each batch line is one non-streaming request, so it goes through the control-plane's scheduling
like interactive traffic does, marked with a lower priority (``X-IOP-Priority``). Cancelling the
task that awaits a request closes its connection, and the edge then cancels the run on its node.

"Not now" answers are retried with backoff, forever (the batch's completion window bounds it):
429 (every node busy, or the edge's queue full), 503 (no node, or the edge draining) and
transport errors (the edge restarting). Any other answer is the line's result.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import httpx
import trio

from ..transport.dialer import Backoff
from .results import LineFailure, LineResponse

log = logging.getLogger("iop_trio.worker")

RETRY_STATUSES = frozenset({429, 503})
PRIORITY_HEADER = "X-IOP-Priority"


class EdgeUnavailable(Exception):
    """The edge could not answer a question the worker cannot go on without."""


class EdgeClient:
    def __init__(
        self, http: httpx.AsyncClient, *, priority: int, retry_initial: float, retry_maximum: float
    ) -> None:
        self.http = http
        self.headers = {PRIORITY_HEADER: str(priority)}
        self.retry_initial = retry_initial
        self.retry_maximum = retry_maximum

    async def models(self) -> frozenset[str]:
        """The models the platform serves right now (``GET /v1/models``)."""
        try:
            response = await self.http.get("/v1/models")
        except httpx.TransportError as exc:
            raise EdgeUnavailable(f"cannot reach the edge: {exc!r}") from exc
        if response.status_code != 200:
            raise EdgeUnavailable(f"GET /v1/models answered {response.status_code}")
        return frozenset(model["id"] for model in response.json()["data"])

    async def execute(self, endpoint: str, body: dict[str, Any]) -> LineResponse | LineFailure:
        """POST one line's body to ``endpoint`` until the edge gives an answer that is not "later"."""
        backoff = Backoff(self.retry_initial, self.retry_maximum)
        while True:
            try:
                response = await self.http.post(endpoint, json=body, headers=self.headers)
            except (httpx.ReadTimeout, httpx.WriteTimeout):
                return LineFailure("request_timeout", "The request did not finish within the worker's request_timeout.")
            except httpx.TransportError as exc:
                log.warning("edge unreachable; retrying", extra={"error": repr(exc)})
                await trio.sleep(backoff.next_delay())
                continue
            if response.status_code in RETRY_STATUSES:
                await trio.sleep(backoff.next_delay())
                continue
            request_id = response.headers.get("x-request-id") or "req_" + secrets.token_hex(16)
            return LineResponse(response.status_code, request_id, _json_body(response))


def _json_body(response: httpx.Response) -> Any:
    """The answer's JSON; a non-JSON answer (a proxy's error page) becomes an OpenAI error body."""
    try:
        return response.json()
    except ValueError:
        message = response.text[:1000] or response.reason_phrase
        return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def edge_http_client(edge_url: str, api_key: str, *, concurrency: int, request_timeout: float) -> httpx.AsyncClient:
    """One connection per concurrent line (plus one for validation), never a pool timeout: a line
    waiting for a connection is waiting for its turn, not failing."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=edge_url,
        headers=headers,
        timeout=httpx.Timeout(request_timeout, connect=10.0, pool=None),
        limits=httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1),
    )
