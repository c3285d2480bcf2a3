"""Everything the edge's HTTP app and IOP listener share."""

from __future__ import annotations

import trio
from attrs import define, field

from ..config import EdgeConfig
from ..controlplane import KeyLimits, NodeRegistry, Placement, Scheduler, TokenStore
from ..metrics import EdgeMetrics
from ..store import RunRecorder, RunStore


@define
class EdgeState:
    config: EdgeConfig
    registry: NodeRegistry
    scheduler: Scheduler
    tokens: TokenStore
    runs: RunStore
    metrics: EdgeMetrics
    #: Batches the edge's history writes; ``run_edge`` runs its writer.
    history: RunRecorder = field(init=False)
    #: API key -> its limits; empty when the API needs no key.
    keys: dict[str, KeyLimits] = field(factory=dict)
    #: Runs whose client is still being served; shutdown waits for this to reach zero.
    runs_in_flight: int = 0
    _no_runs: trio.Event = field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.metrics.queued.set_function(self.scheduler.total_waiting)
        self.history = RunRecorder(self.runs)


    def run_started(self) -> None:
        self.runs_in_flight += 1
        self.metrics.active_runs.inc()

    def run_finished(self) -> None:
        self.runs_in_flight -= 1
        self.metrics.active_runs.dec()
        if not self.runs_in_flight:
            self._no_runs.set()
            self._no_runs = trio.Event()

    async def wait_no_runs(self) -> None:
        if self.runs_in_flight:
            await self._no_runs.wait()

    @classmethod
    def from_config(cls, config: EdgeConfig, *, in_thread: bool = True) -> EdgeState:
        """``in_thread=False`` only for MockClock tests (see store.sqlite.Database)."""
        registry = NodeRegistry()
        return cls(
            config=config,
            registry=registry,
            scheduler=Scheduler(registry, Placement(config.models), config.queue),
            tokens=TokenStore(config.database, in_thread=in_thread),
            runs=RunStore(config.database, in_thread=in_thread),
            metrics=EdgeMetrics(),
            keys={key.key: KeyLimits(key) for key in config.api_keys},
        )

    def close(self) -> None:
        self.tokens.close()
        self.runs.close()
