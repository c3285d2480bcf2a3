"""Real processes on 127.0.0.1: ``iop-trio certs init``, an edge, nodes, from config files."""

from __future__ import annotations

import os
import selectors
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import yaml

STARTUP_TIMEOUT = 30.0
T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 10.0, what: Callable[[], str] = lambda: "the condition") -> T:
    """Poll ``check`` until it returns something truthy, and return that. These tests drive real
    processes on a real clock, so this is a plain sleep loop; ``what`` describes a timeout."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g}s: {what()}")
        time.sleep(0.02)
    return result


def iop_trio(*args: str) -> list[str]:
    return [sys.executable, "-m", "iop_trio.cli", *args]


class Process:
    """A role process: waits for its ``ready:`` line, stops with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("w")
        repo = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))
        self.popen = subprocess.Popen(
            args, cwd=workdir, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath},
        )
        self.ready: dict[str, str] = {}

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        assert self.popen.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=0.1):
                    continue
                line = self.popen.stdout.readline()
                if not line:
                    break
                if line.startswith("ready: "):
                    self.ready = dict(pair.split("=", 1) for pair in line[len("ready: "):].split())
                    return self.ready
        raise AssertionError(f"{self.name} did not become ready:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def signal(self, signum: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def stop(self, timeout: float = 15.0) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            raise AssertionError(f"{self.name} did not stop on SIGTERM:\n{self.logs()}") from None
        finally:
            if self.popen.stdout:
                self.popen.stdout.close()
            self._log.close()


class Cluster:
    """An edge and its nodes, all real processes, in a private working directory."""

    def __init__(self, workdir: Path, api_keys: tuple[str, ...] = (), edge_extra: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.processes: list[Process] = []
        subprocess.run(
            iop_trio("certs", "init", "certs", "--node", "node-a", "--node", "node-b", "--node", "node-c"),
            cwd=workdir, check=True, capture_output=True,
        )
        self.edge_config = self.write_config("edge.yaml", {
            "http": {"listen": "127.0.0.1:0", "graceful_timeout": 5, "max_body_size": 1 << 20},
            "iop": {"listen": "127.0.0.1:0", "register_timeout": 5, "handshake_timeout": 5},
            "tls": {"enabled": True, "cert": "certs/edge.crt", "key": "certs/edge.key", "ca": "certs/ca.crt"},
            "data_dir": "data/edge",
            "api_keys": list(api_keys),
            "cancel_timeout": 2,
            **(edge_extra or {}),
        })
        self.edge: Process | None = None
        self._clients: list[openai.OpenAI] = []

    def client(self, api_key: str = "none", timeout: float = 20) -> openai.OpenAI:
        """An openai SDK client for this edge, closed when the cluster stops."""
        sdk = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=timeout)
        self._clients.append(sdk)
        return sdk

    def write_config(self, name: str, data: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(data))
        return path

    def start_edge(self) -> Process:
        self.edge = self.start("edge", iop_trio("edge", "--config", str(self.edge_config)))
        return self.edge

    def create_token(self, node_id: str | None = None) -> str:
        args = ["tokens", "create", "--config", str(self.edge_config)]
        if node_id:
            args += ["--node", node_id]
        result = subprocess.run(iop_trio(*args), cwd=self.workdir, check=True, capture_output=True, text=True)
        return result.stdout.strip()

    def node_config(self, node_id: str, models: list[dict[str, Any]], token: str | None = None, **extra: Any) -> Path:
        assert self.edge is not None
        data = {
            "node_id": node_id,
            "edge": self.edge.ready["iop"],
            "server_name": "localhost",
            "token": token if token is not None else self.create_token(node_id),
            "tls": {"enabled": True, "cert": f"certs/{node_id}.crt", "key": f"certs/{node_id}.key", "ca": "certs/ca.crt"},
            "data_dir": f"data/{node_id}",
            "models": models,
            "shutdown_grace": 5,
            "reconnect": {"initial": 0.1, "maximum": 1.0},
            **extra,
        }
        return self.write_config(f"{node_id}.yaml", data)

    def start_node(self, node_id: str, models: list[dict[str, Any]], **extra: Any) -> Process:
        config = self.node_config(node_id, models, **extra)
        return self.start(node_id, iop_trio("node", "--config", str(config)))

    def start(self, name: str, args: list[str]) -> Process:
        process = Process(name, args, self.workdir)
        self.processes.append(process)
        process.wait_ready()
        return process

    @property
    def url(self) -> str:
        assert self.edge is not None
        return self.edge.ready["http"]

    def wait_for_models(self, *models: str, timeout: float = 10.0) -> None:
        def listed() -> bool:
            data = httpx.get(f"{self.url}/v1/models", headers=self.auth_headers()).json().get("data", [])
            return set(models) <= {m["id"] for m in data}

        eventually(listed, timeout, lambda: f"models {models} never appeared")

    def auth_headers(self) -> dict[str, str]:
        keys = yaml.safe_load(self.edge_config.read_text())["api_keys"]
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    def metric(self, name: str) -> float | None:
        """One unlabelled sample from the edge's ``/metrics``."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            sample, _, value = line.partition(" ")
            if sample == name:
                return float(value)
        return None

    def node_state(self, node_id: str) -> str | None:
        """The node's state in ``/admin/nodes`` (the edge config needs ``admin_key: adm``)."""
        nodes = httpx.get(f"{self.url}/admin/nodes", headers={"Authorization": "Bearer adm"}).json()["data"]
        return next((node["state"] for node in nodes if node["node_id"] == node_id), None)

    def runs(self, node_id: str) -> list[dict[str, Any]]:
        db = self.workdir / "data" / node_id / "runs.db"
        with sqlite3.connect(db) as conn:
            conn.row_factory = sqlite3.Row
            return [dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY started_at")]

    def wait_for_ended_runs(self, node_id: str, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The node's history once ``count`` runs have ended (it is written in batches, ~50 ms late)."""

        def ended() -> list[dict[str, Any]] | None:
            rows = self.runs(node_id)
            return rows if sum(r["status"] != "running" for r in rows) >= count else None

        return eventually(ended, timeout, lambda: f"fewer than {count} ended runs on {node_id}: {self.runs(node_id)}")

    def wait_for_run(self, node_id: str, status: str, timeout: float = 10.0) -> dict[str, Any]:
        """The latest run on ``node_id`` with ``status``, once there is one."""
        runs = eventually(
            lambda: [r for r in self.runs(node_id) if r["status"] == status], timeout,
            lambda: f"no {status} run on {node_id}: {self.runs(node_id)}",
        )
        return runs[-1]

    def stop(self) -> None:
        for sdk in self._clients:
            sdk.close()
        failures = []
        for process in reversed(self.processes):
            try:
                process.stop()
            except AssertionError as exc:
                failures.append(str(exc))
        assert not failures, failures


MOCK = {"name": "mock", "adapter": "mock", "options": {"tokens": 8}}
SLOW = {"name": "slow", "adapter": "mock", "options": {"tokens": 400, "token_delay": 0.02}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Edge (API key ``sk-test``) + node-a (mock, slow) + node-b (mock, only-b)."""
    c = Cluster(tmp_path_factory.mktemp("cluster"), api_keys=("sk-test",))
    try:
        c.start_edge()
        c.start_node("node-a", [MOCK, SLOW])
        c.start_node("node-b", [MOCK, {"name": "only-b", "adapter": "mock", "options": {"tokens": 3}}])
        c.wait_for_models("mock", "slow", "only-b")
        yield c
    finally:
        c.stop()
