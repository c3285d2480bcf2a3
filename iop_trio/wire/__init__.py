"""Sans-IO IOP protocol core: framing, envelope, messages, codecs. Never imports trio."""

from .codec import Codec, JsonCodec
from .connection import ProtocolConnection
from .errors import (
    FrameTooLargeError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    UnknownMessageTypeError,
)
from .framing import CLOSED, DEFAULT_MAX_FRAME_SIZE, NEED_DATA, FrameDecoder, encode_frame
from .messages import (
    MESSAGE_TYPES,
    CancelRequest,
    ChatMessage,
    Drain,
    Error,
    Heartbeat,
    Message,
    NodeConfig,
    RegisterRequest,
    RegisterResponse,
    RunEvent,
    RunRequest,
    SamplingParams,
    Usage,
)

__all__ = [
    "CLOSED",
    "DEFAULT_MAX_FRAME_SIZE",
    "MESSAGE_TYPES",
    "NEED_DATA",
    "CancelRequest",
    "ChatMessage",
    "Codec",
    "Drain",
    "Error",
    "FrameDecoder",
    "FrameTooLargeError",
    "Heartbeat",
    "JsonCodec",
    "LocalProtocolError",
    "Message",
    "NodeConfig",
    "ProtocolConnection",
    "ProtocolError",
    "RegisterRequest",
    "RegisterResponse",
    "RemoteProtocolError",
    "RunEvent",
    "RunRequest",
    "SamplingParams",
    "Usage",
    "UnknownMessageTypeError",
    "encode_frame",
]
