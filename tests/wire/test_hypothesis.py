"""Property tests for the wire layer: round trips, arbitrary chunking, and decoder fuzzing.

The decoder's contract (see ``iop_trio.wire.errors``): whatever bytes arrive, ``next_message``
returns a message, ``NEED_DATA`` or ``CLOSED``, or raises ``RemoteProtocolError`` -- never
anything else.
"""

from __future__ import annotations

import json
import struct
import typing
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iop_trio.wire import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    MESSAGE_TYPES,
    NEED_DATA,
    CancelRequest,
    ChatMessage,
    Drain,
    Error,
    Heartbeat,
    JsonCodec,
    Message,
    NodeConfig,
    ProtocolConnection,
    RegisterRequest,
    RegisterResponse,
    RemoteProtocolError,
    RunEvent,
    RunRequest,
    SamplingParams,
    Usage,
)
from iop_trio.wire.messages import EventKind, RunKind

ROUND_TRIP = settings(max_examples=200, deadline=None, database=None)
FUZZ = settings(
    max_examples=250,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

CODEC = JsonCodec()
MESSAGE_CLASSES = tuple(MESSAGE_TYPES.values())

# --------------------------------------------------------------------------- message strategies

JSON_INTS = st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
FLOATS = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=16)
STR_TUPLES = st.lists(TEXT, max_size=4).map(tuple)
STR_DICTS = st.dictionaries(TEXT, TEXT, max_size=4)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


#: Explicit field strategies for every attrs class on the wire (checked against attrs.fields).
FIELDS: dict[type, dict[str, st.SearchStrategy[Any]]] = {}

FIELDS[ChatMessage] = {"role": TEXT, "content": TEXT}
chat_messages = st.builds(ChatMessage, **FIELDS[ChatMessage])

FIELDS[SamplingParams] = {
    "max_tokens": optional(JSON_INTS),
    "temperature": optional(FLOATS),
    "top_p": optional(FLOATS),
    "stop": STR_TUPLES,
    "seed": optional(JSON_INTS),
}
sampling_params = st.builds(SamplingParams, **FIELDS[SamplingParams])

FIELDS[Usage] = {"prompt_tokens": JSON_INTS, "completion_tokens": JSON_INTS}
usages = st.builds(Usage, **FIELDS[Usage])

FIELDS[NodeConfig] = {
    "max_concurrency": JSON_INTS,
    "heartbeat_interval": FLOATS,
    "models": STR_TUPLES,
    "labels": STR_DICTS,
}
node_configs = st.builds(NodeConfig, **FIELDS[NodeConfig])

FIELDS[RegisterRequest] = {
    "token": TEXT,
    "node_id": TEXT,
    "version": TEXT,
    "adapters": STR_TUPLES,
    "models": STR_TUPLES,
    "capacity": JSON_INTS,
    "labels": STR_DICTS,
}
FIELDS[RegisterResponse] = {
    "accepted": st.booleans(),
    "reason": TEXT,
    "config": optional(node_configs),
}
FIELDS[RunRequest] = {
    "run_id": TEXT,
    "model": TEXT,
    "kind": st.sampled_from(typing.get_args(RunKind)),
    "messages": st.lists(chat_messages, max_size=3).map(tuple),
    "prompt": TEXT,
    "params": sampling_params,
    "deadline": optional(FLOATS),
}
FIELDS[RunEvent] = {
    "run_id": TEXT,
    "kind": st.sampled_from(typing.get_args(EventKind)),
    "text": TEXT,
    "tokens": JSON_INTS,
    "finish_reason": optional(TEXT),
    "usage": optional(usages),
    "code": TEXT,
    "message": TEXT,
}
FIELDS[CancelRequest] = {"run_id": TEXT, "reason": TEXT}
FIELDS[Heartbeat] = {"seq": JSON_INTS}
FIELDS[Drain] = {"reason": TEXT}
FIELDS[Error] = {"code": TEXT, "message": TEXT, "run_id": optional(TEXT)}

