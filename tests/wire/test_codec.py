"""JsonCodec and ProtocolConnection: envelopes, strict message decoding, the sticky error state."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import pytest

from iop_trio.wire import (
    CLOSED,
    MESSAGE_TYPES,
    NEED_DATA,
    CancelRequest,
    ChatMessage,
    Drain,
    Error,
    FrameTooLargeError,
    Heartbeat,
    JsonCodec,
    LocalProtocolError,
    Message,
    NodeConfig,
    ProtocolConnection,
    RegisterRequest,
    RegisterResponse,
    RemoteProtocolError,
    RunEvent,
    RunRequest,
    SamplingParams,
    UnknownMessageTypeError,
    Usage,
    encode_frame,
)

# --------------------------------------------------------------------------- helpers


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def envelope(type_name: Any, payload: Any) -> bytes:
    return json.dumps({"type": type_name, "payload": payload}).encode("utf-8")


#: A valid frame that follows the frame under test in the "trailing" feed mode.
NEXT_FRAME = frame(b'{"type":"heartbeat","payload":{"seq":99}}')

FEED_MODES = ["whole", "bytewise", "trailing"]


def feed(conn: ProtocolConnection, data: bytes, mode: str) -> None:
    """Feed one complete frame so that the next ``next_message`` call must decode it.

    ``bytewise`` also checks that nothing is decoded (or rejected) before the last byte.
    ``trailing`` appends part of a further, valid frame.
    """
    if mode == "whole":
        conn.receive_data(data)
    elif mode == "bytewise":
        for i, byte in enumerate(data[:-1]):
            conn.receive_data(bytes([byte]))
            assert conn.next_message() is NEED_DATA, f"after {i + 1} of {len(data)} bytes"
            assert not conn.errored
        conn.receive_data(data[-1:])
    elif mode == "trailing":
        conn.receive_data(data + NEXT_FRAME[:7])
    else:  # pragma: no cover
        raise AssertionError(mode)


def assert_sticky_error(
    conn: ProtocolConnection, original: Exception, *, eof_seen: bool = False
) -> None:
    """After a RemoteProtocolError nothing more is decoded, whatever arrives."""
    assert conn.errored
    for _ in range(2):
        with pytest.raises(RemoteProtocolError) as info:
            conn.next_message()
        assert "error state" in str(info.value)
        assert str(original) in str(info.value)
    if not eof_seen:
        # Even a perfectly good frame (or a clean EOF) does not revive the connection.
        conn.receive_data(frame(JsonCodec().encode(Heartbeat(seq=1))))
        with pytest.raises(RemoteProtocolError):
            conn.next_message()
        conn.receive_data(b"")
    with pytest.raises(RemoteProtocolError):
        conn.next_message()
    assert conn.errored


# --------------------------------------------------------------------------- examples

EXAMPLES: list[Any] = [
    pytest.param(
        RegisterRequest(token="t0k", node_id="node-1", version="0.1.0"), id="register.request-min"
    ),
    pytest.param(
        RegisterRequest(
            token="secret",
            node_id="node-ü",
            version="1.2.3",
            adapters=("mock", "llama.cpp"),
            models=("tiny", "small", "тест"),
            capacity=8,
            labels={"zone": "eu-1", "gpu": "", "ключ": "значение"},
        ),
        id="register.request-full",
    ),
    pytest.param(RegisterResponse(accepted=False, reason="bad token"), id="register.response-min"),
    pytest.param(
        RegisterResponse(
            accepted=True,
            config=NodeConfig(
                max_concurrency=4,
                heartbeat_interval=2.5,
                models=("tiny",),
                labels={"pool": "default"},
            ),
        ),
        id="register.response-config",
    ),
    pytest.param(
        RegisterResponse(
            accepted=True, config=NodeConfig(max_concurrency=0, heartbeat_interval=0.0)
        ),
        id="register.response-config-defaults",
    ),
    pytest.param(RunRequest(run_id="r1", model="tiny"), id="run.request-min"),
    pytest.param(
        RunRequest(
            run_id="r2",
            model="tiny",
            kind="chat",
            messages=(
                ChatMessage(role="system", content="be brief"),
                ChatMessage(role="user", content='hi "there"\n\u2603'),
            ),
            params=SamplingParams(
                max_tokens=128, temperature=0.7, top_p=0.95, stop=("\n\n", "END"), seed=-42
            ),
            deadline=30.0,
        ),
        id="run.request-chat-full",
    ),
    pytest.param(
        RunRequest(
            run_id="r3",
            model="tiny",
            kind="completion",
            prompt="Once upon a time",
            params=SamplingParams(temperature=0.0, seed=2**53 - 1),
            deadline=0.001,
        ),
        id="run.request-completion",
    ),
    pytest.param(RunEvent(run_id="r1", kind="start"), id="run.event-start"),
    pytest.param(RunEvent(run_id="r1", kind="delta", text="Hel", tokens=1), id="run.event-delta"),
    pytest.param(
        RunEvent(
            run_id="r1",
            kind="complete",
            finish_reason="stop",
            usage=Usage(prompt_tokens=12, completion_tokens=34),
        ),
        id="run.event-complete",
    ),
    pytest.param(
        RunEvent(run_id="r1", kind="error", code="cancelled", message="client went away"),
        id="run.event-error",
    ),
    pytest.param(CancelRequest(run_id="r1"), id="cancel.request-min"),
    pytest.param(CancelRequest(run_id="r1", reason="client disconnected"), id="cancel.request"),
    pytest.param(Heartbeat(), id="heartbeat-default"),
    pytest.param(Drain(reason="SIGTERM"), id="drain"),
    pytest.param(Heartbeat(seq=2**40), id="heartbeat-big"),
    pytest.param(Error(code="unknown_run", message="no such run"), id="error-min"),
    pytest.param(Error(code="bad_frame", message="", run_id="r9"), id="error-run-id"),
]

EXAMPLE_MESSAGES: list[Message] = [p.values[0] for p in EXAMPLES]
MESSAGE_CLASSES = tuple(MESSAGE_TYPES.values())


def test_examples_cover_every_message_type() -> None:
    assert {type(m) for m in EXAMPLE_MESSAGES} == set(MESSAGE_TYPES.values())
    # ...including every RunEvent / RunRequest kind.
    assert {m.kind for m in EXAMPLE_MESSAGES if isinstance(m, RunEvent)} == {
        "start",
        "delta",
        "complete",
        "error",
    }
    assert {m.kind for m in EXAMPLE_MESSAGES if isinstance(m, RunRequest)} == {
        "chat",
        "completion",
    }


def test_message_type_names() -> None:
    assert MESSAGE_TYPES == {
        "register.request": RegisterRequest,
        "register.response": RegisterResponse,
        "run.request": RunRequest,
        "run.event": RunEvent,
        "cancel.request": CancelRequest,
        "heartbeat": Heartbeat,
        "node.drain": Drain,
        "error": Error,
    }


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("message", EXAMPLES)
def test_codec_round_trip(message: Message) -> None:
    codec = JsonCodec()
    encoded = codec.encode(message)
    assert isinstance(encoded, bytes)
    decoded = codec.decode(encoded)
    assert type(decoded) is type(message)
    assert decoded == message


@pytest.mark.parametrize("message", EXAMPLES)
def test_envelope_shape(message: Message) -> None:
    doc = json.loads(JsonCodec().encode(message))
    assert set(doc) == {"type", "payload"}
    assert MESSAGE_TYPES[doc["type"]] is type(message)
    assert isinstance(doc["payload"], dict)


@pytest.mark.parametrize("mode", FEED_MODES)
@pytest.mark.parametrize("message", EXAMPLES)
def test_connection_round_trip(message: Message, mode: str) -> None:
    sender, receiver = ProtocolConnection(), ProtocolConnection()
    data = sender.send(message)
    feed(receiver, data, mode)
    decoded = receiver.next_message()
    assert type(decoded) is type(message)
    assert decoded == message
    assert receiver.next_message() is NEED_DATA
    assert not receiver.errored
    if mode == "trailing":
        receiver.receive_data(NEXT_FRAME[7:])
        assert receiver.next_message() == Heartbeat(seq=99)
    receiver.receive_data(b"")
    assert receiver.next_message() is CLOSED
    assert receiver.next_message() is CLOSED


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7, 64, 10_000])
def test_connection_stream_of_all_examples(chunk_size: int) -> None:
    sender, receiver = ProtocolConnection(), ProtocolConnection()
    data = b"".join(sender.send(m) for m in EXAMPLE_MESSAGES)
    got: list[Any] = []
    for start in range(0, len(data), chunk_size):
        receiver.receive_data(data[start : start + chunk_size])
        while (result := receiver.next_message()) is not NEED_DATA:
            got.append(result)
    assert got == EXAMPLE_MESSAGES
    receiver.receive_data(b"")
    assert receiver.next_message() is CLOSED


def test_send_is_encode_frame_of_codec_output() -> None:
    message = RunEvent(run_id="r", kind="delta", text="x")
    conn = ProtocolConnection()
    assert conn.send(message) == encode_frame(JsonCodec().encode(message))
    assert conn.send(message) == frame(JsonCodec().encode(message))


# --------------------------------------------------------------------------- exact wire format


def test_wire_format_heartbeat() -> None:
    assert JsonCodec().encode(Heartbeat(seq=3)) == b'{"type":"heartbeat","payload":{"seq":3}}'


def test_wire_format_run_event_with_usage() -> None:
    encoded = JsonCodec().encode(
        RunEvent(run_id="r", kind="complete", usage=Usage(prompt_tokens=1, completion_tokens=2))
    )
    assert json.loads(encoded) == {
        "type": "run.event",
        "payload": {
            "run_id": "r",
            "kind": "complete",
            "text": "",
            "tokens": 0,
            "finish_reason": None,
            "usage": {"prompt_tokens": 1, "completion_tokens": 2},
            "code": "",
            "message": "",
        },
    }


def test_wire_format_run_request_tuples_become_lists() -> None:
    encoded = JsonCodec().encode(
        RunRequest(
            run_id="r",
            model="m",
            messages=(ChatMessage(role="user", content="hi"),),
            params=SamplingParams(stop=("a", "b")),
        )
    )
    payload = json.loads(encoded)["payload"]
    assert payload["messages"] == [{"role": "user", "content": "hi"}]
    assert payload["params"] == {
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "stop": ["a", "b"],
        "seed": None,
    }
    assert payload["kind"] == "chat"
    assert payload["deadline"] is None


def test_wire_format_is_compact_utf8() -> None:
    encoded = JsonCodec().encode(CancelRequest(run_id="ключ-☃"))
    assert "ключ-☃".encode() in encoded
    assert b"\\u" not in encoded
    assert b" " not in encoded


def test_codec_name() -> None:
    assert JsonCodec.name == "json"
    assert ProtocolConnection().codec.name == "json"


# --------------------------------------------------------------------------- lenient-but-valid input


def test_envelope_key_order_and_whitespace_do_not_matter() -> None:
    raw = b' { "payload" : { "seq" : 7 } ,\n "type" : "heartbeat" } '
    assert JsonCodec().decode(raw) == Heartbeat(seq=7)


@pytest.mark.parametrize(
    ("type_name", "payload", "expected"),
    [
        ("heartbeat", {}, Heartbeat(seq=0)),
        ("cancel.request", {"run_id": "r"}, CancelRequest(run_id="r", reason="")),
        ("run.request", {"run_id": "r", "model": "m"}, RunRequest(run_id="r", model="m")),
        (
            "register.request",
            {"token": "t", "node_id": "n", "version": "v"},
            RegisterRequest(token="t", node_id="n", version="v"),
        ),
        ("register.response", {"accepted": True}, RegisterResponse(accepted=True)),
        ("error", {"code": "c", "message": "m"}, Error(code="c", message="m", run_id=None)),
        ("run.event", {"run_id": "r", "kind": "start"}, RunEvent(run_id="r", kind="start")),
    ],
)
def test_optional_fields_may_be_omitted(type_name: str, payload: Any, expected: Message) -> None:
    assert JsonCodec().decode(envelope(type_name, payload)) == expected


def test_explicit_nulls_for_optional_fields() -> None:
    decoded = JsonCodec().decode(
        envelope(
            "run.event",
            {"run_id": "r", "kind": "complete", "finish_reason": None, "usage": None},
        )
    )
    assert decoded == RunEvent(run_id="r", kind="complete")


def test_json_int_accepted_for_float_field() -> None:
    decoded = JsonCodec().decode(
        envelope(
            "run.request",
            {"run_id": "r", "model": "m", "deadline": 5, "params": {"temperature": 1}},
        )
    )
    assert isinstance(decoded, RunRequest)
    assert decoded.deadline == 5.0
    assert type(decoded.deadline) is float
    assert type(decoded.params.temperature) is float


def test_decoded_sequences_are_tuples_and_nested_classes_are_structured() -> None:
    decoded = JsonCodec().decode(
        envelope(
            "run.request",
            {
                "run_id": "r",
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "params": {"stop": ["x"]},
            },
        )
    )
    assert isinstance(decoded, RunRequest)
    assert decoded.messages == (ChatMessage(role="user", content="hi"),)
    assert isinstance(decoded.messages, tuple)
    assert isinstance(decoded.messages[0], ChatMessage)
    assert isinstance(decoded.params, SamplingParams)
    assert decoded.params.stop == ("x",)
    assert isinstance(decoded.params.stop, tuple)


# --------------------------------------------------------------------------- rejected input

# (id, frame payload, expected exception type, substrings the message must contain)
BAD_PAYLOADS: list[tuple[str, bytes, type[RemoteProtocolError], list[str]]] = [
    # -- not JSON at all
    ("not-json", b"not json", RemoteProtocolError, ["not valid JSON"]),
    ("empty", b"", RemoteProtocolError, ["not valid JSON"]),
    ("truncated-json", b'{"type":"heartbeat","payload":{', RemoteProtocolError, ["not valid JSON"]),
    (
        "invalid-utf8",
        b'{"type":"heartbeat","payload":{"seq":"\xff\xfe"}}',
        RemoteProtocolError,
        ["not valid JSON"],
    ),
    ("invalid-utf8-start", b"\xff", RemoteProtocolError, ["not valid JSON"]),
    ("deeply-nested", b"[" * 100_000, RemoteProtocolError, ["not valid JSON"]),
    (
        "int-too-many-digits",
        b'{"type":"heartbeat","payload":{"seq":' + b"1" * 5000 + b"}}",
        RemoteProtocolError,
        ["not valid JSON"],
    ),
    # -- JSON, but not an envelope object
    ("array", b'["heartbeat", {}]', RemoteProtocolError, ["envelope"]),
    ("string", b'"heartbeat"', RemoteProtocolError, ["envelope"]),
    ("number", b"42", RemoteProtocolError, ["envelope"]),
    ("null", b"null", RemoteProtocolError, ["envelope"]),
    ("true", b"true", RemoteProtocolError, ["envelope"]),
    # -- wrong envelope keys
    ("missing-type", b'{"payload":{}}', RemoteProtocolError, ["envelope", "'type'"]),
    ("missing-payload", b'{"type":"heartbeat"}', RemoteProtocolError, ["envelope", "'payload'"]),
    ("empty-object", b"{}", RemoteProtocolError, ["envelope"]),
    (
        "extra-envelope-key",
        b'{"type":"heartbeat","payload":{},"id":1}',
        RemoteProtocolError,
        ["envelope", "exactly"],
    ),
    # -- envelope type
    ("type-int", envelope(5, {}), RemoteProtocolError, ["'type' must be a string"]),
    ("type-null", envelope(None, {}), RemoteProtocolError, ["'type' must be a string"]),
    ("type-list", envelope(["heartbeat"], {}), RemoteProtocolError, ["'type' must be a string"]),
    ("type-object", envelope({"a": 1}, {}), RemoteProtocolError, ["'type' must be a string"]),
    ("type-bool", envelope(True, {}), RemoteProtocolError, ["'type' must be a string"]),
    ("unknown-type", envelope("bogus", {}), UnknownMessageTypeError, ["'bogus'"]),
    ("unknown-type-case", envelope("Heartbeat", {}), UnknownMessageTypeError, ["'Heartbeat'"]),
    ("unknown-type-empty", envelope("", {}), UnknownMessageTypeError, ["unknown message type"]),
    ("unknown-type-class-name", envelope("RunEvent", {}), UnknownMessageTypeError, ["RunEvent"]),
    # -- payload not an object
    ("payload-list", envelope("heartbeat", []), RemoteProtocolError, ["heartbeat payload"]),
    ("payload-string", envelope("heartbeat", "x"), RemoteProtocolError, ["heartbeat payload"]),
    ("payload-null", envelope("run.event", None), RemoteProtocolError, ["run.event payload"]),
    ("payload-number", envelope("error", 5), RemoteProtocolError, ["error payload"]),
    # -- wrong scalar field types
    (
        "int-for-str",
        envelope("cancel.request", {"run_id": 5}),
        RemoteProtocolError,
        ["cancel.request.run_id", "str"],
    ),
    (
        "null-for-str",
        envelope("cancel.request", {"run_id": None}),
        RemoteProtocolError,
        ["cancel.request.run_id"],
    ),
    (
        "list-for-str",
        envelope("cancel.request", {"run_id": ["r"]}),
        RemoteProtocolError,
        ["cancel.request.run_id"],
    ),
    (
        "str-for-int",
        envelope("heartbeat", {"seq": "5"}),
        RemoteProtocolError,
        ["heartbeat.seq", "int"],
    ),
    (
        "bool-for-int",
        envelope("heartbeat", {"seq": True}),
        RemoteProtocolError,
        ["heartbeat.seq", "int"],
    ),
    (
        "float-for-int",
        envelope("heartbeat", {"seq": 1.0}),
        RemoteProtocolError,
        ["heartbeat.seq"],
    ),
    (
        "null-for-int",
        envelope("heartbeat", {"seq": None}),
        RemoteProtocolError,
        ["heartbeat.seq"],
    ),
    (
        "int-for-bool",
        envelope("register.response", {"accepted": 1}),
        RemoteProtocolError,
        ["register.response.accepted", "bool"],
    ),
    (
        "str-for-bool",
        envelope("register.response", {"accepted": "true"}),
        RemoteProtocolError,
        ["register.response.accepted"],
    ),
    (
        "str-for-optional-int",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"max_tokens": "5"}}),
        RemoteProtocolError,
        ["run.request.params.max_tokens"],
    ),
    (
        "bool-for-optional-int",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"seed": False}}),
        RemoteProtocolError,
        ["run.request.params.seed"],
    ),
    (
        "float-for-optional-int",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"max_tokens": 1.5}}),
        RemoteProtocolError,
        ["run.request.params.max_tokens"],
    ),
    (
        "str-for-float",
        envelope("run.request", {"run_id": "r", "model": "m", "deadline": "soon"}),
        RemoteProtocolError,
        ["run.request.deadline"],
    ),
    (
        "bool-for-float",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"temperature": True}}),
        RemoteProtocolError,
        ["run.request.params.temperature"],
    ),
    (
        "huge-int-for-float",
        envelope("run.request", {"run_id": "r", "model": "m", "deadline": 10**400}),
        RemoteProtocolError,
        ["run.request.deadline"],
    ),
    (
        "str-for-int-nested",
        envelope("run.event", {"run_id": "r", "kind": "complete", "usage": {"prompt_tokens": "x"}}),
        RemoteProtocolError,
        ["run.event.usage.prompt_tokens"],
    ),
    (
        "str-for-float-nested",
        envelope(
            "register.response",
            {"accepted": True, "config": {"max_concurrency": 1, "heartbeat_interval": "1s"}},
        ),
        RemoteProtocolError,
        ["register.response.config.heartbeat_interval"],
    ),
    (
        "int-for-optional-str",
        envelope("error", {"code": "c", "message": "m", "run_id": 5}),
        RemoteProtocolError,
        ["error.run_id"],
    ),
    # -- wrong container types
    (
        "str-for-tuple",
        envelope(
            "register.request", {"token": "t", "node_id": "n", "version": "v", "models": "abc"}
        ),
        RemoteProtocolError,
        ["register.request.models"],
    ),
    (
        "dict-for-tuple",
        envelope(
            "register.request",
            {"token": "t", "node_id": "n", "version": "v", "adapters": {"a": "b"}},
        ),
        RemoteProtocolError,
        ["register.request.adapters"],
    ),
    (
        "str-for-tuple-nested",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"stop": "END"}}),
        RemoteProtocolError,
        ["run.request.params.stop"],
    ),
    (
        "int-item-in-tuple",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"stop": ["a", 1]}}),
        RemoteProtocolError,
        ["run.request.params.stop"],
    ),
    (
        "str-for-tuple-of-classes",
        envelope("run.request", {"run_id": "r", "model": "m", "messages": "hi"}),
        RemoteProtocolError,
        ["run.request.messages"],
    ),
    (
        "int-item-in-tuple-of-classes",
        envelope("run.request", {"run_id": "r", "model": "m", "messages": [1]}),
        RemoteProtocolError,
        ["run.request.messages"],
    ),
    (
        "bad-field-in-tuple-of-classes",
        envelope(
            "run.request",
            {"run_id": "r", "model": "m", "messages": [{"role": "user", "content": 5}]},
        ),
        RemoteProtocolError,
        ["run.request.messages"],
    ),
    (
        "list-for-dict",
        envelope(
            "register.request", {"token": "t", "node_id": "n", "version": "v", "labels": ["a"]}
        ),
        RemoteProtocolError,
        ["register.request.labels"],
    ),
    (
        "str-for-dict",
        envelope(
            "register.request", {"token": "t", "node_id": "n", "version": "v", "labels": "a=b"}
        ),
        RemoteProtocolError,
        ["register.request.labels"],
    ),
    (
        "int-value-in-dict",
        envelope(
            "register.request", {"token": "t", "node_id": "n", "version": "v", "labels": {"a": 1}}
        ),
        RemoteProtocolError,
        ["register.request.labels"],
    ),
    (
        "list-for-dict-nested",
        envelope(
            "register.response",
            {
                "accepted": True,
                "config": {"max_concurrency": 1, "heartbeat_interval": 1.0, "labels": []},
            },
        ),
        RemoteProtocolError,
        ["register.response.config.labels"],
    ),
    (
        "str-for-class",
        envelope("register.response", {"accepted": True, "config": "x"}),
        RemoteProtocolError,
        ["register.response.config"],
    ),
    (
        "list-for-class",
        envelope("run.request", {"run_id": "r", "model": "m", "params": []}),
        RemoteProtocolError,
        ["run.request.params"],
    ),
    (
        "int-for-class",
        envelope("run.event", {"run_id": "r", "kind": "complete", "usage": 3}),
        RemoteProtocolError,
        ["run.event.usage"],
    ),
    # -- unknown fields
    (
        "unknown-field",
        envelope("heartbeat", {"seq": 1, "seqq": 2}),
        RemoteProtocolError,
        ["heartbeat", "seqq"],
    ),
    (
        "unknown-field-only",
        envelope("cancel.request", {"run_id": "r", "why": "x"}),
        RemoteProtocolError,
        ["cancel.request", "why"],
    ),
    (
        "unknown-field-nested",
        envelope("run.request", {"run_id": "r", "model": "m", "params": {"top_k": 5}}),
        RemoteProtocolError,
        ["run.request.params", "top_k"],
    ),
    (
        "unknown-field-in-config",
        envelope(
            "register.response",
            {
                "accepted": True,
                "config": {"max_concurrency": 1, "heartbeat_interval": 1.0, "extra": 1},
            },
        ),
        RemoteProtocolError,
        ["register.response.config", "extra"],
    ),
    (
        "unknown-field-in-usage",
        envelope(
            "run.event",
            {"run_id": "r", "kind": "complete", "usage": {"total_tokens": 3}},
        ),
        RemoteProtocolError,
        ["run.event.usage", "total_tokens"],
    ),
    (
        "unknown-field-in-chat-message",
        envelope(
            "run.request",
            {
                "run_id": "r",
                "model": "m",
                "messages": [{"role": "user", "content": "x", "name": "bob"}],
            },
        ),
        RemoteProtocolError,
        ["run.request.messages"],
    ),
    # -- Literal values
    (
        "bogus-event-kind",
        envelope("run.event", {"run_id": "r", "kind": "bogus"}),
        RemoteProtocolError,
        ["run.event.kind", "bogus"],
    ),
    (
        "event-kind-wrong-case",
        envelope("run.event", {"run_id": "r", "kind": "START"}),
        RemoteProtocolError,
        ["run.event.kind"],
    ),
    (
        "event-kind-null",
        envelope("run.event", {"run_id": "r", "kind": None}),
        RemoteProtocolError,
        ["run.event.kind"],
    ),
    (
        "event-kind-int",
        envelope("run.event", {"run_id": "r", "kind": 0}),
        RemoteProtocolError,
        ["run.event.kind"],
    ),
    (
        "event-kind-list",
        envelope("run.event", {"run_id": "r", "kind": ["start"]}),
        RemoteProtocolError,
        ["run.event.kind"],
    ),
    (
        "event-kind-object",
        envelope("run.event", {"run_id": "r", "kind": {}}),
        RemoteProtocolError,
        ["run.event.kind"],
    ),
    (
        "run-kind-bogus",
        envelope("run.request", {"run_id": "r", "model": "m", "kind": "embedding"}),
        RemoteProtocolError,
        ["run.request.kind", "embedding"],
    ),
    (
        "run-kind-is-event-kind",
        envelope("run.request", {"run_id": "r", "model": "m", "kind": "start"}),
        RemoteProtocolError,
        ["run.request.kind"],
    ),
    # -- missing required fields
    (
        "missing-run-id",
        envelope("cancel.request", {}),
        RemoteProtocolError,
        ["cancel.request.run_id", "missing"],
    ),
    (
        "missing-kind",
        envelope("run.event", {"run_id": "r"}),
        RemoteProtocolError,
        ["run.event.kind", "missing"],
    ),
    (
        "missing-model",
        envelope("run.request", {"run_id": "r"}),
        RemoteProtocolError,
        ["run.request.model", "missing"],
    ),
    (
        "missing-token",
        envelope("register.request", {"node_id": "n", "version": "v"}),
        RemoteProtocolError,
        ["register.request.token", "missing"],
    ),
    (
        "missing-accepted",
        envelope("register.response", {"reason": "r"}),
        RemoteProtocolError,
        ["register.response.accepted", "missing"],
    ),
    (
        "missing-error-message",
        envelope("error", {"code": "c"}),
        RemoteProtocolError,
        ["error.message", "missing"],
    ),
    (
        "missing-nested-config-field",
        envelope("register.response", {"accepted": True, "config": {"heartbeat_interval": 1.0}}),
        RemoteProtocolError,
        ["register.response.config.max_concurrency", "missing"],
    ),
    (
        "missing-chat-message-content",
        envelope("run.request", {"run_id": "r", "model": "m", "messages": [{"role": "user"}]}),
        RemoteProtocolError,
        ["run.request.messages", "content"],
    ),
]


def _bad_params() -> list[Any]:
    return [
        pytest.param(raw, exc_type, needles, id=case_id)
        for case_id, raw, exc_type, needles in BAD_PAYLOADS
    ]


def test_bad_payload_ids_are_unique() -> None:
    ids = [case[0] for case in BAD_PAYLOADS]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(("raw", "exc_type", "needles"), _bad_params())
def test_codec_rejects(raw: bytes, exc_type: type[Exception], needles: list[str]) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        JsonCodec().decode(raw)
    assert type(info.value) is exc_type
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize("mode", FEED_MODES)
@pytest.mark.parametrize(("raw", "exc_type", "needles"), _bad_params())
def test_connection_rejects_and_stays_errored(
    raw: bytes, exc_type: type[Exception], needles: list[str], mode: str
) -> None:
    conn = ProtocolConnection()
    assert not conn.errored
    feed(conn, frame(raw), mode)
    with pytest.raises(RemoteProtocolError) as info:
        conn.next_message()
    assert type(info.value) is exc_type
    for needle in needles:
        assert needle in str(info.value)
    assert_sticky_error(conn, info.value)


@pytest.mark.parametrize("mode", FEED_MODES)
def test_bad_frame_after_good_frame(mode: str) -> None:
    """The good frame is delivered; the connection breaks only at the bad one."""
    conn = ProtocolConnection()
    good = frame(JsonCodec().encode(Heartbeat(seq=1)))
    bad = frame(envelope("run.event", {"run_id": "r", "kind": "bogus"}))
    if mode == "bytewise":
        for byte in good:
            conn.receive_data(bytes([byte]))
        assert conn.next_message() == Heartbeat(seq=1)
        feed(conn, bad, mode)
    else:
        feed(conn, good + bad, mode)
        assert conn.next_message() == Heartbeat(seq=1)
    assert not conn.errored
    with pytest.raises(RemoteProtocolError, match="run.event.kind") as info:
        conn.next_message()
    assert_sticky_error(conn, info.value)


def test_unknown_type_error_code() -> None:
    with pytest.raises(UnknownMessageTypeError) as info:
        JsonCodec().decode(envelope("nope", {}))
    assert info.value.code == "unknown_type"
    assert isinstance(info.value, RemoteProtocolError)


def test_plain_remote_protocol_error_code() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        JsonCodec().decode(envelope("heartbeat", {"seq": "x"}))
    assert info.value.code == "protocol_error"


# --------------------------------------------------------------------------- frame-level errors


@pytest.mark.parametrize("mode", ["whole", "bytewise"])
def test_connection_oversized_frame(mode: str) -> None:
    conn = ProtocolConnection(max_frame_size=16)
    data = struct.pack(">I", 17)
    if mode == "whole":
        conn.receive_data(data)
    else:
        for byte in data[:3]:
            conn.receive_data(bytes([byte]))
            assert conn.next_message() is NEED_DATA
        conn.receive_data(data[3:])
    with pytest.raises(FrameTooLargeError) as info:
        conn.next_message()
    assert info.value.code == "frame_too_large"
    assert_sticky_error(conn, info.value)


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_connection_eof_inside_frame(cut: int) -> None:
    conn = ProtocolConnection()
    conn.receive_data(ProtocolConnection().send(Heartbeat(seq=1))[:cut])
    assert conn.next_message() is NEED_DATA
    conn.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed inside a frame") as info:
        conn.next_message()
    assert_sticky_error(conn, info.value, eof_seen=True)


def test_connection_clean_eof() -> None:
    conn = ProtocolConnection()
    assert conn.next_message() is NEED_DATA
    conn.receive_data(b"")
    assert conn.next_message() is CLOSED
    assert conn.next_message() is CLOSED
    assert not conn.errored


def test_connection_receive_after_eof_is_local_error() -> None:
    conn = ProtocolConnection()
    conn.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"\x00\x00\x00\x00")
    assert not conn.errored
    assert conn.next_message() is CLOSED


# --------------------------------------------------------------------------- send


def test_send_refuses_message_over_frame_limit() -> None:
    conn = ProtocolConnection(max_frame_size=64)
    with pytest.raises(LocalProtocolError) as info:
        conn.send(RunEvent(run_id="r", kind="delta", text="x" * 100))
    assert not isinstance(info.value, RemoteProtocolError)
    assert "RunEvent" in str(info.value)
    # A refused send does not break the connection.
    assert not conn.errored
    assert conn.send(Heartbeat()) == frame(b'{"type":"heartbeat","payload":{"seq":0}}')


def test_send_at_exact_frame_limit() -> None:
    message = RunEvent(run_id="r", kind="delta", text="é" * 20)  # multi-byte: limit is in bytes
    size = len(JsonCodec().encode(message))
    data = ProtocolConnection(max_frame_size=size).send(message)
    receiver = ProtocolConnection(max_frame_size=size)
    receiver.receive_data(data)
    assert receiver.next_message() == message
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(max_frame_size=size - 1).send(message)


def test_receiver_with_smaller_limit_rejects_what_sender_allowed() -> None:
    message = RunEvent(run_id="r", kind="delta", text="x" * 100)
    receiver = ProtocolConnection(max_frame_size=64)
    receiver.receive_data(ProtocolConnection().send(message)[:4])
    with pytest.raises(FrameTooLargeError):
        receiver.next_message()


def test_send_still_works_after_receive_error() -> None:
    conn = ProtocolConnection()
    conn.receive_data(frame(b"garbage"))
    with pytest.raises(RemoteProtocolError):
        conn.next_message()
    # The side that saw the error can still report it to the peer.
    data = conn.send(Error(code="protocol_error", message="garbage"))
    peer = ProtocolConnection()
    peer.receive_data(data)
    assert peer.next_message() == Error(code="protocol_error", message="garbage")


# --------------------------------------------------------------------------- pluggable codec


class _UpperCodec:
    """A toy codec proving ProtocolConnection only talks to the Codec interface."""

    name = "toy"

    def __init__(self) -> None:
        self.decoded: list[bytes] = []

    def encode(self, message: Message) -> bytes:
        assert isinstance(message, CancelRequest)
        return message.run_id.encode()

    def decode(self, payload: bytes) -> Message:
        self.decoded.append(payload)
        if payload == b"bad":
            raise RemoteProtocolError("toy codec says no")
        return CancelRequest(run_id=payload.decode())


def test_connection_uses_given_codec() -> None:
    codec = _UpperCodec()
    conn = ProtocolConnection(codec=codec)
    assert conn.codec is codec
    assert conn.send(CancelRequest(run_id="abc")) == frame(b"abc")
    conn.receive_data(frame(b"xyz") + frame(b"bad"))
    assert conn.next_message() == CancelRequest(run_id="xyz")
    with pytest.raises(RemoteProtocolError, match="toy codec says no") as info:
        conn.next_message()
    assert codec.decoded == [b"xyz", b"bad"]
    assert_sticky_error(conn, info.value)
    assert codec.decoded == [b"xyz", b"bad"]  # nothing further reached the codec


# --------------------------------------------------------------------------- known bugs


def _decode_then_resend(raw: bytes) -> Callable[[], bytes] | None:
    conn = ProtocolConnection()
    conn.receive_data(frame(raw))
    try:
        message = conn.next_message()
    except RemoteProtocolError:
        return None
    assert isinstance(message, MESSAGE_CLASSES)
    decoded: Message = message
    return lambda: ProtocolConnection().send(decoded)


def test_lone_surrogate_is_rejected_or_resendable() -> None:
    raw = b'{"type":"cancel.request","payload":{"run_id":"\\ud800"}}'
    resend = _decode_then_resend(raw)
    if resend is not None:
        # Accepted on decode: then it must at least be possible to send it back.
        resend()


def test_non_finite_numbers_are_rejected_both_ways() -> None:
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        raw = b'{"type":"run.request","payload":{"run_id":"r","model":"m","deadline":' + constant + b"}}"
        conn = ProtocolConnection()
        conn.receive_data(frame(raw))
        with pytest.raises(RemoteProtocolError):
            conn.next_message()
    with pytest.raises(LocalProtocolError):
        ProtocolConnection().send(RunRequest(run_id="r", model="m", deadline=float("inf")))
