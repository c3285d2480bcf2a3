"""FrameDecoder / encode_frame: the 4-byte big-endian length prefix, sans-IO.

The frames here are built by hand with :mod:`struct` so the decoder is checked against the wire
format itself, not against ``encode_frame``.
"""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest

from iop_trio.wire import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    FrameDecoder,
    FrameTooLargeError,
    LocalProtocolError,
    ProtocolConnection,
    ProtocolError,
    RemoteProtocolError,
    encode_frame,
)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def header(length: int) -> bytes:
    return struct.pack(">I", length)


def drain(decoder: FrameDecoder) -> list[bytes]:
    """Every complete frame currently decodable; stops at (and requires) NEED_DATA."""
    frames: list[bytes] = []
    while True:
        result = decoder.next_frame()
        if result is NEED_DATA:
            return frames
        assert isinstance(result, bytes), result
        frames.append(result)


# --------------------------------------------------------------------------- encode_frame


def test_encode_frame_layout() -> None:
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    payload = bytes(range(256)) * 2
    assert encode_frame(payload) == b"\x00\x00\x02\x00" + payload


def test_encode_frame_is_big_endian_uint32() -> None:
    payload = b"x" * 0x010203
    encoded = encode_frame(payload)
    assert encoded[:4] == b"\x00\x01\x02\x03"
    assert encoded[4:] == payload


def test_encode_frame_at_limit_is_accepted() -> None:
    assert encode_frame(b"0123456789", max_frame_size=10) == frame(b"0123456789")
    assert encode_frame(b"x", max_frame_size=1) == frame(b"x")


@pytest.mark.parametrize(("size", "limit"), [(11, 10), (2, 1), (1000, 999)])
def test_encode_frame_refuses_payload_over_limit(size: int, limit: int) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(b"x" * size, max_frame_size=limit)
    assert not isinstance(info.value, RemoteProtocolError)
    assert str(size) in str(info.value)
    assert str(limit) in str(info.value)


def test_encode_frame_refuses_payload_over_default_limit() -> None:
    encode_frame(bytes(DEFAULT_MAX_FRAME_SIZE))  # exactly at the default limit: fine
    with pytest.raises(LocalProtocolError):
        encode_frame(bytes(DEFAULT_MAX_FRAME_SIZE + 1))


def test_encode_frame_round_trips_through_decoder() -> None:
    decoder = FrameDecoder(max_frame_size=100)
    payloads = [b"", b"a", b"hello world", bytes(range(100))]
    decoder.receive_data(b"".join(encode_frame(p, 100) for p in payloads))
    assert drain(decoder) == payloads


# --------------------------------------------------------------------------- constructor


@pytest.mark.parametrize("bad", [0, -1, -(2**32), 2**32, 2**40])
def test_invalid_max_frame_size_is_value_error(bad: int) -> None:
    with pytest.raises(ValueError, match="max_frame_size"):
        FrameDecoder(max_frame_size=bad)


@pytest.mark.parametrize("bad", [0, -5, 2**32])
def test_protocol_connection_rejects_invalid_max_frame_size(bad: int) -> None:
    with pytest.raises(ValueError, match="max_frame_size"):
        ProtocolConnection(max_frame_size=bad)


@pytest.mark.parametrize("good", [1, 2**32 - 1, DEFAULT_MAX_FRAME_SIZE])
def test_extreme_valid_max_frame_sizes(good: int) -> None:
    decoder = FrameDecoder(max_frame_size=good)
    assert decoder.max_frame_size == good
    assert decoder.buffered == 0
    assert decoder.next_frame() is NEED_DATA


def test_default_max_frame_size() -> None:
    assert DEFAULT_MAX_FRAME_SIZE == 16 * 1024 * 1024
    assert FrameDecoder().max_frame_size == DEFAULT_MAX_FRAME_SIZE


# --------------------------------------------------------------------------- happy paths


def test_fresh_decoder_needs_data() -> None:
    decoder = FrameDecoder()
    assert decoder.next_frame() is NEED_DATA
    assert decoder.next_frame() is NEED_DATA


def test_sentinels_have_readable_reprs() -> None:
    assert repr(NEED_DATA) == "NEED_DATA"
    assert repr(CLOSED) == "CLOSED"


def test_one_frame_fed_whole() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"hello"))
    assert decoder.buffered == 9
    result = decoder.next_frame()
    assert result == b"hello"
    assert type(result) is bytes
    assert decoder.buffered == 0
    assert decoder.next_frame() is NEED_DATA


