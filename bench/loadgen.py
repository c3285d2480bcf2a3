"""A load generator that is not the bottleneck: raw asyncio HTTP/1.1 with keep-alive.

Why not httpx: as a load generator it costs about four times the CPU of this client (NOTES), and
the generator shares a core with the mock backend. A connection here is an ``asyncio.Protocol``
that parses status line, headers, Content-Length and chunked bodies, and scans SSE events for
content and ``[DONE]`` without decoding their JSON.

Three uses:
  * :func:`run_load`: fixed concurrency (one keep-alive connection per worker), warm-up, then a
    fixed measured window; requests/s, latency p50/p90/p99, time to first byte and to first
    token for streams, and the CPU seconds / peak RSS of the system under test over the window;
  * :func:`disconnect_probe`: send one request, leave at a chosen moment, report when;
  * :func:`hold_streams`: open N slow streams at once and follow them to the end.

Also a CLI: ``python bench/loadgen.py URL --concurrency 32 --duration 10 [--stream]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from procstat import Meter

CONTENT_MARKERS = (b'"content":"', b'"text":"')


class Exchange:
    """One request/response, timed with ``time.monotonic()``."""

    __slots__ = ("t_sent", "t_headers", "t_first_byte", "t_first_token", "t_done", "status", "body", "tokens", "done_marker", "error", "events")

    def __init__(self) -> None:
        self.t_sent = time.monotonic()
        self.t_headers = self.t_first_byte = self.t_first_token = self.t_done = 0.0
        self.status = 0
        self.body = bytearray()
        self.tokens = 0
        self.done_marker = False
        self.error = ""
        self.events = 0


class ClientProtocol(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.exchange: Exchange | None = None
        self.waiter: asyncio.Future[Exchange] | None = None
        self.progress: Callable[[Exchange], None] | None = None
        self.state = "idle"
        self.remaining = 0
        self.chunked = False
        self.sse = bytearray()
        self.keep_alive = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done() and self.exchange is not None:
            self.exchange.error = self.exchange.error or f"connection closed ({exc or 'EOF'}) in state {self.state}"
            self.exchange.t_done = time.monotonic()
            self.waiter.set_result(self.exchange)

    def send(self, raw: bytes, progress: Callable[[Exchange], None] | None = None) -> asyncio.Future[Exchange]:
        assert self.transport is not None
        self.exchange = Exchange()
        self.waiter = asyncio.get_running_loop().create_future()
        self.progress = progress
        self.state = "head"
        self.buf.clear()
        self.sse.clear()
        self.transport.write(raw)
        return self.waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- parsing ---------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None or self.state == "idle":
            return
        self.buf += data
        if self.state == "head":
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            del self.buf[: end + 4]
            ex.status = int(lines[0].split(" ", 2)[1])
            ex.t_headers = time.monotonic()
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            self.keep_alive = headers.get("connection") != "close"
            self.chunked = "chunked" in headers.get("transfer-encoding", "")
            if self.chunked:
                self.state = "chunk-size"
            else:
                self.state = "body"
                self.remaining = int(headers.get("content-length", "0"))
                if not self.remaining:
                    self._finish()
                    return
        if self.chunked:
            self._chunks()
        elif self.buf:
            take = bytes(self.buf[: self.remaining])
            del self.buf[: self.remaining]
            self.remaining -= len(take)
            self._body(take)
            if not self.remaining:
                self._finish()

    def _chunks(self) -> None:
        buf = self.buf
        while buf:
            if self.state == "chunk-size":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";")[0], 16)
                del buf[: end + 2]
                if size == 0:
                    self.state = "trailer"
                else:
                    self.remaining = size
                    self.state = "chunk-data"
            if self.state == "chunk-data":
                if len(buf) < self.remaining + 2:
                    if len(buf) > self.remaining:
                        return
                    take = bytes(buf)
                    buf.clear()
                    self.remaining -= len(take)
                    self._body(take)
                    return
                take = bytes(buf[: self.remaining])
                del buf[: self.remaining + 2]
                self.remaining = 0
                self.state = "chunk-size"
                self._body(take)
            if self.state == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
                    return

    def _body(self, data: bytes) -> None:
        ex = self.exchange
        assert ex is not None
        if not data:
            return
        if not ex.t_first_byte:
            ex.t_first_byte = time.monotonic()
        if not self.chunked or ex.status != 200:
            ex.body += data
            return
        self.sse += data
        while True:
            end = self.sse.find(b"\n\n")
            if end < 0:
                break
            event = bytes(self.sse[:end])
            del self.sse[: end + 2]
            ex.events += 1
            if event.startswith(b"data: [DONE]"):
                ex.done_marker = True
            elif words := _content_words(event):
                ex.tokens += words
                if not ex.t_first_token:
                    ex.t_first_token = time.monotonic()
            elif b'"error"' in event:
                ex.error = event[:200].decode(errors="replace")
        if self.progress is not None:
            self.progress(ex)

    def _finish(self) -> None:
        ex = self.exchange
        assert ex is not None and self.waiter is not None
        ex.t_done = time.monotonic()
        self.state = "idle"
        if not self.waiter.done():
            self.waiter.set_result(ex)
        if not self.keep_alive:
            self.close()


def _content_words(event: bytes) -> int:
    """Words of content in one SSE event (every token of the bench's backends is one word). A
    gateway may forward tokens that reached it together as one chunk, so words, not chunks,
    are what a stream is checked by. (The bench's texts have no quotes to unescape.)"""
    for marker in CONTENT_MARKERS:
        at = event.find(marker)
        if at >= 0:
            start = at + len(marker)
            return len(event[start : event.find(b'"', start)].split())
    return 0


class Target:
    """Where and what to send: the raw request bytes are built once."""

    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path
        self.body = body
        self.headers = headers or {}
        self.stream = bool(body.get("stream"))
        self.raw = self.build(body)

    def build(self, body: dict[str, Any]) -> bytes:
        data = json.dumps(body, separators=(",", ":")).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        head = (
            f"POST {self.path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
            f"accept: {'text/event-stream' if self.stream else 'application/json'}\r\n"
            f"content-length: {len(data)}\r\n{extra}\r\n"
        )
        return head.encode() + data

    async def connect(self) -> ClientProtocol:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(ClientProtocol, self.host, self.port)
        return protocol


def check(ex: Exchange, stream: bool, expect_tokens: int | None) -> str:
    """Why this exchange is not a success, or ``""``."""
    if ex.error:
        return ex.error
    if ex.status != 200:
        return f"HTTP {ex.status}: {bytes(ex.body[:200]).decode(errors='replace')}"
    if stream:
        if not ex.done_marker:
            return "stream ended without [DONE]"
        if expect_tokens is not None and ex.tokens != expect_tokens:
            return f"stream carried {ex.tokens} words of content, expected {expect_tokens}"
    elif b'"choices"' not in ex.body:
        return f"no choices in body: {bytes(ex.body[:200]).decode(errors='replace')}"
    return ""


def percentiles(values: list[float], points: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in points}
    ordered = sorted(values)
    last = len(ordered) - 1
    return {f"p{p}": round(ordered[min(last, int(round(p / 100 * last)))] * 1000, 3) for p in points}


async def run_load(
    target: Target,
    *,
    concurrency: int,
    duration: float,
    warmup: float,
    sut_pids: list[int] | None = None,
    expect_tokens: int | None = None,
) -> dict[str, Any]:
    """Fixed concurrency for ``warmup + duration`` seconds; figures cover the window only."""
    start = time.monotonic()
    window_start, window_end = start + warmup, start + warmup + duration
    meter = Meter(sut_pids or [])
    latencies: list[float] = []
    ttfb: list[float] = []
    ttft: list[float] = []
    errors: list[str] = []
    state = {"measuring": False}
    request_timeout = max(30.0, 2 * duration)

    async def worker() -> None:
        conn: ClientProtocol | None = None
        while time.monotonic() < window_end:
            if conn is None or conn.closed:
                try:
                    conn = await target.connect()
                except OSError as exc:
                    if state["measuring"]:
                        errors.append(f"connect: {exc}")
                    await asyncio.sleep(0.05)
                    continue
            try:
                ex = await asyncio.wait_for(conn.send(target.raw), request_timeout)
            except TimeoutError:
                errors.append(f"no response within {request_timeout:g}s")
                conn.close()
                conn = None
                continue
            if ex.t_sent < window_start or ex.t_done > window_end:
                continue
            problem = check(ex, target.stream, expect_tokens)
            if problem:
                errors.append(problem)
                conn.close()
                conn = None
                continue
            latencies.append(ex.t_done - ex.t_sent)
            if target.stream:
                ttfb.append((ex.t_first_byte or ex.t_done) - ex.t_sent)
                ttft.append((ex.t_first_token or ex.t_done) - ex.t_sent)
        if conn is not None:
            conn.close()

    async def sampler() -> None:
        await asyncio.sleep(max(0.0, window_start - time.monotonic()))
        meter.start()
        state["measuring"] = True
        while time.monotonic() < window_end:
            await asyncio.sleep(min(0.1, max(0.0, window_end - time.monotonic())))
            meter.sample()
        meter.stop()

    await asyncio.gather(sampler(), *(worker() for _ in range(concurrency)))
    result: dict[str, Any] = {
        "concurrency": concurrency,
        "duration_s": duration,
        "requests": len(latencies),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "rps": round(len(latencies) / duration, 1),
        "latency_ms": percentiles(latencies),
        "sut_cpu_s": round(meter.cpu, 3),
        "sut_cpu_per_request_ms": round(meter.cpu / len(latencies) * 1000, 3) if latencies else None,
        "sut_peak_rss_mb": round(meter.peak_rss / 2**20, 1),
    }
    if target.stream:
        result["ttfb_ms"] = percentiles(ttfb)
        result["ttft_ms"] = percentiles(ttft)
    return result


async def disconnect_probe(target: Target, *, after: float = 0.0, after_tokens: int = 0, tokens_within: float = 10.0) -> dict[str, Any]:
    """Send one request and close the connection ``after`` seconds, or once ``after_tokens``
    words of content arrived. Returns the monotonic time of the close (or why it never came)."""
    conn = await target.connect()
    reached = asyncio.Event()

    def progress(ex: Exchange) -> None:
        if after_tokens and ex.tokens >= after_tokens:
            reached.set()

    waiter = conn.send(target.raw, progress)
    try:
        if after_tokens:
            await asyncio.wait_for(reached.wait(), tokens_within)
        else:
            await asyncio.sleep(after)
    except TimeoutError:
        conn.close()
        return {"error": f"no {after_tokens} tokens within {tokens_within:g}s"}
    except asyncio.CancelledError:
        conn.close()
        raise
    if waiter.done():
        ex = waiter.result()
        conn.close()
        return {"error": f"response finished before the disconnect: {check(ex, target.stream, None) or 'complete'}"}
    t_close = time.monotonic()
    conn.close()
    return {"t_close": t_close}


async def hold_streams(
    target: Target,
    n: int,
    *,
    connect_parallelism: int = 64,
    give_up_after: float = 600.0,
    on_all_open: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Open ``n`` streams (at most ``connect_parallelism`` connecting at once), call
    ``on_all_open`` (sync or async) when all have their headers, then wait for every one to end
    (streams still open after ``give_up_after`` seconds count as failed)."""
    gate = asyncio.Semaphore(connect_parallelism)
    opened = 0
    peak = 0
    live = 0
    all_open = asyncio.Event()
    results: list[str] = []
    started = time.monotonic()
    open_at: dict[str, float] = {}

    async def one() -> None:
        nonlocal opened, peak, live
        headers = asyncio.Event()

        def progress(ex: Exchange) -> None:
            headers.set()

        async with gate:
            try:
                conn = await target.connect()
            except OSError as exc:
                results.append(f"connect: {exc}")
                return
            waiter = conn.send(target.raw, progress)
            done_first = asyncio.ensure_future(headers.wait())
            await asyncio.wait({done_first, waiter}, return_when=asyncio.FIRST_COMPLETED)
            done_first.cancel()
        opened += 1
        live += 1
        peak = max(peak, live)
        if opened == n:
            open_at["t"] = time.monotonic()
            all_open.set()
        ex = await waiter
        live -= 1
        results.append(check(ex, True, None))
        conn.close()

    async def watcher() -> None:
        await all_open.wait()
        if on_all_open is not None:
            outcome = on_all_open()
            if asyncio.iscoroutine(outcome):
                await outcome

    tasks = [asyncio.ensure_future(one()) for _ in range(n)]
    watch = asyncio.ensure_future(watcher())
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), give_up_after)
    except TimeoutError:
        pass
    if not watch.done():
        watch.cancel()
    failures = [r for r in results if r]
    return {
        "streams": n,
        "opened": opened,
        "peak_open": peak,
        "completed": len([r for r in results if not r]),
        "failed": len(failures) + (n - len(results)),
        "failure_samples": sorted(set(failures))[:3],
        "open_all_s": round(open_at["t"] - started, 2) if "t" in open_at else None,
        "total_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="raw asyncio HTTP/1.1 load generator")
    parser.add_argument("url", help="e.g. http://127.0.0.1:8080/v1/chat/completions")
    parser.add_argument("--model", default="bench")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--api-key", default="")
    parser.add_argument("--pid", type=int, action="append", default=[], help="system under test (repeatable)")
    args = parser.parse_args()
    body: dict[str, Any] = {"model": args.model, "messages": [{"role": "user", "content": "hello"}]}
    if args.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    result = asyncio.run(
        run_load(Target(args.url, body, headers), concurrency=args.concurrency, duration=args.duration, warmup=args.warmup, sut_pids=args.pid)
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
