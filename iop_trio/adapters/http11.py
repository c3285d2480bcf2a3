"""Sans-IO HTTP/1.1 for the backend client: a request's bytes out, a response's head and body in.

Hand-written rather than h11 because a backend streams a run as dozens of tiny chunks, and h11's
general event machinery per chunk was a fifth of the node's CPU per run (bench/results/findings.md).
This covers what a client of an inference server meets: a status line and headers (1xx skipped),
then a body framed by ``Transfer-Encoding: chunked``, by ``Content-Length``, or by the end of the
connection. Anything else is a :class:`ProtocolError`, never a guess.
"""

from __future__ import annotations

MAX_HEAD = 64 * 1024
MAX_CHUNK_LINE = 4096
HEX_DIGITS = b"0123456789abcdefABCDEF"


class ProtocolError(Exception):
    """The backend's response is not HTTP/1.1 this client understands."""


def encode_request(method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes | None) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode("ascii"), target)]
    lines += [b"%s: %s" % pair for pair in headers]
    if body is not None:
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


class ResponseReader:
    """Feed it the bytes received; it parses the head, then hands out the body as it comes."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.status = 0
        self.keep_alive = True
        self.complete = False
        #: Bytes fed so far: a request that failed before any came back was never answered.
        self.received = 0
        self._eof = False
        self._framing = ""  # "chunked", "length" or "close", once the head is parsed
        self._remaining = 0  # bytes left in the current chunk, or in a Content-Length body
        self._chunk_state = "size"  # size -> data -> data-end -> size ... -> trailers

    @property
    def has_head(self) -> bool:
        return bool(self._framing)

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes from the connection; ``b""`` means the backend closed it."""
        if data:
            self._buffer += data
            self.received += len(data)
        else:
            self._eof = True

    def read_head(self) -> bool:
        """Parse the status line and headers if they are all in; True once they are."""
        while not self._framing:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD:
                    raise ProtocolError(f"response head larger than {MAX_HEAD} bytes")
                if self._eof:
                    raise ProtocolError("connection closed before a complete response head")
                return False
            head = bytes(self._buffer[:end])
            del self._buffer[: end + 4]
            self._parse_head(head)
        return True

    def _parse_head(self, head: bytes) -> None:
        status_line, *header_lines = head.split(b"\r\n")
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or not code.isdigit():
            raise ProtocolError(f"bad status line {status_line[:100]!r}")
        status = int(code)
        if 100 <= status < 200:
            if status == 101:
                raise ProtocolError("backend switched protocols")
            return  # 100 Continue and friends: the real response follows
        headers: dict[bytes, list[bytes]] = {}
        for line in header_lines:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                raise ProtocolError(f"bad header line {line[:100]!r}")
            headers.setdefault(name.lower(), []).append(value.strip())
        self.status = status
        connection = b",".join(headers.get(b"connection", [])).lower()
        self.keep_alive = version == b"HTTP/1.1" and b"close" not in connection
        self._framing = self._body_framing(status, headers)
        if self._framing == "close":
            self.keep_alive = False

    def _body_framing(self, status: int, headers: dict[bytes, list[bytes]]) -> str:
        if status in (204, 304):
            self.complete = True
            return "length"
        codings = b",".join(headers.get(b"transfer-encoding", [])).lower()
        if codings:
            if codings.rsplit(b",", 1)[-1].strip() != b"chunked":
                raise ProtocolError(f"unsupported transfer-encoding {codings[:100]!r}")
            return "chunked"
        lengths = set(headers.get(b"content-length", []))
        if len(lengths) > 1 or not all(length.isdigit() for length in lengths):
            raise ProtocolError(f"bad content-length {sorted(lengths)!r}")
        if lengths:
            self._remaining = int(lengths.pop())
            self.complete = self._remaining == 0
            return "length"
        return "close"

    def read_body(self) -> bytes:
        """The body bytes that can be decoded from what was fed so far (``b""`` if none yet).
        Sets ``complete`` at the body's end; raises if the connection ended before it."""
        if self._framing == "chunked":
            data = self._read_chunked()
        elif self._framing == "length":
            data = bytes(self._buffer[: self._remaining])
            del self._buffer[: self._remaining]
            self._remaining -= len(data)
            self.complete = self._remaining == 0
        else:
            data = bytes(self._buffer)
            self._buffer.clear()
            self.complete = self._eof
        if not self.complete and not data and self._eof:
            raise ProtocolError("connection closed before the end of the body")
        return data

    def _read_chunked(self) -> bytes:
        """Walk the buffer with an offset and cut what was consumed once at the end: a network
        read of a stream holds dozens of small chunks, and cutting per chunk moved the rest of
        the buffer each time."""
        buffer = self._buffer
        pos = 0
        pieces: list[bytearray] = []
        try:
            while not self.complete:
                if self._chunk_state == "data":
                    piece = buffer[pos : pos + self._remaining]
                    if not piece:
                        break
                    pos += len(piece)
                    pieces.append(piece)
                    self._remaining -= len(piece)
                    if self._remaining:
                        break
                    self._chunk_state = "data-end"
                elif self._chunk_state == "data-end":
                    if len(buffer) - pos < 2:
                        break
                    if buffer[pos : pos + 2] != b"\r\n":
                        raise ProtocolError("chunk data not followed by CRLF")
                    pos += 2
                    self._chunk_state = "size"
                else:
                    end = buffer.find(b"\r\n", pos)
                    if end < 0:
                        if len(buffer) - pos > MAX_CHUNK_LINE:
                            raise ProtocolError("chunk size line too long")
                        break
                    line = bytes(buffer[pos:end])
                    pos = end + 2
                    if self._chunk_state == "trailers":
                        self.complete = not line  # trailer fields are ignored; an empty line ends them
                        continue
                    size = line.split(b";", 1)[0].strip()
                    if not size or size.strip(HEX_DIGITS):
                        raise ProtocolError(f"bad chunk size {line[:100]!r}")
                    self._remaining = int(size, 16)
                    self._chunk_state = "data" if self._remaining else "trailers"
        finally:
            del buffer[:pos]
        return b"".join(pieces)
