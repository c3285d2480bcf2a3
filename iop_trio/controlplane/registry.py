"""The registry of connected nodes, keyed by node id."""

from __future__ import annotations

import logging
from typing import Any

from .session import NodeSession

log = logging.getLogger("iop_trio.controlplane")


class NodeRegistry:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeSession] = {}

    def add(self, session: NodeSession) -> None:
        """Register ``session``; a node re-registering replaces (and disconnects) its old session."""
        old = self._nodes.get(session.node_id)
        self._nodes[session.node_id] = session
        if old is not None:
            log.info("node re-registered; replacing old connection", extra={"node_id": session.node_id})
            old.replace()

    def remove(self, session: NodeSession) -> None:
        if self._nodes.get(session.node_id) is session:
            del self._nodes[session.node_id]

    def __len__(self) -> int:
        return len(self._nodes)

    def sessions(self) -> list[NodeSession]:
        return list(self._nodes.values())

    def serving(self, model: str) -> list[NodeSession]:
        return [session for session in self._nodes.values() if session.serves(model)]

    def models(self) -> dict[str, list[str]]:
        """Model -> ids of the nodes serving it, sorted by model name."""
        served: dict[str, list[str]] = {}
        for session in self._nodes.values():
            for model in session.info.models:
                served.setdefault(model, []).append(session.node_id)
        return dict(sorted(served.items()))

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": s.node_id,
                "peer": s.peer,
                "models": list(s.info.models),
                "labels": dict(s.info.labels),
                "adapters": list(s.info.adapters),
                "max_concurrency": s.config.max_concurrency,
                "outstanding": s.outstanding,
                "connected_at": s.connected_at,
            }
            for s in self._nodes.values()
        ]
