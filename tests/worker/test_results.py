"""Output lines in OpenAI's format, and finalizing: files derived from the batch, safe to repeat."""

from __future__ import annotations

import json

import trio

from iop_trio.store.batches import BatchStore, LineRow, NewLine
from iop_trio.worker.results import (
    LineFailure,
    LineResponse,
    finalize,
    render,
    request_id,
    split_results,
)

from .conftest import body, submit


def test_a_response_line_has_openais_shape() -> None:
    line, ok = render("batch_1", 3, "c3", LineResponse(200, "req_9", {"id": "chatcmpl-1"}))
    assert ok
    assert json.loads(line) == {
        "id": request_id("batch_1", 3), "custom_id": "c3",
        "response": {"status_code": 200, "request_id": "req_9", "body": {"id": "chatcmpl-1"}}, "error": None,
    }
    assert request_id("batch_1", 3) == request_id("batch_1", 3) != request_id("batch_1", 4)


def test_a_non_2xx_answer_or_a_failure_goes_to_the_error_file() -> None:
    _, ok = render("b", 1, "c", LineResponse(404, "req", {"error": {"message": "x"}}))
    assert not ok
    line, ok = render("b", 1, "c", LineFailure("request_timeout", "too slow"))
    assert not ok
    assert json.loads(line)["error"] == {"code": "request_timeout", "message": "too slow"}
    assert json.loads(line)["response"] is None


def test_only_an_expired_batch_lists_lines_that_never_ran() -> None:
    rows = [LineRow(1, "a", True, '{"a":1}'), LineRow(2, "b", False, '{"b":1}'), LineRow(3, "c", None, None)]
    assert split_results("batch", "cancelled", rows) == (['{"a":1}'], ['{"b":1}'])
    output, errors = split_results("batch", "expired", rows)
    assert output == ['{"a":1}'] and len(errors) == 2
    assert json.loads(errors[1])["error"]["code"] == "batch_expired"


async def test_finalizing_twice_writes_the_same_files_and_finishes_once(store: BatchStore, autojump_clock) -> None:
    batch_id = await submit(store, ["a", "b"])
    assert await store.begin_batch(batch_id, [NewLine(1, "id-a", body("a")), NewLine(2, "id-b", body("b"))], 0.0)
    for ok in (True, False):
        line = await store.claim_line(batch_id, "w", trio.current_time(), 10.0)
        assert line is not None
        text, _ = render(batch_id, line.line_no, line.custom_id, LineResponse(200 if ok else 500, "r", {}))
        assert await store.complete_line(line, text, ok, trio.current_time())
    assert await store.begin_finalizing(batch_id, trio.current_time())

    assert await finalize(store, batch_id, "completed", trio.current_time())
    batch = await store.get_batch(batch_id)
    assert batch is not None and batch.status == "completed"
    assert batch.output_file_id and batch.error_file_id
    first = (await store.read_file(batch.output_file_id), await store.read_file(batch.error_file_id))

    assert not await finalize(store, batch_id, "completed", trio.current_time())
    again = await store.get_batch(batch_id)
    assert again is not None and (again.output_file_id, again.error_file_id) == (batch.output_file_id, batch.error_file_id)
    assert (await store.read_file(batch.output_file_id), await store.read_file(batch.error_file_id)) == first
    output_file = await store.get_file(batch.output_file_id)
    assert output_file is not None and output_file.filename == f"{batch_id}_output.jsonl"
