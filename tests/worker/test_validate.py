"""validate_input: a batch input file is all valid lines, or the errors OpenAI would list."""

from __future__ import annotations

import json

from iop_trio.worker.validate import MAX_ERRORS, validate_input

CHAT = "/v1/chat/completions"
MODELS = frozenset({"m"})


def line(custom_id: str = "a", *, url: str = CHAT, method: str = "POST", **body: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": {"model": "m", **body}})


def errors_of(*lines: str, endpoint: str = CHAT) -> list[tuple[str, int | None, str | None]]:
    _, errors = validate_input("\n".join(lines).encode(), endpoint, MODELS)
    return [(e.code, e.line, e.param) for e in errors]


def test_valid_lines_keep_their_file_line_numbers_and_bodies() -> None:
    content = (line("a") + "\n\n" + line("b", max_tokens=3) + "\n").encode()
    lines, errors = validate_input(content, CHAT, MODELS)
    assert errors == []
    assert [(x.line_no, x.custom_id) for x in lines] == [(1, "a"), (3, "b")]
    assert lines[1].body == {"model": "m", "max_tokens": 3}


def test_each_kind_of_invalid_line_is_reported_with_its_line_and_param() -> None:
    assert errors_of(
        line("a"),
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}),
        line("a"),
        line("b", method="GET"),
        line("c", url="/v1/completions"),
        json.dumps({"custom_id": "d", "method": "POST", "url": CHAT, "body": "text"}),
        line("e", stream=True),
        json.dumps({"custom_id": "f", "method": "POST", "url": CHAT, "body": {"model": "unknown"}}),
        "[" * 100_000,  # nested deeper than the decoder can recurse
    ) == [
        ("invalid_json_line", 2, None),
        ("invalid_request", 3, None),
        ("invalid_request", 4, "custom_id"),
        ("duplicate_custom_id", 5, "custom_id"),
        ("invalid_method", 6, "method"),
        ("mismatched_endpoint", 7, "url"),
        ("invalid_request", 8, "body"),
        ("invalid_request", 9, "body.stream"),
        ("model_not_found", 10, "body.model"),
        ("invalid_json_line", 11, None),
    ]


def test_an_empty_or_undecodable_file_is_one_error() -> None:
    assert errors_of("", "   ") == [("empty_file", None, None)]
    _, errors = validate_input(b"\xff\xfe", CHAT, MODELS)
    assert [e.code for e in errors] == ["invalid_file"]


def test_errors_are_capped() -> None:
    assert len(errors_of(*["nope"] * (MAX_ERRORS + 5))) == MAX_ERRORS


def test_error_api_shape() -> None:
    _, [error] = validate_input(b"{", CHAT, MODELS)
    assert error.to_api() == {
        "code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None, "line": 1,
    }
