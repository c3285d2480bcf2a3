"""Validating a batch input file: pure, no IO.

A batch either starts with every line valid or fails as a whole with its ``errors``, the way
OpenAI's Batch API does; the request bodies themselves are checked by the edge when each line runs
(an invalid body becomes that line's 400 response, not a batch failure).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from attrs import frozen

from ..store.batches import NewLine

#: More errors than this are not listed: the first ones are enough to fix the file.
MAX_ERRORS = 100


@frozen
class InputError:
    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def to_api(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def validate_input(content: bytes, endpoint: str, models: Collection[str]) -> tuple[list[NewLine], list[InputError]]:
    """The lines of a JSONL batch file, or the reasons it cannot run. ``models`` are those the
    platform serves right now; lines are numbered from 1 like the file's lines (blank ones skipped)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [InputError("invalid_file", "The input file is not UTF-8 encoded text.")]
    lines: list[NewLine] = []
    errors: list[InputError] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line, error = _parse_line(raw, number, endpoint, models, seen)
        if error is not None:
            errors.append(error)
        elif line is not None:
            seen.add(line.custom_id)
            lines.append(line)
    if not lines and not errors:
        errors.append(InputError("empty_file", "The input file contains no requests."))
    return lines, errors[:MAX_ERRORS]


def _parse_line(
    raw: str, number: int, endpoint: str, models: Collection[str], seen: set[str]
) -> tuple[NewLine | None, InputError | None]:
    try:
        request = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder recurses
        return None, InputError("invalid_json_line", "This line is not parseable as valid JSON.", number)
    if not isinstance(request, dict):
        return None, InputError("invalid_request", "Each line must be a JSON object.", number)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return None, InputError("invalid_request", "Missing required parameter: 'custom_id'.", number, "custom_id")
    if custom_id in seen:
        return None, InputError(
            "duplicate_custom_id",
            "The custom_id for this request is a duplicate of another request. "
            "The custom_id parameter must be unique for each request in a batch.",
            number,
            "custom_id",
        )
    if request.get("method") != "POST":
        return None, InputError("invalid_method", "The method must be 'POST'.", number, "method")
    if request.get("url") != endpoint:
        return None, InputError(
            "mismatched_endpoint",
            f"The URL provided for this request does not match the batch endpoint {endpoint}.",
            number,
            "url",
        )
    body = request.get("body")
    if not isinstance(body, dict):
        return None, InputError("invalid_request", "Missing required parameter: 'body'.", number, "body")
    if body.get("stream"):
        return None, InputError("invalid_request", "Streaming is not supported in a batch.", number, "body.stream")
    model = body.get("model")
    if not isinstance(model, str) or model not in models:
        return None, InputError(
            "model_not_found", f"The model `{model}` does not exist or no node serves it.", number, "body.model"
        )
    return NewLine(number, custom_id, body), None