@pytest.mark.parametrize("payload", [b"x", b"hello", bytes(range(256)), b"\x00\x00\x00\x05"])
def test_one_frame_fed_one_byte_at_a_time(payload: bytes) -> None:
    decoder = FrameDecoder()
    data = frame(payload)
    for i, byte in enumerate(data[:-1]):
        decoder.receive_data(bytes([byte]))
        assert decoder.next_frame() is NEED_DATA, f"after {i + 1} bytes"
        assert decoder.buffered == i + 1
    decoder.receive_data(data[-1:])
    assert decoder.next_frame() == payload
    assert decoder.next_frame() is NEED_DATA
    assert decoder.buffered == 0


def test_frames_fed_one_byte_at_a_time_without_polling_in_between() -> None:
    decoder = FrameDecoder()
    payloads = [b"one", b"", b"three"]
    for byte in b"".join(frame(p) for p in payloads):
        decoder.receive_data(bytes([byte]))
    assert drain(decoder) == payloads


@pytest.mark.parametrize("cut", range(0, len(frame(b"second-frame"))))
def test_trailing_partial_next_frame_needs_data(cut: int) -> None:
    """A complete frame followed by any prefix of the next one (inside its header or payload)."""
    first, second = frame(b"first"), frame(b"second-frame")
    decoder = FrameDecoder()
    decoder.receive_data(first + second[:cut])
    assert decoder.next_frame() == b"first"
    assert decoder.next_frame() is NEED_DATA
    assert decoder.buffered == cut
    if cut < len(second):
        decoder.receive_data(second[cut:])
    assert decoder.next_frame() == b"second-frame"
    assert decoder.next_frame() is NEED_DATA
    assert decoder.buffered == 0


def test_trailing_partial_then_eof_is_an_error_only_after_the_complete_frame() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"complete") + frame(b"partial")[:6])
    decoder.receive_data(b"")
    assert decoder.next_frame() == b"complete"
    with pytest.raises(RemoteProtocolError, match="closed inside a frame"):
        decoder.next_frame()


def test_several_frames_in_one_chunk() -> None:
    payloads = [b"alpha", b"beta", b"", b"gamma" * 100, b"\x00\x00\x00\x01"]
    decoder = FrameDecoder()
    decoder.receive_data(b"".join(frame(p) for p in payloads))
    assert drain(decoder) == payloads
    assert decoder.buffered == 0


def test_frames_split_across_arbitrary_chunks() -> None:
    payloads = [b"alpha", b"beta", b"", b"gamma" * 10]
    data = b"".join(frame(p) for p in payloads)
    for chunk_size in range(1, len(data) + 1):
        decoder = FrameDecoder()
        got: list[bytes] = []
        for start in range(0, len(data), chunk_size):
            decoder.receive_data(data[start : start + chunk_size])
            got.extend(drain(decoder))
        assert got == payloads, f"chunk size {chunk_size}"


def test_zero_length_frame() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\x00\x00\x00\x00")
    result = decoder.next_frame()
    assert result == b""
    assert decoder.next_frame() is NEED_DATA
    assert decoder.buffered == 0


def test_zero_length_frame_one_byte_at_a_time() -> None:
    decoder = FrameDecoder()
    for _ in range(3):
        decoder.receive_data(b"\x00")
        assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(b"\x00")
    assert decoder.next_frame() == b""
    assert decoder.next_frame() is NEED_DATA


def test_several_zero_length_frames() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\x00" * 12)
    assert drain(decoder) == [b"", b"", b""]


def test_returned_payload_is_independent_of_later_input() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"abc") + b"\x00")
    payload = decoder.next_frame()
    decoder.receive_data(b"\x00\x00\x01z")
    assert payload == b"abc"
    assert decoder.next_frame() == b"z"


# --------------------------------------------------------------------------- EOF


def test_eof_without_any_data_is_closed() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"")
    assert decoder.next_frame() is CLOSED
    assert decoder.next_frame() is CLOSED


def test_eof_at_frame_boundary_is_closed() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"one") + frame(b"two"))
    assert decoder.next_frame() == b"one"
    decoder.receive_data(b"")
    # Frames already buffered are still delivered before CLOSED.
    assert decoder.next_frame() == b"two"
    assert decoder.next_frame() is CLOSED
    assert decoder.next_frame() is CLOSED


