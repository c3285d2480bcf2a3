"""One client request, seen from the edge: schedule it, follow its events, end it once.

A request may take several attempts: when its node fails before the first token (the node was
lost, was busy, or started draining), it is retried transparently on another node, never the
same one, up to ``retry.max_attempts``. Once a token has reached the client there is no retry: a
later failure ends the request with an error.

``EdgeRun.close`` is the single exit. If the current attempt had not ended (the client went
away, or the handler was cancelled) it sends ``cancel.request`` to the node, shielded and
bounded; then it records the attempt in the edge's history and the request in the metrics,
exactly once.
"""

from __future__ import annotations

import logging
import math
import secrets

import trio

from ..controlplane import KeyLimits, NodeSession, NoNodeAvailable, RunInbox, RunLost
from ..store import RunOutcome
from ..wire import RunEvent, RunRequest, Usage
from .errors import run_error
from .openai_requests import ParsedRequest
from .state import EdgeState

log = logging.getLogger("iop_trio.edge")

#: Failures that happen to a run, not because of it: another node may well succeed.
#: How long past the run's deadline the edge still waits for the node to say how the run ended.
DEADLINE_GRACE = 30.0

RETRYABLE = frozenset({"node_lost", "node_reconnected", "node_busy", "node_draining"})


def new_run_id() -> str:
    return secrets.token_hex(12)


class EdgeRun:
    def __init__(
        self, state: EdgeState, parsed: ParsedRequest, priority: int = 0, limits: KeyLimits | None = None
    ) -> None:
        self.state = state
        self.parsed = parsed
        self.priority = priority
        self.limits = limits
        self.id = new_run_id()
        self.tried: list[str] = []
        self.attempts = 0
        self.session: NodeSession | None = None
        self.inbox: RunInbox | None = None
        self.run_id = ""
        self.started_at = trio.current_time()
        deadline = state.config.run_deadline
        self.deadline_at = self.started_at + deadline + DEADLINE_GRACE if deadline else math.inf
        self.first_token_at: float | None = None
        self.completion_tokens = 0
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self._started = False
        self._status = "cancelled"
        self._error: str | None = None
        self._closed = False

    @classmethod
    async def open(
        cls, state: EdgeState, parsed: ParsedRequest, priority: int = 0, limits: KeyLimits | None = None
    ) -> EdgeRun:
        """Schedule the request (waiting in the queue if need be) and send it to its node.
        Raises NoNodeAvailable (404/429/503) when no node can take it."""
        run = cls(state, parsed, priority, limits)
        state.run_started()
        try:
            await run._attempt()
        except NoNodeAvailable:
            run._status = "rejected"  # never reached a node: not a cancelled run
            await run.close()
            raise
        except BaseException:
            await run.close()
            raise
        return run

    async def _attempt(self) -> None:
        run_id = new_run_id()
        entered = trio.current_time()
        grant = await self.state.scheduler.acquire(
            self.parsed.model, run_id, self.priority, frozenset(self.tried)
        )
        self.state.metrics.schedule_wait.observe(trio.current_time() - entered)
        self.session, self.inbox, self.run_id = grant.session, grant.inbox, run_id
        self.tried.append(grant.session.node_id)
        self.attempts += 1
        request = RunRequest(
            run_id=run_id,
            model=self.parsed.model,
            kind=self.parsed.kind,
            messages=self.parsed.messages,
            prompt=self.parsed.prompt,
            params=self.parsed.params,
            deadline=self.state.config.run_deadline or None,
        )
        with trio.CancelScope(shield=True):  # the row exists before anything can end the attempt
            await self.state.history.start_run(run_id, grant.session.node_id, self.parsed.model, "edge")
        await grant.session.send_run(request)

    async def next_event(self) -> RunEvent:
        """The next ``start``/``delta``/``complete`` event (``start`` once, whatever the number of
        attempts). A failure that cannot be retried raises :class:`~iop_trio.edge.errors.ApiError`."""
        while True:
            assert self.inbox is not None
            try:
                # An event already here needs no deadline scope (one per token was measurable).
                event = self.inbox.get_nowait() or await self._wait_for_event(self.inbox)
            except RunLost as exc:
                code, message = exc.code, exc.message
            else:
                if event.kind != "error":
                    if event.kind == "start" and self._started:
                        continue
                    self._account(event)
                    return event
                code, message = event.code, event.message
                self.usage = event.usage
            if await self._retried(code, message):
                continue
            self._status = "cancelled" if code == "cancelled" else "error"
            self._error = message
            raise run_error(code, message)

    async def _wait_for_event(self, inbox: RunInbox) -> RunEvent:
        with trio.move_on_at(self.deadline_at):
            return await inbox.get()
        # The node enforces the deadline itself; this only catches a node that never said how
        # the run ended, so no client can wait forever.
        raise RunLost("deadline_exceeded", "the node did not finish the run within its deadline")

    def event_ready(self) -> bool:
        """Whether :meth:`next_event` would return (or raise) without waiting."""
        return self.inbox is not None and self.inbox.ready

    def _account(self, event: RunEvent) -> None:
        if event.kind == "start":
            self._started = True
        elif event.kind == "delta":
            if self.first_token_at is None:
                self.first_token_at = trio.current_time()
                self.state.metrics.ttft.observe(self.first_token_at - self.started_at)
            self.completion_tokens += event.tokens
        elif event.kind == "complete":
            self._status = "complete"
            self.usage = event.usage
            self.finish_reason = event.finish_reason

    async def _retried(self, code: str, message: str) -> bool:
        """Move to another node if the failure allows it; False when the request must fail."""
        exclude = frozenset(self.tried if code != "node_reconnected" else self.tried[:-1])
        if (
            code not in RETRYABLE
            or self.first_token_at is not None
            or self.attempts >= self.state.config.retry.max_attempts
            or not self.state.scheduler.has_candidates(self.parsed.model, exclude)
        ):
            return False
        log.info(
            "retrying run on another node",
            extra={"request_id": self.id, "failed_node": self.tried[-1], "reason": message},
        )
        self.state.metrics.retries.inc()
        if code == "node_reconnected":
            # The node is alive on a new connection: it is a candidate again, not a failed node.
            self.tried.pop()
        await self._end_attempt(RunOutcome("error", error=message))
        try:
            await self._attempt()
        except NoNodeAvailable as exc:
            log.info("retry found no node", extra={"request_id": self.id, "reason": exc.message})
            return False  # the client hears about the original failure
        return True

    def final_usage(self) -> Usage:
        return self.usage or Usage(0, self.completion_tokens)

    async def _end_attempt(self, outcome: RunOutcome) -> None:
        if self.session is None:
            return
        session, self.session = self.session, None
        if await session.finish_run(self.run_id, self.state.config.cancel_timeout):
            log.info("client went away; run cancelled", extra={"run_id": self.run_id, "node_id": session.node_id})
        await self.state.history.end_run(self.run_id, outcome)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            usage = self.final_usage()
            ttft = None if self.first_token_at is None else (self.first_token_at - self.started_at) * 1000
            error = self._error or ("client went away" if self._status == "cancelled" else None)
            if self.session is not None:
                outcome = RunOutcome(self._status, usage.prompt_tokens, usage.completion_tokens, ttft, error)  # type: ignore[arg-type]
                await self._end_attempt(outcome)
            self.state.run_finished()
            self.state.metrics.runs.labels(status=self._status).inc()
            if self.limits is not None:
                self.limits.charge_tokens(usage.total_tokens)
