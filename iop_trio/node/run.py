"""One run on a node: the sink the adapter writes into, and how the run's outcome is tallied."""

from __future__ import annotations

import trio

from ..store import RunOutcome
from ..transport import FramedConnection
from ..wire import RunEvent, Usage


class RunTracker:
    """The adapter's :class:`~iop_trio.adapters.RunSink`: forwards deltas as ``run.event`` frames
    and counts what was produced, so a cancelled or failed run still records its tokens."""

    def __init__(self, conn: FramedConnection, run_id: str) -> None:
        self.conn = conn
        self.run_id = run_id
        self.started_at = trio.current_time()
        self.first_token_at: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.start_sent = False

    async def started(self) -> None:
        """Send ``start`` once: when the adapter says the backend accepted the run, or with the
        first delta, or before ``complete``. Not earlier: a backend that refuses the run (down,
        unknown model) then reaches the client as an HTTP status, not as an error inside a 200
        stream; and ``start`` mostly shares a TLS record with what follows it."""
        if not self.start_sent:
            self.start_sent = True
            await self.conn.send(RunEvent(run_id=self.run_id, kind="start"))

    async def delta(self, text: str, tokens: int = 1) -> None:
        await self.started()
        if self.first_token_at is None:
            self.first_token_at = trio.current_time()
        self.completion_tokens += tokens
        await self.conn.send(RunEvent(run_id=self.run_id, kind="delta", text=text, tokens=tokens))

    def report_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens = count

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started_at) * 1000.0

    def usage(self, reported: Usage | None = None) -> Usage:
        """The backend's own usage when it reported one, else what was counted here."""
        if reported is not None:
            return reported
        return Usage(self.prompt_tokens, self.completion_tokens)

    def outcome(self, status: str, error: str | None = None, usage: Usage | None = None) -> RunOutcome:
        usage = self.usage(usage)
        return RunOutcome(
            status=status,  # type: ignore[arg-type]
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            ttft_ms=self.ttft_ms,
            error=error,
        )


def final_event(run_id: str, outcome: RunOutcome, code: str, finish_reason: str | None) -> RunEvent:
    """The one terminal ``run.event`` that matches the recorded outcome."""
    usage = Usage(outcome.prompt_tokens, outcome.completion_tokens)
    if outcome.status == "complete":
        return RunEvent(run_id=run_id, kind="complete", finish_reason=finish_reason, usage=usage)
    return RunEvent(
        run_id=run_id, kind="error", code=code, message=outcome.error or code, usage=usage
    )