def test_eof_after_zero_length_frame_is_closed() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\x00\x00\x00\x00")
    decoder.receive_data(b"")
    assert decoder.next_frame() == b""
    assert decoder.next_frame() is CLOSED


@pytest.mark.parametrize("pending", [1, 2, 3])
def test_eof_mid_header_is_remote_protocol_error(pending: int) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"abc")[:pending])
    assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        decoder.next_frame()
    assert not isinstance(info.value, FrameTooLargeError)
    assert f"{pending} bytes pending" in str(info.value)


@pytest.mark.parametrize("pending", [4, 5, 7])
def test_eof_mid_payload_is_remote_protocol_error(pending: int) -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"abcd")[:pending])
    assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="closed inside a frame"):
        decoder.next_frame()


def test_eof_mid_frame_error_is_repeatable() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"\x00\x00")
    decoder.receive_data(b"")
    for _ in range(2):
        with pytest.raises(RemoteProtocolError):
            decoder.next_frame()


def test_receive_data_after_eof_is_local_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(frame(b"abc"))
    decoder.receive_data(b"")
    with pytest.raises(LocalProtocolError, match="after EOF"):
        decoder.receive_data(b"more")
    # Nothing was appended: the buffered frame and clean close are unaffected.
    assert decoder.next_frame() == b"abc"
    assert decoder.next_frame() is CLOSED


def test_second_eof_is_local_protocol_error() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        decoder.receive_data(b"")
    assert decoder.next_frame() is CLOSED


# --------------------------------------------------------------------------- size limit


def test_oversized_header_rejected_before_payload_arrives() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(header(11))  # header only, none of the 11 payload bytes
    with pytest.raises(FrameTooLargeError) as info:
        decoder.next_frame()
    assert isinstance(info.value, RemoteProtocolError)
    assert info.value.code == "frame_too_large"
    assert "11" in str(info.value)
    assert "10" in str(info.value)


def test_oversized_header_rejected_as_soon_as_fourth_header_byte_arrives() -> None:
    decoder = FrameDecoder(max_frame_size=1000)
    data = header(0xFFFFFFFF)
    for byte in data[:3]:
        decoder.receive_data(bytes([byte]))
        assert decoder.next_frame() is NEED_DATA
    decoder.receive_data(data[3:])
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()


def test_oversized_default_limit_rejected_from_header_alone() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(header(DEFAULT_MAX_FRAME_SIZE + 1))
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()


def test_default_limit_header_waits_for_payload() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(header(DEFAULT_MAX_FRAME_SIZE))
    assert decoder.next_frame() is NEED_DATA


def test_oversized_frame_after_a_good_one() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(frame(b"ok") + header(11) + b"partial")
    assert decoder.next_frame() == b"ok"
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()


def test_oversized_header_followed_by_eof_is_still_frame_too_large() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(header(11))
    decoder.receive_data(b"")
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()


def test_frame_exactly_at_limit_is_accepted() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    decoder.receive_data(frame(b"0123456789"))
    assert decoder.next_frame() == b"0123456789"
    assert decoder.next_frame() is NEED_DATA


def test_limit_of_one_byte() -> None:
    decoder = FrameDecoder(max_frame_size=1)
    decoder.receive_data(frame(b"") + frame(b"x") + header(2))
    assert decoder.next_frame() == b""
    assert decoder.next_frame() == b"x"
    with pytest.raises(FrameTooLargeError):
        decoder.next_frame()


# --------------------------------------------------------------------------- error hierarchy


def test_error_hierarchy_and_codes() -> None:
    from iop_trio.wire import UnknownMessageTypeError

    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(LocalProtocolError, ProtocolError)
    assert not issubclass(LocalProtocolError, RemoteProtocolError)
    assert issubclass(FrameTooLargeError, RemoteProtocolError)
    assert issubclass(UnknownMessageTypeError, RemoteProtocolError)
    assert ProtocolError.code == "protocol_error"
    assert RemoteProtocolError.code == "protocol_error"
    assert FrameTooLargeError.code == "frame_too_large"
    assert UnknownMessageTypeError.code == "unknown_type"


def test_wire_package_does_not_import_trio() -> None:
    # pytest-trio already imported trio into this process, so check in a fresh interpreter.
    code = (
        "import sys, iop_trio.wire\n"
        "bad = sorted(m for m in sys.modules if m == 'trio' or m.startswith('trio.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
