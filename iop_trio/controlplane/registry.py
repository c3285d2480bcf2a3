"""The registry of connected nodes, keyed by node id."""

from __future__ import annotations

import logging
from typing import Any

import trio

from .session import NodeSession

log = logging.getLogger("iop_trio.controlplane")


class NodeRegistry:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeSession] = {}
        # model -> node id -> session: scheduling looks at the nodes of one model, not the fleet.
        self._by_model: dict[str, dict[str, NodeSession]] = {}

    def add(self, session: NodeSession) -> None:
        """Register ``session``; a node re-registering replaces (and disconnects) its old session.
        Both sessions' ``on_change`` hooks run, so the scheduler sees the change at once."""
        old = self._nodes.get(session.node_id)
        if old is not None:
            self._unindex(old)
        self._nodes[session.node_id] = session
        for model in session.info.models:
            self._by_model.setdefault(model, {})[session.node_id] = session
        if old is not None:
            log.info("node re-registered; replacing old connection", extra={"node_id": session.node_id})
            old.replace()
            old.on_change(old)
        session.on_change(session)

    def remove(self, session: NodeSession) -> None:
        if self._nodes.get(session.node_id) is session:
            del self._nodes[session.node_id]
            self._unindex(session)
            session.on_change(session)

    def holds(self, session: NodeSession) -> bool:
        """Whether ``session`` is the registered one for its node id (not removed, not replaced)."""
        return self._nodes.get(session.node_id) is session

    def _unindex(self, session: NodeSession) -> None:
        for model in session.info.models:
            nodes = self._by_model.get(model, {})
            if nodes.get(session.node_id) is session:
                del nodes[session.node_id]
                if not nodes:
                    del self._by_model[model]

    def __len__(self) -> int:
        return len(self._nodes)

    def sessions(self) -> list[NodeSession]:
        return list(self._nodes.values())

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def models(self) -> dict[str, list[str]]:
        """Model -> ids of the nodes serving it, sorted by model name."""
        return {model: list(nodes) for model, nodes in sorted(self._by_model.items())}

    def describe(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": s.node_id,
                "peer": s.peer,
                "models": list(s.info.models),
                "labels": dict(s.info.labels),
                "adapters": list(s.info.adapters),
                "state": s.state,
                "max_concurrency": s.config.max_concurrency,
                "outstanding": s.outstanding,
                "connected_at": s.connected_at,
                "last_heartbeat_age_s": round(trio.current_time() - s.conn.last_received, 3),
            }
            for s in self._nodes.values()
        ]
