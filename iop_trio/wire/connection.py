"""The sans-IO protocol connection: bytes in, messages out; messages in, bytes out.

Any error moves the connection to a terminal error state (as in h11): after the peer has broken
the protocol nothing more is decoded from it.
"""

from __future__ import annotations

from .codec import Codec, JsonCodec
from .errors import LocalProtocolError, RemoteProtocolError
from .framing import (
    CLOSED,
    DEFAULT_MAX_FRAME_SIZE,
    NEED_DATA,
    FrameDecoder,
    _Closed,
    _NeedData,
    encode_frame,
)
from .messages import Message


class ProtocolConnection:
    def __init__(
        self, codec: Codec | None = None, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    ) -> None:
        self.codec: Codec = codec or JsonCodec()
        self.max_frame_size = max_frame_size
        self._decoder = FrameDecoder(max_frame_size)
        self._error: RemoteProtocolError | None = None

    @property
    def errored(self) -> bool:
        return self._error is not None

    def receive_data(self, data: bytes | bytearray) -> None:
        """Feed bytes read from the peer; ``b""`` means the peer closed its side."""
        self._decoder.receive_data(data)

    def next_message(self) -> Message | _NeedData | _Closed:
        """The next complete message, ``NEED_DATA``, or ``CLOSED`` after a clean EOF."""
        if self._error is not None:
            raise RemoteProtocolError(f"connection is in error state: {self._error}")
        try:
            frame = self._decoder.next_frame()
            if frame is NEED_DATA or frame is CLOSED:
                return frame
            assert isinstance(frame, bytes)
            return self.codec.decode(frame)
        except RemoteProtocolError as exc:
            self._error = exc
            raise

    def send(self, message: Message) -> bytes:
        """The bytes that put ``message`` on the wire."""
        payload = self.codec.encode(message)
        if len(payload) > self.max_frame_size:
            raise LocalProtocolError(
                f"{type(message).__name__} of {len(payload)} bytes exceeds the frame limit"
            )
        return encode_frame(payload, self.max_frame_size)