MESSAGE_STRATEGIES: dict[type, st.SearchStrategy[Any]] = {
    cls: st.builds(cls, **FIELDS[cls]) for cls in MESSAGE_CLASSES
}
messages: st.SearchStrategy[Message] = st.one_of(*MESSAGE_STRATEGIES.values())


def test_strategies_cover_every_message_type_and_field() -> None:
    assert set(MESSAGE_STRATEGIES) == set(MESSAGE_CLASSES)
    for cls, fields in FIELDS.items():
        assert set(fields) == {f.name for f in attrs.fields(cls)}, cls.__name__
    assert typing.get_args(RunKind) == ("chat", "completion")
    assert typing.get_args(EventKind) == ("start", "delta", "complete", "error")


# --------------------------------------------------------------------------- helpers


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets; never yields an empty chunk (``b""`` means EOF)."""
    bounds = sorted({0, len(data), *cuts})
    return [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def chunked(data: bytes, draw: st.DataObject) -> list[bytes]:
    cuts = draw.draw(st.lists(st.integers(0, len(data)), max_size=12), label="cuts")
    chunks = split(data, cuts)
    assert b"".join(chunks) == data
    return chunks


def drain_strict(conn: ProtocolConnection) -> list[Message]:
    """All complete messages; errors propagate (for valid input)."""
    out: list[Message] = []
    while (result := conn.next_message()) is not NEED_DATA:
        assert result is not CLOSED
        assert isinstance(result, MESSAGE_CLASSES)
        out.append(result)
    return out


def drain_fuzz(conn: ProtocolConnection, out: list[Message]) -> str:
    """Pull until the decoder stops; anything but a RemoteProtocolError escapes and fails."""
    while True:
        try:
            result = conn.next_message()
        except RemoteProtocolError:
            assert conn.errored
            with pytest.raises(RemoteProtocolError):
                conn.next_message()
            return "error"
        if result is NEED_DATA:
            return "need_data"
        if result is CLOSED:
            assert conn.next_message() is CLOSED
            return "closed"
        assert isinstance(result, MESSAGE_CLASSES), result
        out.append(result)


def run_fuzz(chunks: list[bytes], eof: bool, max_frame_size: int) -> list[Message]:
    conn = ProtocolConnection(max_frame_size=max_frame_size)
    out: list[Message] = []
    for chunk in chunks:
        conn.receive_data(chunk)
        if drain_fuzz(conn, out) == "error":
            return out
    if eof:
        conn.receive_data(b"")
        # After EOF the decoder never asks for more data.
        assert drain_fuzz(conn, out) in ("closed", "error")
    return out


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


# --------------------------------------------------------------------------- round trips


@ROUND_TRIP
@given(messages)
def test_codec_round_trip(message: Message) -> None:
    decoded = CODEC.decode(CODEC.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


@ROUND_TRIP
@given(messages)
def test_connection_round_trip(message: Message) -> None:
    sender, receiver = ProtocolConnection(), ProtocolConnection()
    receiver.receive_data(sender.send(message))
    decoded = receiver.next_message()
    assert type(decoded) is type(message)
    assert decoded == message
    assert receiver.next_message() is NEED_DATA
    receiver.receive_data(b"")
    assert receiver.next_message() is CLOSED


@settings(max_examples=40, deadline=None, database=None)
@pytest.mark.parametrize("cls", MESSAGE_CLASSES, ids=lambda cls: cls.__name__)
@given(data=st.data())
def test_round_trip_per_type(cls: type, data: st.DataObject) -> None:
    message = data.draw(MESSAGE_STRATEGIES[cls])
    conn = ProtocolConnection()
    conn.receive_data(conn.send(message))
    assert conn.next_message() == message


@ROUND_TRIP
@given(st.lists(messages, min_size=1, max_size=4), st.data())
def test_round_trip_split_at_random_points(batch: list[Message], data: st.DataObject) -> None:
    sender, receiver = ProtocolConnection(), ProtocolConnection()
    wire = b"".join(sender.send(m) for m in batch)
    got: list[Message] = []
    for chunk in chunked(wire, data):
        receiver.receive_data(chunk)
        got.extend(drain_strict(receiver))
    assert got == batch
    assert not receiver.errored
    receiver.receive_data(b"")
    assert receiver.next_message() is CLOSED


@settings(ROUND_TRIP, max_examples=100)
@given(st.lists(messages, min_size=1, max_size=3), st.data())
def test_round_trip_with_exact_frame_limit(batch: list[Message], data: st.DataObject) -> None:
    """A limit equal to the largest frame in the batch still carries the whole batch."""
    limit = max(len(CODEC.encode(m)) for m in batch)
    sender, receiver = (
        ProtocolConnection(max_frame_size=limit),
        ProtocolConnection(max_frame_size=limit),
    )
    got: list[Message] = []
    for chunk in chunked(b"".join(sender.send(m) for m in batch), data):
        receiver.receive_data(chunk)
        got.extend(drain_strict(receiver))
    assert got == batch


# --------------------------------------------------------------------------- fuzzing: raw bytes

FRAME_LIMITS = st.sampled_from([1, 4, 64, 1024, DEFAULT_MAX_FRAME_SIZE]) | st.integers(1, 2**32 - 1)


@FUZZ
@given(st.binary(max_size=300), st.booleans(), FRAME_LIMITS, st.data())
def test_fuzz_random_bytes(blob: bytes, eof: bool, limit: int, data: st.DataObject) -> None:
    run_fuzz(chunked(blob, data), eof, limit)


@FUZZ
@given(
    st.lists(st.binary(max_size=80), min_size=1, max_size=4),
    st.binary(max_size=8),
    st.booleans(),
    st.data(),
)
def test_fuzz_framed_random_payloads(
    payloads: list[bytes], tail: bytes, eof: bool, data: st.DataObject
) -> None:
    """Valid length prefixes around random payload bytes (exercises the envelope decoder)."""
    wire = b"".join(frame(p) for p in payloads) + tail
    run_fuzz(chunked(wire, data), eof, DEFAULT_MAX_FRAME_SIZE)


# --------------------------------------------------------------------------- fuzzing: JSON-ish

#: Field names that occur anywhere on the wire, so random payloads hit real fields often.
ALL_FIELD_NAMES = sorted({name for fields in FIELDS.values() for name in fields})

# Text that may contain lone surrogates: json.dumps escapes them as \udXXX, which
# json.loads accepts. (Decoding must still never raise anything but RemoteProtocolError.)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=12)


def json_values(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | text
        | st.sampled_from(["chat", "completion", "start", "delta", "complete", "error"])
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.sampled_from(ALL_FIELD_NAMES) | text, children, max_size=4)
        ),
        max_leaves=12,
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a dict or list inside ``value`` (including the root)."""
    found: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        found.append(prefix)
        for key, item in value.items():
            found.extend(_paths(item, (*prefix, key)))
    elif isinstance(value, list):
        found.append(prefix)
        for index, item in enumerate(value):
            found.extend(_paths(item, (*prefix, index)))
    return found


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


