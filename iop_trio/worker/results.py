"""Batch output in OpenAI's line format, and the last step of a batch: writing its files.

Every id here is derived from the batch id (and line number), never random: a worker that dies
while finalizing, or two workers finalizing the same frozen batch, write byte-identical files
under the same names, so finalizing is safe to repeat.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from attrs import frozen

from ..store.batches import BatchStore, Ending, FileRecord, LineRow

log = logging.getLogger("iop_trio.worker")

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."


@frozen
class LineResponse:
    """What the edge answered for one line."""

    status_code: int
    request_id: str
    body: Any

    @property
    def ok(self) -> bool:
        return 200 <= self.status_code < 300


@frozen
class LineFailure:
    """A line that got no answer to record (the request timed out)."""

    code: str
    message: str


def render(batch_id: str, line_no: int, custom_id: str, outcome: LineResponse | LineFailure) -> tuple[str, bool]:
    """A line's output line, and whether it belongs in the output file (else the error file)."""
    if isinstance(outcome, LineFailure):
        return error_line(batch_id, line_no, custom_id, outcome.code, outcome.message), False
    return response_line(batch_id, line_no, custom_id, outcome), outcome.ok


def _derived(prefix: str, *parts: object) -> str:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return prefix + digest[:24]


def request_id(batch_id: str, line_no: int) -> str:
    return _derived("batch_req_", batch_id, line_no)


def response_line(batch_id: str, line_no: int, custom_id: str, response: LineResponse) -> str:
    response_json = {"status_code": response.status_code, "request_id": response.request_id, "body": response.body}
    return _dumps({"id": request_id(batch_id, line_no), "custom_id": custom_id, "response": response_json, "error": None})


def error_line(batch_id: str, line_no: int, custom_id: str, code: str, message: str) -> str:
    error = {"code": code, "message": message}
    return _dumps({"id": request_id(batch_id, line_no), "custom_id": custom_id, "response": None, "error": error})


def _dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def split_results(batch_id: str, ending: Ending, rows: list[LineRow]) -> tuple[list[str], list[str]]:
    """(output lines, error lines) in input order. Lines without a result appear only when the
    batch expired: as ``batch_expired`` errors. (A cancelled batch lists what ran.)"""
    output: list[str] = []
    errors: list[str] = []
    for row in rows:
        if row.result is not None:
            (output if row.ok else errors).append(row.result)
        elif ending == "expired":
            errors.append(error_line(batch_id, row.line_no, row.custom_id, "batch_expired", EXPIRED_MESSAGE))
    return output, errors


async def finalize(store: BatchStore, batch_id: str, ending: Ending, now: float) -> bool:
    """Write the output and error files of a frozen batch and give it its final status. False if
    someone else finished it first (their files are the same as these)."""
    output_lines, error_lines = split_results(batch_id, ending, await store.lines(batch_id))
    output = await _write(store, batch_id, "output", output_lines, now)
    errors = await _write(store, batch_id, "error", error_lines, now)
    finished = await store.finish(batch_id, ending, output, errors, now)
    if finished:
        log.info(
            "batch finished",
            extra={"batch_id": batch_id, "status": ending, "output_lines": len(output_lines), "error_lines": len(error_lines)},
        )
    else:
        # Whoever finished first registered the same files, unless one was deleted since.
        for record in (output, errors):
            if record is not None and await store.get_file(record.id) is None:
                await store.discard_content(record.id)
    return finished


async def _write(store: BatchStore, batch_id: str, kind: str, lines: list[str], now: float) -> FileRecord | None:
    if not lines:
        return None
    file_id = _derived("file-", batch_id, kind)
    return await store.write_output(file_id, f"{batch_id}_{kind}.jsonl", lines, now)
