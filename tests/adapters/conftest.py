from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery cancelled when the test ends: whatever a test starts, it stops."""
    async with trio.open_nursery() as n:
        yield n
        n.cancel_scope.cancel()
