"""run_with_signals: what every long-running role gets before it starts."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from iop_trio.roles import YOUNG_COLLECTION_THRESHOLD, Shutdown, run_with_signals


@pytest.fixture
def restore_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


async def test_a_role_runs_with_the_young_generation_collected_less_often(restore_gc) -> None:
    default_rest = gc.get_threshold()[1:]
    seen: list[tuple[int, ...]] = []

    async def role(shutdown: Shutdown) -> None:
        seen.append(gc.get_threshold())

    await run_with_signals(role)
    assert seen == [(YOUNG_COLLECTION_THRESHOLD, *default_rest)]
