"""Running a role as a process: signal-driven shutdown and the ``ready:`` line.

First SIGINT/SIGTERM: the role's ``shutdown`` trigger fires and it drains. A second one: stop now
(cancel everything; runs still record ``cancelled`` in their ``finally``).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

log = logging.getLogger("iop_trio")

Shutdown = Callable[[], Awaitable[None]]


async def run_with_signals(role: Callable[[Shutdown], Awaitable[None]]) -> None:
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
