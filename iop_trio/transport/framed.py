"""A framed IOP connection over any trio stream.

One writer task owns ``send_all``: senders put encoded frames into a bounded channel, so a run
that is cancelled mid-send never leaves a half-written frame on a TLS stream, and a slow peer
pushes back on the senders instead of growing a queue. The writer coalesces frames that are
already waiting into one ``send_all`` to cut syscalls and TLS records under load.
"""

from __future__ import annotations

import trio

from ..wire import CLOSED, NEED_DATA, Codec, Message, ProtocolConnection
from ..wire.framing import DEFAULT_MAX_FRAME_SIZE
from .errors import ConnectionClosed, broken_reason

RECEIVE_CHUNK = 64 * 1024
COALESCE_LIMIT = 256 * 1024


class FramedConnection:
    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        codec: Codec | None = None,
        send_buffer: int = 256,
        peer: str = "",
    ) -> None:
        self.stream = stream
        self.peer = peer
        self.protocol = ProtocolConnection(codec, max_frame_size)
        self._outbox_send, self._outbox_receive = trio.open_memory_channel[bytes](send_buffer)
        self._writer_started = False
        self._writer_done = trio.Event()
        #: trio clock time of the last complete frame received; the heartbeat watchdog reads it.
        self.last_received = trio.current_time()

    async def send(self, message: Message) -> None:
        """Queue ``message`` for the writer; waits while the outbox is full.

        With room in the outbox it returns without yielding: a run that emits several events
        in a row queues them all before the writer wakes, and they go out as one TLS record
        (every caller's loop still yields elsewhere, on its own I/O)."""
        data = self.protocol.send(message)
        try:
            try:
                self._outbox_send.send_nowait(data)
            except trio.WouldBlock:
                await self._outbox_send.send(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            raise ConnectionClosed(f"connection to {self.peer} is closed") from exc

    async def send_now(self, message: Message) -> None:
        """Write ``message`` directly when no writer task is running: the registration exchange
        before it starts, a parting ``error`` frame after it stopped. Otherwise it is queued."""
        if self._writer_started and not self._writer_done.is_set():
            await self.send(message)
            return
        try:
            await self.stream.send_all(self.protocol.send(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectionClosed(f"connection to {self.peer} broke: {broken_reason(exc)}") from exc

    async def receive(self) -> Message:
        """The next message from the peer. Raises ConnectionClosed at EOF or when the stream breaks,
        RemoteProtocolError when the peer breaks the protocol."""
        while True:
            message = self.protocol.next_message()
            if message is NEED_DATA:
                try:
                    data = await self.stream.receive_some(RECEIVE_CHUNK)
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    raise ConnectionClosed(f"connection to {self.peer} broke: {broken_reason(exc)}") from exc
                self.protocol.receive_data(data)
                continue
            if message is CLOSED:
                raise ConnectionClosed(f"{self.peer} closed the connection")
            self.last_received = trio.current_time()
            return message  # type: ignore[return-value]

    def start_writer(self, nursery: trio.Nursery) -> None:
        """Start :meth:`run_writer` in ``nursery``. Marks the writer as started at once, so a
        :meth:`flush_and_close` right after still waits for the queued frames to go out."""
        self._writer_started = True
        nursery.start_soon(self.run_writer, name=f"writer {self.peer}")

    async def run_writer(self) -> None:
        """Drain the outbox onto the stream until :meth:`finish_sending` is called."""
        self._writer_started = True
        try:
            async with self._outbox_receive:
                async for data in self._outbox_receive:
                    batch = [data]
                    size = len(data)
                    while size < COALESCE_LIMIT:
                        try:
                            more = self._outbox_receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        batch.append(more)
                        size += len(more)
                    try:
                        await self.stream.send_all(b"".join(batch) if len(batch) > 1 else data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                        raise ConnectionClosed(f"connection to {self.peer} broke: {broken_reason(exc)}") from exc
        finally:
            self._writer_done.set()

    def finish_sending(self) -> None:
        """No more frames will be queued; the writer exits after flushing what is queued."""
        self._outbox_send.close()

    async def flush_and_close(self, grace: float = 1.0) -> None:
        """Flush queued frames and close the stream (TLS close_notify included), all bounded by
        ``grace``; past it the stream is closed forcefully. Safe to call twice."""
        self.finish_sending()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(grace):
                if self._writer_started:
                    await self._writer_done.wait()
                try:
                    await self.stream.aclose()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # already broken: closing is all that was left to do
            await trio.aclose_forcefully(self.stream)

