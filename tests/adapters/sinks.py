"""The RunSink the adapter tests hand to ``execute``: it records what the adapter reported."""

from __future__ import annotations

import trio


class RecordingSink:
    """Every delta with the (virtual) time it arrived, the prompt sizes reported, and when the
    adapter said its backend accepted the run; optionally cancels a scope on the first delta."""

    def __init__(self, cancel: trio.CancelScope | None = None) -> None:
        self.deltas: list[tuple[float, str, int]] = []
        self.prompt_tokens: list[int] = []
        self.started_at: float | None = None
        self.cancel = cancel

    async def started(self) -> None:
        if self.started_at is None:
            self.started_at = trio.current_time()

    async def delta(self, text: str, tokens: int = 1) -> None:
        self.deltas.append((trio.current_time(), text, tokens))
        if self.cancel is not None:
            self.cancel.cancel()

    def report_prompt_tokens(self, count: int) -> None:
        self.prompt_tokens.append(count)

    @property
    def text(self) -> str:
        return "".join(text for _, text, _ in self.deltas)

    @property
    def times(self) -> list[float]:
        return [when for when, _, _ in self.deltas]

    @property
    def tokens(self) -> int:
        return sum(tokens for _, _, tokens in self.deltas)
