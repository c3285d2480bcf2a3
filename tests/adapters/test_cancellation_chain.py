"""A client that goes away stops the backend, in every phase, for every real adapter.

One trio run holds the whole chain over real loopback sockets: an httpx client, the edge
(hypercorn + quart-trio), IOP over mutual TLS, a node with the vllm or ollama adapter, and a
backend double that records when, and in which phase, its client disconnected. The phases:

- ``queued``: the backend accepted the request but has not answered yet (its own queue);
- ``before_first_token``: response headers sent, no token yet;
- ``mid_stream``: tokens are flowing;
- ``non_streaming``: the client asked for a whole response (upstream still streams).

For the cli adapter the backend is a process group: it has seen the disconnect once it is gone
(there is no backend queue in front of a program, so its phases start at "before first token").
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from iop_trio.certs import init_certs
from iop_trio.config import EdgeConfig, HttpConfig, IopListenConfig, ModelConfig, NodeSettings
from iop_trio.edge.server import run_edge
from iop_trio.edge.state import EdgeState
from iop_trio.node.runner import NodeRunner, build_node
from iop_trio.transport import TlsConfig
from tests.doubles.backends import Behaviour, Recorder, ollama_app, openai_app, serve_double

# Generous for a loaded CI machine; bench/ measures the real lag (a few ms).
MAX_CANCEL_LAG = 1.0
BACKENDS = {"vllm": (openai_app, "/v1"), "ollama": (ollama_app, "")}
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


class Stack:
    def __init__(self, url: str, runner: NodeRunner, recorder: Recorder) -> None:
        self.url = url
        self.runner = runner
        self.recorder = recorder

    async def wait_for_row(self, status: str) -> dict:
        async def recorded() -> bool:
            return bool(self.runner.store.list_runs(status))

        await poll(recorded, 5)
        return self.runner.store.list_runs(status)[0]


def tls(certs: Path, name: str) -> TlsConfig:
    return TlsConfig(True, str(certs / f"{name}.crt"), str(certs / f"{name}.key"), str(certs / "ca.crt"))


async def start_stack(nursery: trio.Nursery, tmp_path: Path, adapter: str, behaviour: Behaviour) -> Stack:
    app_factory, suffix = BACKENDS[adapter]
    recorder = Recorder()
    backend_url = await nursery.start(partial(serve_double, app_factory(behaviour, recorder)))
    model = ModelConfig(name="m", adapter=adapter, backend_model="double-model")
    adapters = {adapter: {"base_url": backend_url + suffix, "read_timeout": 30.0}}
    runner, url = await start_edge_and_node(nursery, tmp_path, model, adapters)
    return Stack(url, runner, recorder)


async def start_edge_and_node(
    nursery: trio.Nursery, tmp_path: Path, model: ModelConfig, adapters: dict
) -> tuple[NodeRunner, str]:
    certs = tmp_path / "certs"
    init_certs(certs, nodes=["node-1"])
    edge_config = EdgeConfig(
        http=HttpConfig(listen="127.0.0.1:0", graceful_timeout=1),
        iop=IopListenConfig(listen="127.0.0.1:0"),
        tls=tls(certs, "edge"),
        data_dir=str(tmp_path / "edge"),
    )
    state = EdgeState.from_config(edge_config)
    stop = trio.Event()
    addresses = await nursery.start(run_edge, edge_config, stop.wait, state)
    settings = NodeSettings(
        node_id="node-1",
        edge=addresses["iop"],
        server_name="localhost",
        token=state.tokens.create("node-1").token,
        tls=tls(certs, "node-1"),
        data_dir=str(tmp_path / "node-1"),
        models=(model,),
        adapters=adapters,
    )
    runner = build_node(settings, "test")
    await nursery.start(runner.run, stop.wait)
    return runner, addresses["http"]


@pytest.fixture(params=sorted(BACKENDS))
def adapter(request: pytest.FixtureRequest) -> str:
    return request.param


async def assert_backend_stopped(stack: Stack, gone_at: float, phase: str) -> None:
    with trio.fail_after(5):
        await stack.recorder.disconnected.wait()
    (disconnect,) = stack.recorder.disconnects
    assert disconnect.phase == phase
    assert disconnect.at - gone_at < MAX_CANCEL_LAG
    row = await stack.wait_for_row("cancelled")
    assert row["completion_tokens"] == disconnect.tokens_sent or row["completion_tokens"] <= disconnect.tokens_sent
    assert stack.recorder.completed == 0


async def stream_then_leave(stack: Stack, wait_for: trio.Event, chunks: int = 0) -> float:
    """Open a streaming request, read ``chunks`` content chunks once ``wait_for`` fired, leave."""
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True}) as response:
            assert response.status_code == 200
            async with aclosing(response.aiter_lines()) as lines:
                seen = 0
                while seen < chunks:
                    line = await lines.__anext__()
                    seen += line.startswith("data:") and '"content":"' in line and '"content":""' not in line
                await wait_for.wait()
                return trio.current_time()


async def test_client_leaving_while_the_backend_queues(adapter, tmp_path, nursery) -> None:
    """No response headers yet: the run starts for the client when the backend accepts it."""
    stack = await start_stack(nursery, tmp_path, adapter, Behaviour(queue_delay=60))
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.CancelScope() as request_scope:
            nursery.start_soon(_cancel_when, stack.recorder.received, request_scope)
            await client.post(f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True})
        gone_at = trio.current_time()
    assert request_scope.cancelled_caught
    await assert_backend_stopped(stack, gone_at, "queued")


async def test_client_leaving_before_the_first_token(adapter, tmp_path, nursery) -> None:
    stack = await start_stack(nursery, tmp_path, adapter, Behaviour(ttft=60))
    gone_at = await stream_then_leave(stack, stack.recorder.streaming)
    await assert_backend_stopped(stack, gone_at, "before_first_token")


async def test_client_leaving_mid_stream(adapter, tmp_path, nursery) -> None:
    stack = await start_stack(nursery, tmp_path, adapter, Behaviour(tokens=1000, token_delay=0.05))
    gone_at = await stream_then_leave(stack, stack.recorder.first_token, chunks=3)
    await assert_backend_stopped(stack, gone_at, "mid_stream")
    row = await stack.wait_for_row("cancelled")
    assert 3 <= row["completion_tokens"] < 1000


async def test_non_streaming_client_leaving(adapter, tmp_path, nursery) -> None:
    stack = await start_stack(nursery, tmp_path, adapter, Behaviour(tokens=1000, token_delay=0.05))
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.CancelScope() as request_scope:
            nursery.start_soon(lambda: _cancel_when(stack.recorder.first_token, request_scope))
            await client.post(f"{stack.url}/v1/chat/completions", json=BODY)
        gone_at = trio.current_time()
    assert request_scope.cancelled_caught
    await assert_backend_stopped(stack, gone_at, "mid_stream")


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def test_complete_run_through_each_adapter(adapter, tmp_path, nursery) -> None:
    stack = await start_stack(nursery, tmp_path, adapter, Behaviour(tokens=6))
    async with httpx.AsyncClient(timeout=30) as client:
        reply = (await client.post(f"{stack.url}/v1/chat/completions", json=BODY)).json()
    assert reply["choices"][0]["message"]["content"] == "alpha bravo charlie delta echo foxtrot"
    assert reply["usage"] == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}
    row = await stack.wait_for_row("complete")
    assert row["completion_tokens"] == 6


# The cli adapter: the "backend" is a process group; it has seen the disconnect when it is gone.
CLI_PROGRAM = """
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(float(sys.argv[2]))
for index in range(1000):
    print(f"w{index}", end=" ", flush=True)
    time.sleep(0.05)
