"""The vllm adapter: any OpenAI-compatible server (vLLM, llama.cpp's server, SGLang, LM Studio,
TGI's Messages API).

Always streams upstream with ``stream_options.include_usage``, so the backend's own token counts
come back with the last chunk, and cancelling a run closes the stream (the server stops there).
The chunks that arrive in one network read are forwarded as one delta (counting one token per
chunk): under load that is one frame to the edge instead of one per token, and it adds no delay.
"""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

from ..wire import Usage
from .base import BackendError, Completion, ExecutionSpec, RunSink
from .http import HttpAdapter, HttpBackendConfig, LineReader, open_stream, parse_json_line


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
        stream = _StreamState(spec.kind)
        async with open_stream(self._client, path, body, self.config.read_timeout) as response:
            await sink.started()
            lines = LineReader(response, self.config.read_timeout)
            while not stream.done and (batch := await lines.next_batch()) is not None:
                usage_before = stream.usage
                texts, error = stream.read(batch)
                if texts:
                    await sink.delta("".join(texts), len(texts))
                if error is not None:
                    raise error
                if stream.usage is not usage_before and stream.usage is not None:
                    sink.report_prompt_tokens(stream.usage.prompt_tokens)
            await lines.finish()
        finish_reason, usage = stream.finish_reason, stream.usage
        if finish_reason is None:
            raise BackendError("backend_protocol_error", "stream ended without a finish_reason")
        return Completion(finish_reason, usage)


class _StreamState:
    """What the SSE stream has said so far: its finish reason, its usage, whether it is done."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.done = False

    def read(self, lines: list[str]) -> tuple[list[str], BackendError | None]:
        """The texts in ``lines``, and the error that stopped reading them, if any: the text
        before a bad chunk still reaches the client."""
        texts: list[str] = []
        for line in lines:
            if not line.startswith("data:"):
                continue  # SSE comments, event names, keep-alives
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                self.done = True
                break
            try:
                chunk = parse_json_line(data, "SSE chunk")
                if "error" in chunk:
                    raise BackendError("backend_error", f"backend error mid-stream: {chunk['error']}")
                for choice in chunk.get("choices") or ():
                    if text := _choice_text(choice, self.kind):
                        texts.append(text)
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
                if chunk.get("usage"):
                    self.usage = _usage(chunk["usage"])
            except BackendError as exc:
                return texts, exc
        return texts, None


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
