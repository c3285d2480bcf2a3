"""A deterministic cluster: the real edge control-plane and real node runners in one trio run,
connected by memory streams instead of sockets, driven by a seeded schedule of faults.

Nothing here re-implements the platform: nodes are `NodeRunner`s (dial loop, registration,
heartbeats, drain) whose `connect` hands back one end of a memory stream pair while the other end
goes to the edge's real `NodeAcceptor`; clients use `EdgeRun`, the same code the HTTP API calls.
Faults are what a fleet suffers: a node crashes (its whole task tree is cancelled, its connection
drops), goes silent (its stream stops moving, so only heartbeats can tell), is slow, reconnects,
or drains; clients leave at random moments; bursts exceed capacity.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import trio
import trio.testing
from attrs import define, field

from iop_trio.config import (
    EdgeConfig,
    ModelConfig,
    NodeDefaults,
    NodeSettings,
    QueueConfig,
    RetryConfig,
)
from iop_trio.controlplane import NodeSession, NoNodeAvailable
from iop_trio.edge.errors import ApiError
from iop_trio.edge.iop import NodeAcceptor
from iop_trio.edge.openai_requests import ParsedRequest
from iop_trio.edge.runs import EdgeRun
from iop_trio.edge.state import EdgeState
from iop_trio.node.runner import NodeRunner, build_node
from iop_trio.transport import TlsConfig
from iop_trio.wire import ChatMessage, SamplingParams

HEARTBEAT = 5.0
MODEL = "m"


class FreezableStream(trio.abc.Stream):
    """A stream that can stop moving bytes in both directions: a node gone silent."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.thawed = trio.Event()
        self.thawed.set()

    def freeze(self) -> None:
        self.thawed = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.thawed.wait()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        await self.thawed.wait()
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


@define
class Violations:
    """What the invariants found; empty means the scenario passed."""

    items: list[str] = field(factory=list)

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.items.append(message)


@define
class SimNode:
    node_id: str
    capacity: int
    tokens: int
    token_delay: float
    incarnation: int = 0
    runner: NodeRunner | None = None
    scope: trio.CancelScope | None = None
    stop: trio.Event = field(factory=trio.Event)
    streams: list[FreezableStream] = field(factory=list)
    runners: list[NodeRunner] = field(factory=list)
    #: One fault at a time per node, and one incarnation alive at a time (two processes with
    #: one node id would rightly evict each other).
    lock: trio.Lock = field(factory=trio.Lock)
    exited: trio.Event = field(factory=trio.Event)