JSON_ANY = json_values(ANY_TEXT)
JSON_PLAIN = json_values(TEXT)


@st.composite
def mutated_payload(
    draw: st.DrawFn,
    doc: dict[str, Any],
    text: st.SearchStrategy[str],
    values: st.SearchStrategy[Any],
) -> None:
    """Mutate ``doc["payload"]`` in place a few times: replace, delete or add a value somewhere."""
    payload = doc["payload"]
    for _ in range(draw(st.integers(1, 3))):
        container = _get(payload, draw(st.sampled_from(_paths(payload))))
        if isinstance(container, dict):
            op = draw(st.sampled_from(["replace", "delete", "add"]))
            if op == "add" or not container:
                key = draw(st.sampled_from(ALL_FIELD_NAMES) | text)
                container[key] = draw(values)
            else:
                key = draw(st.sampled_from(sorted(container)))
                if op == "delete":
                    del container[key]
                else:
                    container[key] = draw(values)
        else:
            op = draw(st.sampled_from(["replace", "delete", "append"]))
            if op == "append" or not container:
                container.append(draw(values))
            else:
                index = draw(st.integers(0, len(container) - 1))
                if op == "delete":
                    del container[index]
                else:
                    container[index] = draw(values)


TYPE_NAMES = (
    st.sampled_from(sorted(MESSAGE_TYPES))
    | st.sampled_from(["", "Heartbeat", "run.events", "register", "error ", "heartbeat\x00"])
    | st.text(max_size=12)
)


