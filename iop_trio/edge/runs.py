"""One client request's run, seen from the edge: schedule it, follow its events, end it once.

``EdgeRun.close`` is the single exit: if the run had not ended (the client went away, or the
handler was cancelled), it sends ``cancel.request`` to the node, shielded and bounded; then it
records the run in the edge's history and metrics exactly once.
"""

from __future__ import annotations

import logging
import secrets

import trio

from ..controlplane import NodeSession, RunInbox, RunLost
from ..store import RunOutcome
from ..wire import RunEvent, RunRequest, Usage
from .errors import run_error
from .openai_requests import ParsedRequest
from .state import EdgeState

log = logging.getLogger("iop_trio.edge")


def new_run_id() -> str:
    return secrets.token_hex(12)


class EdgeRun:
    def __init__(self, state: EdgeState, session: NodeSession, request: RunRequest, inbox: RunInbox) -> None:
        self.state = state
        self.session = session
        self.request = request
        self.inbox = inbox
        self.started_at = trio.current_time()
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self._status = "cancelled"
        self._error: str | None = None
        self._closed = False

    @classmethod
    async def open(cls, state: EdgeState, parsed: ParsedRequest) -> EdgeRun:
        """Pick a node and send it the run (raises NoNodeAvailable when none can take it)."""
        session = state.scheduler.pick(parsed.model)
        deadline = state.config.run_deadline or None
        request = RunRequest(
            run_id=new_run_id(),
            model=parsed.model,
            kind=parsed.kind,
            messages=parsed.messages,
            prompt=parsed.prompt,
            params=parsed.params,
            deadline=deadline,
        )
        inbox = await session.start_run(request)
        run = cls(state, session, request, inbox)
        state.run_started()
        await state.runs.start_run(request.run_id, session.node_id, parsed.model, "edge")
        return run

    @property
    def run_id(self) -> str:
        return self.request.run_id

    async def next_event(self) -> RunEvent:
        """The next ``start``/``delta``/``complete`` event; an ``error`` event or a lost node raises
        :class:`~iop_trio.edge.errors.ApiError`."""
        try:
            event = await self.inbox.get()
        except RunLost as exc:
            self._status, self._error = "error", exc.message
            raise run_error(exc.code, exc.message) from exc
        if event.kind == "delta":
            if self.first_token_at is None:
                self.first_token_at = trio.current_time()
                self.state.metrics.ttft.observe(self.first_token_at - self.started_at)
            self.completion_tokens += event.tokens
        elif event.kind == "complete":
            self._status = "complete"
            self.usage = event.usage
            self.finish_reason = event.finish_reason
        elif event.kind == "error":
            self._status = "cancelled" if event.code == "cancelled" else "error"
            self._error = event.message
            self.usage = event.usage
            raise run_error(event.code, event.message)
        return event

    def final_usage(self) -> Usage:
        return self.usage or Usage(0, self.completion_tokens)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if await self.session.finish_run(self.run_id, self.state.config.cancel_timeout):
                log.info("client went away; run cancelled", extra={"run_id": self.run_id, "node_id": self.session.node_id})
                self._error = "client went away"
            usage = self.final_usage()
            ttft = None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1000
            outcome = RunOutcome(self._status, usage.prompt_tokens, usage.completion_tokens, ttft, self._error)  # type: ignore[arg-type]
            self.state.run_finished()
            self.state.metrics.runs.labels(status=self._status).inc()
            await self.state.runs.end_run(self.run_id, outcome)
