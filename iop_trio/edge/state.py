"""Everything the edge's HTTP app and IOP listener share."""

from __future__ import annotations

from attrs import define

from ..config import EdgeConfig
from ..controlplane import NodeRegistry, Scheduler, TokenStore
from ..metrics import EdgeMetrics
from ..store import RunStore


@define
class EdgeState:
    config: EdgeConfig
    registry: NodeRegistry
    scheduler: Scheduler
    tokens: TokenStore
    runs: RunStore
    metrics: EdgeMetrics

    @classmethod
    def from_config(cls, config: EdgeConfig) -> EdgeState:
        registry = NodeRegistry()
        return cls(
            config=config,
            registry=registry,
            scheduler=Scheduler(registry),
            tokens=TokenStore(config.database),
            runs=RunStore(config.database),
            metrics=EdgeMetrics(),
        )

    def close(self) -> None:
        self.tokens.close()
        self.runs.close()