class Simulation:
    def __init__(self, seed: int, workdir: Path) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.workdir = workdir
        self.violations = Violations()
        self.outcomes: Counter[str] = Counter()
        self.clients = 0
        rng = self.rng
        self.config = EdgeConfig(
            tls=TlsConfig(enabled=False),
            data_dir=str(workdir / "edge"),
            nodes=NodeDefaults(max_concurrency=64, heartbeat_interval=HEARTBEAT),
            queue=QueueConfig(max_waiting=rng.randint(0, 12), timeout=rng.choice([2.0, 10.0, 30.0])),
            retry=RetryConfig(max_attempts=3),
            cancel_timeout=1.0,
            run_deadline=120.0,
        )
        self.state = EdgeState.from_config(self.config, in_thread=False)
        self.acceptor = NodeAcceptor(self.state)
        self.nodes = [
            SimNode(
                node_id=f"n{index}",
                capacity=rng.randint(1, 4),
                tokens=rng.randint(3, 12),
                token_delay=rng.choice([0.05, 0.2, 1.0]),  # some nodes are slow
            )
            for index in range(rng.randint(2, 4))
        ]
        self._edge_nursery: trio.Nursery | None = None
        self._instrument()

    # ------------------------------------------------------------------ instrumentation

    def _instrument(self) -> None:
        """Check, at the moment it happens, that no run goes to a node the edge knows is
        draining or gone, and that no node is given more runs than its max_concurrency."""
        original_reserve = NodeSession.reserve
        violations = self.violations

        def reserve(session: NodeSession, run_id: str) -> Any:
            violations.check(not session.closed, f"run {run_id} scheduled to closed node {session.node_id}")
            violations.check(not session.draining, f"run {run_id} scheduled to draining node {session.node_id}")
            inbox = original_reserve(session, run_id)
            violations.check(
                len(session.runs) <= session.config.max_concurrency,
                f"node {session.node_id} given {len(session.runs)} runs > {session.config.max_concurrency}",
            )
            return inbox

        self._original_reserve = original_reserve
        NodeSession.reserve = reserve  # type: ignore[method-assign]

    def restore(self) -> None:
        NodeSession.reserve = self._original_reserve  # type: ignore[method-assign]

    # ------------------------------------------------------------------ nodes

    def _settings(self, node: SimNode, token: str) -> NodeSettings:
        return NodeSettings(
            node_id=node.node_id,
            edge="sim:0",
            token=token,
            tls=TlsConfig(enabled=False),
            data_dir=str(self.workdir / f"{node.node_id}-{node.incarnation}"),
            capacity=node.capacity,
            models=(
                ModelConfig(
                    name=MODEL, adapter="mock",
                    options={"tokens": node.tokens, "token_delay": node.token_delay, "ttft": 0.1},
                ),
            ),
            shutdown_grace=5.0,
        )

    async def start_node(self, node: SimNode) -> None:
        assert self._edge_nursery is not None
        edge_nursery = self._edge_nursery
        if node.runner is not None:
            await node.exited.wait()
        node.incarnation += 1
        node.stop = trio.Event()
        node.exited = trio.Event()
        exited = node.exited

        async def connect() -> trio.abc.Stream:
            node_side, edge_side = trio.testing.memory_stream_pair()
            stream = FreezableStream(node_side)
            node.streams.append(stream)
            edge_nursery.start_soon(self.acceptor, edge_side, f"sim:{node.node_id}")
            return stream

        token = self.state.tokens.create(node.node_id).token
        runner = build_node(self._settings(node, token), "sim", connect=connect, in_thread=False)
        node.runner = runner
        node.runners.append(runner)
        original_admit = runner.core.admit

        def admit(request: Any) -> Any:
            decision = original_admit(request)
            self.violations.check(
                runner.core.active_runs <= runner.core.max_concurrency,
                f"node {node.node_id} runs {runner.core.active_runs} > {runner.core.max_concurrency}",
            )
            self.violations.check(
                getattr(decision, "code", "") != "node_busy", f"node {node.node_id} had to refuse a run: busy"
            )
            return decision

        runner.core.admit = admit  # type: ignore[method-assign]

        async def run(task_status: trio.TaskStatus[None]) -> None:
            try:
                with trio.CancelScope() as scope:
                    node.scope = scope
                    await runner.run(node.stop.wait, task_status=task_status)
            finally:
                exited.set()

        await edge_nursery.start(run)

    def crash(self, node: SimNode) -> None:
        if node.scope is not None:
            node.scope.cancel()

    def silence(self, node: SimNode) -> None:
        if node.streams:
            node.streams[-1].freeze()

    # ------------------------------------------------------------------ clients

    async def client(self, index: int, arrive_at: float) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        await trio.sleep_until(arrive_at)
        leaves_after = rng.choice([math.inf, math.inf, math.inf, rng.uniform(0, 5)])
        max_tokens = rng.choice([None, None, rng.randint(1, 5)])
        parsed = ParsedRequest(
            "chat", MODEL, (ChatMessage("user", f"client {index}"),), "", SamplingParams(max_tokens=max_tokens),
            stream=True, include_usage=False,
        )
        outcome = "unset"
        with trio.move_on_after(leaves_after) as leaving:
            try:
                run = await EdgeRun.open(self.state, parsed, priority=rng.choice([0, 0, 5]))
            except NoNodeAvailable as exc:
                outcome = f"refused {exc.status}"
            else:
                try:
                    tokens = 0
                    while (event := await run.next_event()).kind != "complete":
                        tokens += event.tokens
                    outcome = "complete"
                    self.violations.check(tokens >= 1, f"client {index} completed with no tokens")
                except ApiError as exc:
                    outcome = f"error {exc.code}"
                finally:
                    await run.close()
        if leaving.cancelled_caught:
            outcome = "client left"
        self.violations.check(outcome != "unset", f"client {index} ended without an outcome")
        self.outcomes[outcome] += 1

    # ------------------------------------------------------------------ the scenario

    async def run(self, duration: float = 60.0) -> None:
        rng = self.rng
        async with trio.open_nursery() as edge_nursery:
            self._edge_nursery = edge_nursery
            for node in self.nodes:
                await self.start_node(node)
            async with trio.open_nursery() as scenario:
                self.clients = rng.randint(10, 40)
                for index in range(self.clients):
                    burst = rng.random() < 0.3
                    arrive = rng.uniform(10, 11) if burst else rng.uniform(0, duration)
                    scenario.start_soon(self.client, index, arrive)
                for _ in range(rng.randint(1, 4)):
                    scenario.start_soon(self.fault, rng.uniform(0, duration), rng.choice(self.nodes))
            # Every client has its outcome. Stop the fleet the way an operator would.
            for node in self.nodes:
                node.stop.set()
            with trio.move_on_after(30):
                for node in self.nodes:
                    await node.exited.wait()
            edge_nursery.cancel_scope.cancel()

    async def fault(self, at: float, node: SimNode) -> None:
        rng = self.rng
        kind = rng.choice(["crash", "reconnect", "silence", "drain"])
        pause = rng.uniform(0.5, 10) if kind == "reconnect" else rng.uniform(5, 30)
        await trio.sleep_until(at)
        async with node.lock:
            if kind == "silence":
                self.silence(node)  # the dial loop reconnects once heartbeats give up on it
                return
            if kind == "drain":
                node.stop.set()
            else:
                self.crash(node)
            await trio.sleep(pause)
            await self.start_node(node)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        check = self.violations.check
        check(sum(self.outcomes.values()) == self.clients, f"{self.clients} clients, outcomes {self.outcomes}")
        # Explicit errors a client may rightly get: its node was lost mid-stream, or the only node
        # able to take it was draining (503) and no other could.
        allowed = (
            "complete", "client left", "refused 429", "refused 503",
            "error node_lost", "error node_reconnected", "error node_draining", "error cancelled",
        )
        for outcome in self.outcomes:
            check(outcome in allowed, f"unexpected outcome {outcome!r}")
        check(self.state.runs_in_flight == 0, f"{self.state.runs_in_flight} runs still in flight at the edge")
        check(self.state.scheduler.total_waiting() == 0, "requests still queued")
        for session in self.state.registry.sessions():
            check(not session.runs, f"node {session.node_id} still holds runs {list(session.runs)}")
        edge_rows = self.state.runs.list_runs(limit=100_000)
        check(all(r["status"] != "running" for r in edge_rows), "an edge history row never ended")
        node_run_ids: Counter[str] = Counter()
        for node in self.nodes:
            for runner in node.runners:
                check(runner.core.active_runs == 0, f"node {node.node_id} leaked runs")
                rows = runner.store.list_runs(limit=100_000)
                check(all(r["status"] != "running" for r in rows), f"node {node.node_id}: a run never ended")
                node_run_ids.update(r["run_id"] for r in rows)
        duplicates = [run_id for run_id, count in node_run_ids.items() if count > 1]
        check(not duplicates, f"runs recorded more than once on nodes: {duplicates}")

    def close(self) -> None:
        self.restore()
        for node in self.nodes:
            for runner in node.runners:
                runner.store.close()
        self.state.close()
