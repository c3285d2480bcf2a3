"""The mock adapter: a deterministic token stream for demos, tests and benchmarks.

Per-model options set how many tokens it produces, the delay before the first and between the
others, and an injected failure. The text is a fixed word list rotated by a CRC of the prompt,
so the same request always gets the same answer across processes.
"""

from __future__ import annotations

import zlib

import trio
from attrs import field, frozen
from attrs.validators import ge, optional

from ..wire import Usage
from .base import BackendError, Capabilities, Completion, ExecutionSpec, RunSink, prompt_text

WORDS = (
    "the quick brown fox jumps over the lazy dog while structured concurrency keeps every "
    "task inside its nursery and every run inside its cancel scope"
).split()


@frozen
class MockOptions:
    tokens: int = field(default=16, validator=ge(0))
    ttft: float = field(default=0.0, validator=ge(0))
    token_delay: float = field(default=0.0, validator=ge(0))
    fail_after_tokens: int | None = field(default=None, validator=optional(ge(0)))
    fail_message: str = "injected failure"


@frozen
class MockAdapterConfig:
    """The mock adapter has no backend, so nothing to configure at adapter level."""


def count_words(text: str) -> int:
    return len(text.split())


class MockAdapter:
    name = "mock"

    def __init__(self, config: MockAdapterConfig, models: dict[str, MockOptions]) -> None:
        self._models = models

    def capabilities(self) -> Capabilities:
        return Capabilities(models=tuple(self._models))

    async def discover_models(self) -> tuple[str, ...]:
        return ()

    async def execute(self, spec: ExecutionSpec, sink: RunSink) -> Completion:
        options: MockOptions = spec.options or MockOptions()
        text = prompt_text(spec)
        prompt_tokens = count_words(text)
        sink.report_prompt_tokens(prompt_tokens)
        limit = options.tokens
        finish_reason = "stop"
        if spec.params.max_tokens is not None and spec.params.max_tokens < limit:
            limit, finish_reason = spec.params.max_tokens, "length"
        offset = zlib.crc32(text.encode("utf-8"))
        produced = ""
        await sink.started()
        await trio.sleep(options.ttft)
        for index in range(limit):
            if options.fail_after_tokens is not None and index >= options.fail_after_tokens:
                raise BackendError("backend_error", options.fail_message)
            if index:
                await trio.sleep(options.token_delay)
            word = WORDS[(offset + index) % len(WORDS)]
            piece = word if index == 0 else " " + word
            produced += piece
            if any(stop and stop in produced for stop in spec.params.stop):
                return Completion("stop", Usage(prompt_tokens, index))
            await sink.delta(piece, 1)
        if options.fail_after_tokens is not None and limit >= options.fail_after_tokens:
            raise BackendError("backend_error", options.fail_message)
        return Completion(finish_reason, Usage(prompt_tokens, limit))

    async def aclose(self) -> None:
        pass
