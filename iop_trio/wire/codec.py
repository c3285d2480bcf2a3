"""Payload codecs: Message <-> bytes. JSON now; the interface leaves room for protobuf later."""

from __future__ import annotations

import json
from typing import Any, Protocol

import cattrs

from .converter import describe_error, make_strict_converter
from .errors import LocalProtocolError, RemoteProtocolError, UnknownMessageTypeError
from .messages import MESSAGE_TYPES, TYPE_NAMES, Message


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: One decoder for every frame (``json.loads`` with a keyword builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


class Codec(Protocol):
    """Turns one message into one frame payload and back."""

    name: str

    def encode(self, message: Message) -> bytes: ...

    def decode(self, payload: bytes) -> Message: ...


class JsonCodec:
    """Envelope ``{"type": <name>, "payload": <message as a JSON object>}``, UTF-8 encoded."""

    name = "json"

    def __init__(self) -> None:
        self._converter = make_strict_converter()
        self._encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        # For text that cannot be UTF-8 (a lone surrogate a peer sent us as "\ud800"): \u-escape it.
        self._ascii_encoder = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))

    def encode(self, message: Message) -> bytes:
        envelope = {
            "type": TYPE_NAMES[type(message)],
            "payload": self._converter.unstructure(message),
        }
        try:
            text = self._encoder.encode(envelope)
        except ValueError as exc:
            raise LocalProtocolError(f"cannot encode {envelope['type']}: {exc}") from exc
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            return self._ascii_encoder.encode(envelope).encode("ascii")

    def decode(self, payload: bytes) -> Message:
        try:
            envelope: Any = _DECODER.decode(payload.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise RemoteProtocolError(f"frame payload is not valid JSON: {exc}") from exc
        if not isinstance(envelope, dict) or set(envelope) != {"type", "payload"}:
            raise RemoteProtocolError("envelope must be an object with exactly 'type' and 'payload'")
        type_name = envelope["type"]
        if not isinstance(type_name, str):
            raise RemoteProtocolError("envelope 'type' must be a string")
        message_class = MESSAGE_TYPES.get(type_name)
        if message_class is None:
            raise UnknownMessageTypeError(f"unknown message type {type_name!r}")
        body = envelope["payload"]
        if not isinstance(body, dict):
            raise RemoteProtocolError(f"{type_name} payload must be an object")
        try:
            return self._converter.structure(body, message_class)
        except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, RecursionError) as exc:
            raise RemoteProtocolError(
                f"invalid {type_name}: {describe_error(exc, path=type_name)}"
            ) from exc
