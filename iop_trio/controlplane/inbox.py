"""A run's inbox on the edge: where the node connection's reader drops that run's events.

The reader serves every run on the connection, so it must never wait for one slow HTTP client.
``put`` never blocks: when the inbox is full, consecutive deltas are merged into one (text
concatenated, token counts summed). The number of buffered events stays bounded, the bytes are
bounded by what the run generates (max_tokens), and no event is ever lost.
"""

from __future__ import annotations

from collections import deque

import trio

from ..wire import RunEvent

DEFAULT_MAX_EVENTS = 64


class RunLost(Exception):
    """The run can no longer finish: its node's connection ended, or the node sent an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RunInbox:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.max_events = max_events
        self._events: deque[RunEvent] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._failure: RunLost | None = None
        #: True once the terminal event (complete or error) has arrived.
        self.ended = False
        #: True once the edge gave up on the run and asked the node to cancel it.
        self.abandoned = False
        #: True once the run.request is queued for the node; until then the node knows nothing
        #: of the run and there is nothing to cancel there.
        self.sent = False

    def put(self, event: RunEvent) -> None:
        if self.ended:
            return
        if event.is_terminal:
            self.ended = True
        events = self._events
        if (
            len(events) >= self.max_events
            and event.kind == "delta"
            and events[-1].kind == "delta"
        ):
            last = events.pop()
            event = RunEvent(
                run_id=event.run_id,
                kind="delta",
                text=last.text + event.text,
                tokens=last.tokens + event.tokens,
            )
        events.append(event)
        self._lot.unpark_all()

    def fail(self, code: str, message: str) -> None:
        """The run is lost (node gone): wake the reader, who raises RunLost once events run out."""
        if self.ended or self._failure is not None:
            return
        self._failure = RunLost(code, message)
        self._lot.unpark_all()

    @property
    def ready(self) -> bool:
        """An event, or the run's loss, is here: :meth:`get` would not wait."""
        return bool(self._events) or self._failure is not None

    def get_nowait(self) -> RunEvent | None:
        """The next event if one is here, else None; RunLost once the run is lost and drained."""
        if self._events:
            return self._events.popleft()
        if self._failure is not None:
            raise self._failure
        return None

    async def get(self) -> RunEvent:
        while (event := self.get_nowait()) is None:
            await self._lot.park()
        return event
