"""The ollama adapter: Ollama's native API (``/api/chat``, ``/api/generate``), streaming NDJSON.

Usage comes from the final object's ``prompt_eval_count``/``eval_count``. Cancelling a run closes
the HTTP stream, which is how Ollama learns to stop generating. The lines that arrive in one
network read are forwarded as one delta (one token per line), as in the vllm adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attrs import field, frozen

from ..wire import Usage
from .base import BackendError, Completion, ExecutionSpec, RunSink
from .http import HttpAdapter, HttpBackendConfig, LineReader, open_stream, parse_json_line


@frozen
class OllamaConfig(HttpBackendConfig):
    base_url: str = "http://127.0.0.1:11434"
    #: How long Ollama keeps a model loaded after a request (Ollama's own default when empty).
    keep_alive: str = ""


@frozen
class OllamaOptions:
    #: Per-model ``keep_alive``, overriding the adapter's.
    keep_alive: str = ""
    #: Extra Ollama ``options`` (e.g. ``num_ctx``, ``top_k``, ``repeat_penalty``).
    options: dict[str, Any] = field(factory=dict)


def ollama_options(spec: ExecutionSpec, extra: dict[str, Any]) -> dict[str, Any]:
    params = spec.params
    mapped: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "num_predict": params.max_tokens,
        "seed": params.seed,
        "stop": list(params.stop) or None,
    }
    return {**extra, **{key: value for key, value in mapped.items() if value is not None}}


class OllamaAdapter(HttpAdapter):
    name = "ollama"
    models_path, models_key, model_name_key = "/api/tags", "models", "name"
    config: OllamaConfig

    async def execute(self, spec: ExecutionSpec, sink: RunSink) -> Completion:
        options: OllamaOptions = spec.options or OllamaOptions()
        body: dict[str, Any] = {
            "model": spec.backend_model,
            "stream": True,
            "options": ollama_options(spec, options.options),
        }
        keep_alive = options.keep_alive or self.config.keep_alive
        if keep_alive:
            body["keep_alive"] = keep_alive
        if spec.kind == "chat":
            path, text_of = "/api/chat", _chat_text
            body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
        else:
            path, text_of = "/api/generate", _generate_text
            body["prompt"] = spec.prompt
        timeout = self.config.read_timeout
        async with open_stream(self._client, path, body, timeout) as response:
            await sink.started()
            lines = LineReader(response, timeout)
            while (batch := await lines.next_batch()) is not None:
                texts, completion, error = _read(batch, text_of)
                if texts:
                    await sink.delta("".join(texts), len(texts))
                if error is not None:
                    raise error
                if completion is not None:
                    assert completion.usage is not None
                    sink.report_prompt_tokens(completion.usage.prompt_tokens)
                    await lines.finish()
                    return completion
        raise BackendError("backend_protocol_error", "ollama stream ended before done=true")


def _read(
    lines: list[str], text_of: Callable[[dict[str, Any]], str]
) -> tuple[list[str], Completion | None, BackendError | None]:
    """The texts in ``lines``; the completion if the last object (``done``) is among them; the
    error that stopped reading them, if any (the text before it still reaches the client)."""
    texts: list[str] = []
    for line in lines:
        try:
            data = parse_json_line(line, "NDJSON line")
        except BackendError as exc:
            return texts, None, exc
        if "error" in data:
            return texts, None, BackendError("backend_error", f"ollama: {data['error']}")
        if text := text_of(data):
            texts.append(text)
        if data.get("done"):
            usage = Usage(int(data.get("prompt_eval_count") or 0), int(data.get("eval_count") or 0))
            reason = "length" if data.get("done_reason") == "length" else "stop"
            return texts, Completion(reason, usage), None
    return texts, None, None


def _chat_text(data: dict[str, Any]) -> str:
    message = data.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else ""


def _generate_text(data: dict[str, Any]) -> str:
    content = data.get("response")
    return content if isinstance(content, str) else ""
