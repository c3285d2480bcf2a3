"""The wire layer's one small error hierarchy.

Everything the decoder can reject surfaces as a :class:`RemoteProtocolError`; the fuzz tests hold
it to that ("parse it, or raise RemoteProtocolError, never anything else").
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error raised by the wire layer."""

    #: Short machine-readable code carried in the ``error`` frame sent back to the peer.
    code = "protocol_error"


class RemoteProtocolError(ProtocolError):
    """The peer sent something that breaks the protocol (bad frame, bad envelope, bad message)."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame announced a payload larger than the configured limit."""

    code = "frame_too_large"


class UnknownMessageTypeError(RemoteProtocolError):
    """The envelope names a message type this side does not know."""

    code = "unknown_type"


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol forbids (e.g. send after an error)."""