@st.composite
def envelope_docs(
    draw: st.DrawFn, text: st.SearchStrategy[str], values: st.SearchStrategy[Any]
) -> Any:
    shape = draw(st.sampled_from(["valid", "mutated", "fields", "random", "not-an-envelope"]))
    if shape == "not-an-envelope":
        return draw(values)
    if shape in ("valid", "mutated"):
        doc = json.loads(CODEC.encode(draw(messages)))
        if shape == "mutated":
            draw(mutated_payload(doc, text, values))
        return doc
    doc = {"type": draw(TYPE_NAMES | values)}
    if shape == "fields":
        doc["payload"] = draw(st.dictionaries(st.sampled_from(ALL_FIELD_NAMES) | text, values))
    else:
        doc["payload"] = draw(values)
    if draw(st.integers(0, 9)) == 0:
        doc[draw(st.sampled_from(["id", "type", "payload", "Type"]))] = draw(values)
    if draw(st.integers(0, 9)) == 0:
        del doc[draw(st.sampled_from(["type", "payload"]))]
    return doc


def encode_doc(doc: Any, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes that are not valid UTF-8.
    return json.dumps(doc, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@FUZZ
@given(
    st.lists(envelope_docs(ANY_TEXT, JSON_ANY), min_size=1, max_size=4),
    st.booleans(),
    st.booleans(),
    st.sampled_from([b"", b"\x00", b"\x00\x00\x00\x05ab", b"\xff\xff\xff\xff"]),
    st.data(),
)
def test_fuzz_json_envelopes(
    docs: list[Any], ascii_only: bool, eof: bool, tail: bytes, data: st.DataObject
) -> None:
    limit = data.draw(st.sampled_from([64, 512, DEFAULT_MAX_FRAME_SIZE]), label="limit")
    wire = b"".join(frame(encode_doc(doc, ascii_only)) for doc in docs) + tail
    run_fuzz(chunked(wire, data), eof, limit)


@FUZZ
@given(envelope_docs(TEXT, JSON_PLAIN), st.booleans())
def test_fuzz_decoded_messages_re_encode(doc: Any, ascii_only: bool) -> None:
    """Whatever the decoder accepts (surrogate-free) can be sent back and decodes equal."""
    conn = ProtocolConnection()
    conn.receive_data(frame(encode_doc(doc, ascii_only)))
    try:
        message = conn.next_message()
    except RemoteProtocolError:
        return
    assert isinstance(message, MESSAGE_CLASSES)
    assert isinstance(doc, dict)
    assert MESSAGE_TYPES[doc["type"]] is type(message)
    again = ProtocolConnection()
    again.receive_data(ProtocolConnection().send(message))
    assert again.next_message() == message


@FUZZ
@given(messages, st.data())
def test_fuzz_truncated_and_extended_valid_frames(message: Message, data: st.DataObject) -> None:
    """Cutting a valid frame short or appending junk: a message, NEED_DATA, CLOSED or an error."""
    wire = ProtocolConnection().send(message)
    cut = data.draw(st.integers(0, len(wire)), label="cut")
    junk = data.draw(st.binary(max_size=12), label="junk")
    eof = data.draw(st.booleans(), label="eof")
    got = run_fuzz(chunked(wire[:cut] + junk, data), eof, DEFAULT_MAX_FRAME_SIZE)
    if cut == len(wire):
        assert got[:1] == [message]