"""


async def start_cli_stack(nursery: trio.Nursery, tmp_path: Path, ttft: float) -> tuple[NodeRunner, str, Path]:
    pidfile = tmp_path / "program.pid"
    argv = [sys.executable, "-c", CLI_PROGRAM, str(pidfile), str(ttft)]
    model = ModelConfig(name="m", adapter="cli", options={"argv": argv, "kill_grace": 0.5})
    runner, url = await start_edge_and_node(nursery, tmp_path, model, {})
    return runner, url, pidfile


async def poll(check: Callable[[], Awaitable[bool]], limit: float) -> None:
    """Wait for state that lives in another process, which no trio.Event can signal."""
    with trio.fail_after(limit):
        while not await check():  # noqa: ASYNC110 - polling another process is the point
            await trio.sleep(0.005)


async def wait_started(pidfile: Path) -> int:
    path = trio.Path(pidfile)

    async def written() -> bool:
        return await path.exists() and bool(await path.read_text())

    await poll(written, 10)
    return int(await path.read_text())


async def gone(pid: int) -> bool:
    try:
        stat = await trio.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited already


async def assert_program_stopped(runner: NodeRunner, pid: int, gone_at: float) -> None:
    await poll(lambda: gone(pid), 5)
    assert trio.current_time() - gone_at < MAX_CANCEL_LAG
    stack = Stack("", runner, Recorder())
    await stack.wait_for_row("cancelled")


@pytest.mark.parametrize("phase", ["before_first_token", "mid_stream", "non_streaming"])
async def test_cli_program_stops_when_the_client_leaves(phase, tmp_path, nursery) -> None:
    runner, url, pidfile = await start_cli_stack(nursery, tmp_path, ttft=60 if phase == "before_first_token" else 0)
    async with httpx.AsyncClient(timeout=30) as client:
        if phase == "non_streaming":
            with trio.CancelScope() as scope:
                async def leave_after_output() -> None:
                    await wait_started(pidfile)
                    await trio.sleep(0.3)
                    scope.cancel()
                nursery.start_soon(leave_after_output)
                await client.post(f"{url}/v1/chat/completions", json=BODY)
            gone_at = trio.current_time()
        else:
            async with client.stream("POST", f"{url}/v1/chat/completions", json={**BODY, "stream": True}) as response:
                async with aclosing(response.aiter_lines()) as lines:
                    await wait_started(pidfile)
                    if phase == "mid_stream":
                        async for line in lines:
                            if '"content":"w2' in line:
                                break
                gone_at = trio.current_time()
    await assert_program_stopped(runner, await wait_started(pidfile), gone_at)
