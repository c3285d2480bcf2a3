"""Response bodies and SSE chunks shaped exactly as OpenAI's."""

from __future__ import annotations

import json
from typing import Any

from ..wire import Usage

SSE_DONE = b"data: [DONE]\n\n"


def json_bytes(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode("utf-8")


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json_bytes(data) + b"\n\n"


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class ResponseShaper:
    """Builds every body of one response; chat and text completions differ only in shape."""

    def __init__(self, kind: str, response_id: str, model: str, created: int, include_usage: bool) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = created
        self.include_usage = include_usage

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def complete(self, text: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_body(usage)
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, usage: Usage) -> bytes:
        object_name = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = self._envelope(object_name, [])
        body["usage"] = usage_body(usage)
        return sse(body)
