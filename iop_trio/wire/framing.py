"""Length-prefixed framing: ``[4-byte big-endian uint32 length][payload]``. Sans-IO."""

from __future__ import annotations

import struct

from .errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024


class _NeedData:
    def __repr__(self) -> str:
        return "NEED_DATA"


class _Closed:
    def __repr__(self) -> str:
        return "CLOSED"


#: Returned when more bytes are needed to finish the next frame.
NEED_DATA = _NeedData()
#: Returned once the peer has closed cleanly at a frame boundary.
CLOSED = _Closed()


def encode_frame(payload: bytes, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> bytes:
    """Prefix ``payload`` with its length; refuse what the peer would reject."""
    if len(payload) > max_frame_size:
        raise LocalProtocolError(
            f"frame of {len(payload)} bytes exceeds the limit of {max_frame_size} bytes"
        )
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental decoder: feed bytes with :meth:`receive_data`, pull frames with :meth:`next_frame`.

    ``receive_data(b"")`` signals EOF. A frame announced larger than ``max_frame_size`` is rejected
    as soon as its header arrives, before any of its payload is buffered.
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        if not 0 < max_frame_size <= 0xFFFFFFFF:
            raise ValueError("max_frame_size must be between 1 and 2**32 - 1")
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()
        self._eof = False

    def receive_data(self, data: bytes | bytearray) -> None:
        if self._eof:
            raise LocalProtocolError("received data after EOF")
        if data:
            self._buffer += data
        else:
            self._eof = True

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def next_frame(self) -> bytes | _NeedData | _Closed:
        buffer = self._buffer
        if len(buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer)
            if length > self.max_frame_size:
                raise FrameTooLargeError(
                    f"frame of {length} bytes exceeds the limit of {self.max_frame_size} bytes"
                )
            end = HEADER.size + length
            if len(buffer) >= end:
                payload = bytes(buffer[HEADER.size : end])
                del buffer[:end]
                return payload
        if not self._eof:
            return NEED_DATA
        if buffer:
            raise RemoteProtocolError(f"connection closed inside a frame ({len(buffer)} bytes pending)")
        return CLOSED
