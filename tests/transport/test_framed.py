"""framed.py and peer.py over in-memory streams: the writer task, receive's errors, shutdown.

No TLS here: FramedConnection works over any trio stream, and memory/lockstep streams make the
byte-level behaviour (how many ``send_all`` calls, who closed what) observable.
"""

from __future__ import annotations

import struct
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from iop_trio.transport import ConnectionClosed, FramedConnection, serve_peer
from iop_trio.transport.framed import COALESCE_LIMIT
from iop_trio.wire import (
    CLOSED,
    NEED_DATA,
    Error,
    FrameTooLargeError,
    Heartbeat,
    Message,
    ProtocolConnection,
    RemoteProtocolError,
    RunEvent,
    UnknownMessageTypeError,
)

TIMEOUT = 5


class CountingStream(trio.abc.Stream):
    """Delegates to ``inner``, recording each ``send_all`` so coalescing can be seen."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.writes: list[int] = []

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(len(data))
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


def raw_frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


async def read_all_messages(stream: trio.abc.ReceiveStream) -> tuple[list[Message], bool]:
    """Decode everything ``stream`` delivers until EOF; returns (messages, ended_cleanly)."""
    protocol = ProtocolConnection()
    messages: list[Message] = []
    while True:
        message = protocol.next_message()
        if message is CLOSED:
            return messages, True
        if message is NEED_DATA:
            try:
                data = await stream.receive_some()
            except trio.BrokenResourceError:
                return messages, False
            protocol.receive_data(bytes(data))
            continue
        messages.append(message)  # type: ignore[arg-type]


# --- sending and receiving -----------------------------------------------------------------------


async def test_round_trip_through_writer_task() -> None:
    left, right = trio.testing.memory_stream_pair()
    a = FramedConnection(left, peer="a")
    b = FramedConnection(right, peer="b")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            a.start_writer(nursery)
            b.start_writer(nursery)
            await a.send(Heartbeat(seq=1))
            assert await b.receive() == Heartbeat(seq=1)
            reply = RunEvent(run_id="r", kind="delta", text="é 🦀")
            await b.send(reply)
            assert await a.receive() == reply
            nursery.cancel_scope.cancel()


async def test_queued_messages_coalesce_into_one_write_in_order() -> None:
    left, right = trio.testing.memory_stream_pair()
    counting = CountingStream(left)
    sender = FramedConnection(counting, send_buffer=256)
    receiver = FramedConnection(right)
    # Queue before the writer runs: send() only waits when the outbox is full.
    for seq in range(200):
        await sender.send(Heartbeat(seq=seq))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            sender.start_writer(nursery)
            received = [await receiver.receive() for _ in range(200)]
            nursery.cancel_scope.cancel()
    assert received == [Heartbeat(seq=seq) for seq in range(200)]
    assert len(counting.writes) == 1


async def test_coalescing_is_capped_and_keeps_order() -> None:
    left, right = trio.testing.memory_stream_pair()
    counting = CountingStream(left)
    sender = FramedConnection(counting)
    receiver = FramedConnection(right)
    big = [RunEvent(run_id=str(i), kind="delta", text="x" * 100_000) for i in range(10)]
    for message in big:
        await sender.send(message)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            sender.start_writer(nursery)
            received = [await receiver.receive() for _ in big]
            nursery.cancel_scope.cancel()
    assert received == big
    assert 1 < len(counting.writes) < len(big)
    # A batch stops growing once it reaches the limit: no write holds more than one frame past it.
    assert all(size < COALESCE_LIMIT + 100_100 for size in counting.writes)


async def test_send_now_writes_directly_before_the_writer_runs() -> None:
    left, right = trio.testing.memory_stream_pair()
    sender = FramedConnection(left)
    receiver = FramedConnection(right)
    with trio.fail_after(TIMEOUT):
        await sender.send_now(Heartbeat(seq=7))  # no writer task at all
        assert await receiver.receive() == Heartbeat(seq=7)


async def test_send_now_goes_through_the_queue_once_the_writer_runs() -> None:
    left, right = trio.testing.memory_stream_pair()
    counting = CountingStream(left)
    sender = FramedConnection(counting)
    receiver = FramedConnection(right)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            sender.start_writer(nursery)
            await trio.testing.wait_all_tasks_blocked()
            await sender.send(Heartbeat(seq=1))
            await sender.send_now(Heartbeat(seq=2))
            assert [await receiver.receive() for _ in range(2)] == [
                Heartbeat(seq=1),
                Heartbeat(seq=2),
            ]
            nursery.cancel_scope.cancel()


async def test_last_received_moves_only_on_complete_frames(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    assert conn.last_received == trio.current_time()
    data = raw_frame(b'{"type":"heartbeat","payload":{"seq":1}}')
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.receive)
        await trio.sleep(10)
        await right.send_all(data[:5])  # half a frame is not a sign of life
        await trio.sleep(10)
        assert conn.last_received == start
        await right.send_all(data[5:])
    assert conn.last_received == start + 20


# --- how receive ends ----------------------------------------------------------------------------


async def test_receive_raises_connection_closed_at_clean_eof() -> None:
    left, right = trio.testing.memory_stream_pair()
    a = FramedConnection(left)
    b = FramedConnection(right)
    with trio.fail_after(TIMEOUT):
        await a.send_now(Heartbeat(seq=1))
        await a.send_now(Heartbeat(seq=2))
        await left.aclose()
        assert await b.receive() == Heartbeat(seq=1)
        assert await b.receive() == Heartbeat(seq=2)
        with pytest.raises(ConnectionClosed):
            await b.receive()


async def test_receive_on_a_locally_closed_stream_is_connection_closed() -> None:
    left, _right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    await left.aclose()
    with trio.fail_after(TIMEOUT), pytest.raises(ConnectionClosed) as info:
        await conn.receive()
    assert isinstance(info.value.__cause__, trio.ClosedResourceError)


async def test_eof_inside_a_frame_is_a_protocol_error() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    with trio.fail_after(TIMEOUT):
        await right.send_all(raw_frame(b'{"type":"heartbeat","payload":{}}')[:10])
        await right.aclose()
        with pytest.raises(RemoteProtocolError) as info:
            await conn.receive()
    assert not isinstance(info.value, ConnectionClosed)


async def test_oversized_frame_header_is_rejected_before_its_payload() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    with trio.fail_after(TIMEOUT):
        await right.send_all(struct.pack(">I", 100 * 1024 * 1024))  # 100 MiB, default limit 16
        with pytest.raises(FrameTooLargeError):
            await conn.receive()
        # Terminal: nothing further is decoded from a peer that broke the protocol.
        await right.send_all(raw_frame(b'{"type":"heartbeat","payload":{"seq":1}}'))
        with pytest.raises(RemoteProtocolError):
            await conn.receive()


async def test_max_frame_size_is_applied_to_received_frames() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left, max_frame_size=64)
    with trio.fail_after(TIMEOUT):
        await right.send_all(raw_frame(b"{" + b" " * 100 + b"}"))
        with pytest.raises(FrameTooLargeError):
            await conn.receive()


async def test_garbage_payload_is_a_protocol_error() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    with trio.fail_after(TIMEOUT):
        await right.send_all(raw_frame(b"\xff\xfe not json"))
        with pytest.raises(RemoteProtocolError):
            await conn.receive()


# --- shutdown ------------------------------------------------------------------------------------


async def test_send_after_flush_and_close_is_connection_closed() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            await trio.testing.wait_all_tasks_blocked()  # the writer is running
            await conn.send(Heartbeat(seq=1))
            await conn.flush_and_close()
        with pytest.raises(ConnectionClosed):
            await conn.send(Heartbeat(seq=2))
        await conn.flush_and_close()  # safe twice
        messages, clean = await read_all_messages(right)
    assert messages == [Heartbeat(seq=1)]
    assert clean


async def test_flush_and_close_delivers_everything_queued() -> None:
    # A lockstep stream: the writer is still pushing frames when flush_and_close is called.
    left, right = trio.testing.lockstep_stream_pair()
    conn = FramedConnection(left)
    received: list[Message] = []

    async def reader() -> None:
        messages, clean = await read_all_messages(right)
        assert clean
        received.extend(messages)

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            await trio.testing.wait_all_tasks_blocked()  # the writer is running
            for seq in range(100):
                await conn.send(Heartbeat(seq=seq))
            nursery.start_soon(reader)
            await conn.flush_and_close()
    assert received == [Heartbeat(seq=seq) for seq in range(100)]


async def test_flush_and_close_right_after_starting_the_writer_delivers_queued_frames() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    for seq in range(3):
        await conn.send(Heartbeat(seq=seq))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            conn.start_writer(nursery)
            await conn.flush_and_close()
        messages, clean = await read_all_messages(right)
    assert messages == [Heartbeat(seq=seq) for seq in range(3)]
    assert clean


async def test_flush_and_close_without_a_writer_just_closes() -> None:
    left, right = trio.testing.memory_stream_pair()
    conn = FramedConnection(left)
    with trio.fail_after(TIMEOUT):
        await conn.flush_and_close()
        assert await right.receive_some() == b""


async def test_flush_and_close_is_bounded_when_the_peer_never_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Lockstep streams have no buffer at all: the writer's send_all blocks until the peer reads,
    # and this peer never does.
    left, _right = trio.testing.lockstep_stream_pair()
    conn = FramedConnection(left, send_buffer=4)
    writer_error: list[BaseException] = []

    async def writer() -> None:
        try:
            await conn.run_writer()
        except ConnectionClosed as exc:
            writer_error.append(exc)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.testing.wait_all_tasks_blocked()  # the writer waits on the outbox
            for seq in range(4):
                await conn.send(Heartbeat(seq=seq))
            start = trio.current_time()
            await conn.flush_and_close(grace=2.0)
            elapsed = trio.current_time() - start
        # The nursery exiting means the writer task ended too, instead of hanging in send_all.
    assert elapsed == pytest.approx(2.0)
    assert len(writer_error) == 1


async def test_senders_blocked_on_a_full_outbox_are_released_by_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, _right = trio.testing.lockstep_stream_pair()
    conn = FramedConnection(left, send_buffer=1)
    outcomes: list[str] = []

    async def send_one(seq: int) -> None:
        try:
            await conn.send(Heartbeat(seq=seq))
            outcomes.append("sent")
        except ConnectionClosed:
            outcomes.append("closed")

    async def writer() -> None:
        with pytest.raises(ConnectionClosed):
            await conn.run_writer()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await conn.send(Heartbeat(seq=0))  # taken by the writer, stuck in send_all
            await trio.testing.wait_all_tasks_blocked()
            await conn.send(Heartbeat(seq=1))  # fills the outbox
            nursery.start_soon(send_one, 2)  # waits for room that never comes
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == []
            await conn.flush_and_close(grace=1.0)
    assert outcomes == ["closed"]


# --- serve_peer ----------------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
        self.messages.append(message)


@pytest.mark.parametrize(
    ("garbage", "error_type", "code"),
    [
        (struct.pack(">I", 100 * 1024 * 1024), FrameTooLargeError, "frame_too_large"),
        (raw_frame(b"this is not json"), RemoteProtocolError, "protocol_error"),
        (raw_frame(b'{"type":"nope","payload":{}}'), UnknownMessageTypeError, "unknown_type"),
        (raw_frame(b'{"type":"heartbeat","payload":{"seq":"1"}}'), RemoteProtocolError, "protocol_error"),
    ],
    ids=["frame-too-large", "not-json", "unknown-type", "bad-field"],
)
async def test_serve_peer_answers_a_protocol_error_with_an_error_frame_and_closes(
    garbage: bytes, error_type: type[RemoteProtocolError], code: str
) -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    conn = FramedConnection(server_raw, peer="client")
    handler = Recorder()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                with pytest.RaisesGroup(error_type):
                    await serve_peer(conn, handler, heartbeat_interval=30)

            nursery.start_soon(serve)
            await client_raw.send_all(raw_frame(b'{"type":"heartbeat","payload":{"seq":1}}'))
            await client_raw.send_all(garbage)
            messages, clean = await read_all_messages(client_raw)

    # The valid frame before the garbage was handled; then one error frame, then EOF.
    assert handler.messages == [Heartbeat(seq=1)]
    assert len(messages) == 1
    error = messages[0]
    assert isinstance(error, Error)
    assert error.code == code
    assert error.message
    assert clean


async def test_serve_peer_rejection_is_bounded_when_the_peer_never_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # No buffering at all, and the client never reads: the error frame can never be delivered.
    server_raw, client_raw = trio.testing.lockstep_stream_pair()
    conn = FramedConnection(server_raw)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                with pytest.raises(ExceptionGroup) as info:
                    await serve_peer(conn, Recorder(), heartbeat_interval=30)
                # The protocol error; possibly also the writer's ConnectionClosed, if it saw
                # the stream closed under it before the nursery cancelled it.
                protocol_errors, rest = info.value.split(FrameTooLargeError)
                assert protocol_errors is not None
                assert rest is None or rest.split(ConnectionClosed)[1] is None

            nursery.start_soon(serve)
            start = trio.current_time()
            await client_raw.send_all(struct.pack(">I", 100 * 1024 * 1024))
        elapsed = trio.current_time() - start
    assert elapsed <= 2.0 + 1e-6  # at most 1 s to queue the error frame, 1 s grace to flush it


async def test_serve_peer_ends_with_connection_closed_when_the_peer_leaves() -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    conn = FramedConnection(server_raw)
    handler = Recorder()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                with pytest.RaisesGroup(ConnectionClosed):
                    await serve_peer(conn, handler, heartbeat_interval=30)

            nursery.start_soon(serve)
            await client_raw.send_all(raw_frame(b'{"type":"heartbeat","payload":{"seq":5}}'))
            await client_raw.aclose()
    assert handler.messages == [Heartbeat(seq=5)]


async def test_serve_peer_cancels_work_the_handler_started_when_the_connection_ends() -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    conn = FramedConnection(server_raw)
    cancelled = trio.Event()

    class LongWork:
        async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
            nursery.start_soon(self.work)

        async def work(self) -> None:
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()

    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                with pytest.RaisesGroup(ConnectionClosed):
                    await serve_peer(conn, LongWork(), heartbeat_interval=30)

            nursery.start_soon(serve)
            await client_raw.send_all(raw_frame(b'{"type":"heartbeat","payload":{}}'))
            await trio.testing.wait_all_tasks_blocked()
            assert not cancelled.is_set()
            await client_raw.aclose()
    assert cancelled.is_set()


async def test_serve_peer_replies_flow_through_the_writer() -> None:
    server_raw, client_raw = trio.testing.memory_stream_pair()
    conn = FramedConnection(server_raw)
    client = FramedConnection(client_raw)

    class Echo:
        async def on_message(self, message: Message, nursery: trio.Nursery) -> None:
            await conn.send(message)

    sent: list[Any] = [Heartbeat(seq=seq) for seq in range(20)]
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(serve_peer, conn, Echo(), heartbeat_interval=30))
            for message in sent:
                await client.send_now(message)
            assert [await client.receive() for _ in sent] == sent
            nursery.cancel_scope.cancel()
