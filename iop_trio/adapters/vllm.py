"""The vllm adapter: any OpenAI-compatible server (vLLM, llama.cpp's server, SGLang, LM Studio,
TGI's Messages API).

Always streams upstream with ``stream_options.include_usage``, so the backend's own token counts
come back with the last chunk, and cancelling a run closes the stream (the server stops there).
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any

from attrs import field, frozen

from ..wire import Usage
from .base import BackendError, Completion, ExecutionSpec, RunSink
from .http import HttpAdapter, HttpBackendConfig, open_stream, parse_json_line, read_lines


@frozen
class VllmConfig(HttpBackendConfig):
    base_url: str = "http://127.0.0.1:8000/v1"


@frozen
class VllmOptions:
    #: Extra fields merged into every request body (e.g. ``top_k``, ``repetition_penalty``).
    extra_body: dict[str, Any] = field(factory=dict)


def sampling_body(spec: ExecutionSpec) -> dict[str, Any]:
    params = spec.params
    body: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop) or None,
    }
    return {key: value for key, value in body.items() if value is not None}


class VllmAdapter(HttpAdapter):
    name = "vllm"
    models_path, models_key, model_name_key = "/models", "data", "id"
    config: VllmConfig

    async def execute(self, spec: ExecutionSpec, sink: RunSink) -> Completion:
        options: VllmOptions = spec.options or VllmOptions()
        body: dict[str, Any] = {
            **options.extra_body,  # the operator's defaults; what the client asked for wins
            "model": spec.backend_model,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling_body(spec),
        }
        if spec.kind == "chat":
            path = "/chat/completions"
            body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
        else:
            path = "/completions"
            body["prompt"] = spec.prompt
        finish_reason: str | None = None
        usage: Usage | None = None
        timeout = self.config.read_timeout
        async with open_stream(self._client, path, body, timeout) as response:
            async with aclosing(read_lines(response, timeout)) as lines:
                async for line in lines:
                    if not line.startswith("data:"):
                        continue  # SSE comments, event names, keep-alives
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        break
                    chunk = parse_json_line(data, "SSE chunk")
                    if "error" in chunk:
                        raise BackendError("backend_error", f"backend error mid-stream: {chunk['error']}")
                    for choice in chunk.get("choices") or ():
                        text = _choice_text(choice, spec.kind)
                        if text:
                            await sink.delta(text, 1)
                        finish_reason = choice.get("finish_reason") or finish_reason
                    if chunk.get("usage"):
                        usage = _usage(chunk["usage"])
                        sink.report_prompt_tokens(usage.prompt_tokens)
        if finish_reason is None:
            raise BackendError("backend_protocol_error", "stream ended without a finish_reason")
        return Completion(finish_reason, usage)


def _choice_text(choice: dict[str, Any], kind: str) -> str:
    if kind == "chat":
        delta = choice.get("delta") or {}
        content = delta.get("content") if isinstance(delta, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def _usage(raw: Any) -> Usage:
    try:
        return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0))
    except (AttributeError, TypeError, ValueError) as exc:
        raise BackendError("backend_protocol_error", f"malformed usage: {raw!r}") from exc
