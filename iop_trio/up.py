"""``iop-trio up``: the embedded default. Edge + N mock nodes + a batch worker in one process
tree, mTLS on.

Certificates are generated fresh in a temporary directory and removed on exit; run history is
kept under ``--data-dir``. Shutdown order: the edge drains its HTTP requests first, then the nodes
(which by then have nothing left to run) drain and exit.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import trio

from .certs import init_certs
from .config import EdgeConfig, HttpConfig, IopListenConfig, ModelConfig, NodeSettings, WorkerConfig
from .edge.server import run_edge
from .edge.state import EdgeState
from .node.runner import build_node
from .roles import Shutdown, print_ready
from .transport import TlsConfig
from .worker import run_worker

MOCK_MODELS = (
    ModelConfig(name="mock", adapter="mock", options={"tokens": 16, "ttft": 0.05, "token_delay": 0.02}),
    ModelConfig(name="mock-fast", adapter="mock", options={"tokens": 16}),
)


async def run_up(http: str, nodes: int, data_dir: Path, shutdown: Shutdown) -> None:
    node_ids = [f"node-{index + 1}" for index in range(nodes)]
    with tempfile.TemporaryDirectory(prefix="iop-trio-certs-") as certs_dir:
        certs = Path(certs_dir)
        init_certs(certs, nodes=node_ids)
        edge_config = EdgeConfig(
            http=HttpConfig(listen=http, graceful_timeout=10.0),
            iop=IopListenConfig(listen="127.0.0.1:0"),
            tls=TlsConfig(True, str(certs / "edge.crt"), str(certs / "edge.key"), str(certs / "ca.crt")),
            data_dir=str(data_dir / "edge"),
        )
        state = EdgeState.from_config(edge_config)
        try:
            edge_stopped = trio.Event()
            async with trio.open_nursery() as nursery:

                async def edge(task_status: trio.TaskStatus[dict[str, str]]) -> None:
                    try:
                        await run_edge(edge_config, shutdown, state, task_status=task_status)
                    finally:
                        edge_stopped.set()

                addresses = await nursery.start(edge)
                for node_id in node_ids:
                    settings = NodeSettings(
                        node_id=node_id,
                        edge=addresses["iop"],
                        server_name="localhost",
                        token=state.tokens.create(node_id).token,
                        tls=TlsConfig(True, str(certs / f"{node_id}.crt"), str(certs / f"{node_id}.key"), str(certs / "ca.crt")),
                        data_dir=str(data_dir / node_id),
                        models=MOCK_MODELS,
                        shutdown_grace=5.0,
                    )
                    await nursery.start(build_node(settings, "iop-trio up").run, edge_stopped.wait)
                # Batch jobs: drains on the same signal as the edge, well within its grace period.
                worker = WorkerConfig(edge_url=addresses["http"], data_dir=edge_config.data_dir, shutdown_grace=5.0)
                await nursery.start(run_worker, worker, shutdown)
                print_ready(http=addresses["http"], iop=addresses["iop"])
                print_tour(addresses["http"], nodes, data_dir)
        finally:
            state.close()


def print_tour(url: str, nodes: int, data_dir: Path) -> None:
    print(
        f"""
IOP-Trio is up: an edge and {nodes} mock node(s), mTLS between them. Models: mock, mock-fast.

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "mock", "messages": [{{"role": "user", "content": "hello"}}], "stream": true}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='mock', messages=[{{'role': 'user', 'content': 'hi'}}]).choices[0].message.content)"

Run history: iop-trio runs --db {data_dir}/node-1/runs.db     Metrics: {url}/metrics
Ctrl-C drains and stops.""",
        flush=True,
    )
