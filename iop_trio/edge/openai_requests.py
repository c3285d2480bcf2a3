"""Parsing and validating OpenAI request bodies into what a run needs.

Fields the platform does not act on (``user``, ``presence_penalty``, ...) are accepted and ignored,
as OpenAI-compatible servers do; fields it acts on are type-checked and a wrong one is a 400 that
names the parameter.
"""

from __future__ import annotations

import json
from typing import Any

from attrs import frozen

from ..wire import ChatMessage, SamplingParams
from ..wire.messages import RunKind
from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4


@frozen
class ParsedRequest:
    kind: RunKind
    model: str
    messages: tuple[ChatMessage, ...]
    prompt: str
    params: SamplingParams
    stream: bool
    include_usage: bool


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_request" if param is None else None)


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # Recursion: nested too deep
        raise invalid(f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


def _optional(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise invalid(f"Invalid type for '{name}': expected {what}, got {type(value).__name__}.", name)
    return value


def _number_in(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = _optional(body, name, (int, float), "a number")
    if value is not None and not low <= value <= high:
        raise invalid(f"'{name}' must be between {low:g} and {high:g}, got {value}.", name)
    return None if value is None else float(value)


def _sampling(body: dict[str, Any]) -> SamplingParams:
    max_tokens = _optional(body, "max_completion_tokens", (int,), "an integer")
    if max_tokens is None:
        max_tokens = _optional(body, "max_tokens", (int,), "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise invalid(f"'max_tokens' must be at least 1, got {max_tokens}.", "max_tokens")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_SEQUENCES:
            raise invalid(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences.", "stop")
        stops = tuple(stop)
    else:
        raise invalid("Invalid type for 'stop': expected a string or an array of strings.", "stop")
    n = _optional(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise invalid("Only n=1 is supported.", "n")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number_in(body, "temperature", 0.0, 2.0),
        top_p=_number_in(body, "top_p", 0.0, 1.0),
        stop=stops,
        seed=_optional(body, "seed", (int,), "an integer"),
    )


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("You must provide a model parameter.", "model")
    return model


def _streaming(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_optional(body, "stream", (bool,), "a boolean"))
    options = _optional(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is true.", "stream_options")
    include_usage = bool(options and _optional(options, "include_usage", (bool,), "a boolean"))
    return stream, include_usage


def _content_text(content: Any, index: int) -> str:
    param = f"messages.[{index}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("Only text content parts are supported.", param)
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"Invalid type for '{param}': expected a string or an array of parts.", param)


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    model = _model(body)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise invalid("'messages' must be a non-empty array.", "messages")
    messages = []
    for index, message in enumerate(raw_messages):
        if not isinstance(message, dict):
            raise invalid(f"'messages.[{index}]' must be an object.", f"messages.[{index}]")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(
                f"Invalid 'messages.[{index}].role': expected one of {', '.join(ROLES)}.",
                f"messages.[{index}].role",
            )
        messages.append(ChatMessage(role=role, content=_content_text(message.get("content"), index)))
    stream, include_usage = _streaming(body)
    return ParsedRequest("chat", model, tuple(messages), "", _sampling(body), stream, include_usage)


def parse_completion(body: dict[str, Any]) -> ParsedRequest:
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string (one prompt per request).", "prompt")
    stream, include_usage = _streaming(body)
    return ParsedRequest("completion", model, (), prompt, _sampling(body), stream, include_usage)
