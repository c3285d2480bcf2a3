"""Running a role as a process: signal-driven shutdown, the ``ready:`` line, the collector.

First SIGINT/SIGTERM: the role's ``shutdown`` trigger fires and it drains. A second one: stop now
(cancel everything; runs still record ``cancelled`` in their ``finally``).
"""

from __future__ import annotations

import gc
import logging
import signal
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("iop_trio")

Shutdown = Callable[[], Awaitable[None]]

#: Net allocations between two collections of the youngest generation (CPython's default: 700).
#: A request makes and drops thousands of objects that reference counting frees at once; at 700
#: a collection ran every few requests and promoted whatever was in flight, so under load full
#: collections of the whole heap ran every second or two: ~8% of the edge's CPU, and each a pause
#: of the event loop (300 ms with 1,000 nodes registered). Cyclic garbage waits a little longer
#: for its collection: at most this many objects. Measured in bench/results/findings.md.
YOUNG_COLLECTION_THRESHOLD = 10_000


def tune_garbage_collection() -> None:
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


async def run_with_signals(role: Callable[[Shutdown], Awaitable[None]]) -> None:
    tune_garbage_collection()
    requested = trio.Event()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    if not requested.is_set():
                        log.info("shutdown requested; draining", extra={"signal": signal.Signals(signum).name})
                        requested.set()
                    else:
                        log.warning("second signal; stopping now")
                        nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await role(requested.wait)
            nursery.cancel_scope.cancel()


def print_ready(**addresses: str) -> None:
    """The one line scripts wait for: ``ready: name=address ...``."""
    print("ready: " + " ".join(f"{name}={address}" for name, address in addresses.items()), flush=True)
