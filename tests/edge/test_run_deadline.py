"""The edge never waits forever for a node that does not say how a run ended."""

from __future__ import annotations

import trio

from iop_trio.config import EdgeConfig
from iop_trio.controlplane import NodeSession
from iop_trio.edge.errors import ApiError
from iop_trio.edge.openai_requests import ParsedRequest
from iop_trio.edge.runs import DEADLINE_GRACE, EdgeRun
from iop_trio.edge.state import EdgeState
from iop_trio.transport import TlsConfig
from iop_trio.wire import (
    CancelRequest,
    ChatMessage,
    NodeConfig,
    RegisterRequest,
    RunEvent,
    SamplingParams,
)


class SilentNode:
    """Accepts the run, then never sends its end."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.last_received = 0.0

    async def send(self, message: object) -> None:
        self.sent.append(message)


async def test_a_run_whose_end_never_comes_fails_after_its_deadline(tmp_path, autojump_clock) -> None:
    config = EdgeConfig(tls=TlsConfig(enabled=False), data_dir=str(tmp_path), run_deadline=10.0)
    state = EdgeState.from_config(config, in_thread=False)
    conn = SilentNode()
    info = RegisterRequest(token="t", node_id="n", version="test", models=("m",), capacity=1)
    session = NodeSession(info, NodeConfig(max_concurrency=1, heartbeat_interval=30), conn, "x")  # type: ignore[arg-type]
    session.on_change = state.scheduler.update
    state.registry.add(session)
    parsed = ParsedRequest("chat", "m", (ChatMessage("user", "hi"),), "", SamplingParams(), False, False)
    run = await EdgeRun.open(state, parsed)
    await session.on_message(RunEvent(run_id=run.run_id, kind="start"), None)  # type: ignore[arg-type]
    assert (await run.next_event()).kind == "start"
    started = trio.current_time()
    try:
        await run.next_event()
        raise AssertionError("the wait should have ended")
    except ApiError as error:
        assert error.status == 504 and error.code == "deadline_exceeded"
    assert 10.0 + DEADLINE_GRACE - 1 <= trio.current_time() - started <= 10.0 + DEADLINE_GRACE
    await run.close()
    assert isinstance(conn.sent[-1], CancelRequest)  # and the node is told to stop
    state.close()
