"""The adapter port: how the node core drives a backend.

An adapter turns an :class:`ExecutionSpec` into a stream of text deltas pushed into a
:class:`RunSink`, and returns a :class:`Completion`. It is cancelled by its caller's cancel scope;
it must tear its backend call down when that happens (close the HTTP stream, stop the process).
Backend failures are raised as :class:`BackendError` with a stable code.
"""

from __future__ import annotations

from typing import Any, Protocol

from attrs import frozen

from ..wire import ChatMessage, SamplingParams, Usage
from ..wire.messages import RunKind


@frozen
class ExecutionSpec:
    run_id: str
    model: str
    backend_model: str
    kind: RunKind
    messages: tuple[ChatMessage, ...]
    prompt: str
    params: SamplingParams
    options: Any = None


@frozen
class Completion:
    finish_reason: str
    usage: Usage | None = None


@frozen
class Capabilities:
    models: tuple[str, ...]
    streaming: bool = True


class RunSink(Protocol):
    async def started(self) -> None:
        """The backend accepted the run (answered with success headers, the program started).
        Optional: the first delta, or the run's completion, implies it."""

    async def delta(self, text: str, tokens: int = 1) -> None:
        """Forward generated text; waits when the client side is slow (backpressure)."""

    def report_prompt_tokens(self, count: int) -> None:
        """Record the prompt size as soon as the backend knows it."""


class BackendError(Exception):
    """A backend failed in a way the client should hear about."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Adapter(Protocol):
    name: str

    def capabilities(self) -> Capabilities: ...

    async def discover_models(self) -> tuple[str, ...]:
        """Models the backend reports, when the operator opted in to advertising them all."""
        ...

    async def execute(self, spec: ExecutionSpec, sink: RunSink) -> Completion: ...

    async def aclose(self) -> None: ...


def prompt_text(spec: ExecutionSpec) -> str:
    """The request's text as one string: the prompt, or the chat messages in order."""
    if spec.kind == "completion":
        return spec.prompt
    return "\n".join(message.content for message in spec.messages)
