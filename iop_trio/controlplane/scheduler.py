"""Scheduling: which node runs a request.

Only nodes serving the model are candidates; among those with free capacity, the one with the
fewest outstanding runs relative to its capacity wins (ties go to the longest-registered node).
"""

from __future__ import annotations

from .registry import NodeRegistry
from .session import NodeSession


class NoNodeAvailable(Exception):
    """Why nothing could take the request, as an HTTP status and an OpenAI error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Scheduler:
    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry

    def pick(self, model: str, exclude: frozenset[str] = frozenset()) -> NodeSession:
        if not len(self.registry):
            raise NoNodeAvailable(503, "no_node_available", "no inference node is connected")
        candidates = [s for s in self.registry.serving(model) if s.node_id not in exclude]
        if not candidates:
            raise NoNodeAvailable(
                404, "model_not_found", f"The model `{model}` does not exist or no node serves it."
            )
        free = [s for s in candidates if s.has_capacity and not s.closed]
        if not free:
            raise NoNodeAvailable(
                429, "capacity_exceeded", f"every node serving `{model}` is at capacity; retry shortly"
            )
        return min(free, key=lambda s: s.outstanding / max(1, s.config.max_concurrency))
