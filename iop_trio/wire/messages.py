"""The IOP messages: frozen attrs classes, one per envelope ``type``.

Field names are the wire names. Optional fields have defaults so a newer peer may omit them;
unknown fields are rejected by the strict converter in :mod:`iop_trio.wire.codec`.
"""

from __future__ import annotations

from typing import Literal

from attrs import field, frozen

RunKind = Literal["chat", "completion"]
EventKind = Literal["start", "delta", "complete", "error"]


@frozen
class ChatMessage:
    role: str
    content: str


@frozen
class SamplingParams:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@frozen
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@frozen
class NodeConfig:
    """The centrally managed part of a node's configuration, sent in ``register.response``."""

    max_concurrency: int
    heartbeat_interval: float
    models: tuple[str, ...] = ()
    labels: dict[str, str] = field(factory=dict)


@frozen
class RegisterRequest:
    token: str
    node_id: str
    version: str
    adapters: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    capacity: int = 1
    labels: dict[str, str] = field(factory=dict)


@frozen
class RegisterResponse:
    accepted: bool
    reason: str = ""
    config: NodeConfig | None = None


@frozen
class RunRequest:
    """One inference run. ``deadline`` is a relative budget in seconds (clocks differ per host)."""

    run_id: str
    model: str
    kind: RunKind = "chat"
    messages: tuple[ChatMessage, ...] = ()
    prompt: str = ""
    params: SamplingParams = SamplingParams()
    deadline: float | None = None


@frozen
class RunEvent:
    """Progress of a run. ``start`` once, ``delta`` any number of times, then exactly one of
    ``complete`` or ``error`` (a cancelled run ends with ``error`` and code ``cancelled``)."""

    run_id: str
    kind: EventKind
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None
    code: str = ""
    message: str = ""

    @property
    def is_terminal(self) -> bool:
        return self.kind in ("complete", "error")


@frozen
class CancelRequest:
    run_id: str
    reason: str = ""


@frozen
class Heartbeat:
    seq: int = 0


@frozen
class Drain:
    """node -> edge: this node is shutting down; schedule nothing new to it. Its in-flight runs
    continue until they end or the node's grace period runs out."""

    reason: str = ""


@frozen
class Error:
    """A protocol-level error (bad frame, unknown type, unknown run)."""

    code: str
    message: str
    run_id: str | None = None


Message = (
    RegisterRequest
    | RegisterResponse
    | RunRequest
    | RunEvent
    | CancelRequest
    | Heartbeat
    | Drain
    | Error
)

#: Envelope ``type`` -> message class. The single source of truth for the type names.
MESSAGE_TYPES: dict[str, type[Message]] = {
    "register.request": RegisterRequest,
    "register.response": RegisterResponse,
    "run.request": RunRequest,
    "run.event": RunEvent,
    "cancel.request": CancelRequest,
    "heartbeat": Heartbeat,
    "node.drain": Drain,
    "error": Error,
}

TYPE_NAMES: dict[type[Message], str] = {cls: name for name, cls in MESSAGE_TYPES.items()}
