"""The systems under test, each a real process tree started from its own config files.

  direct     the mock backend itself (no gateway)
  iop-vllm   IOP-Trio: edge + one node with the vllm adapter -> the mock backend (mTLS on)
  iop-mock   IOP-Trio: edge + one node with the mock adapter (no backend hop)
  litellm    LiteLLM's proxy (one worker, no database, master key) -> the mock backend
  hypercorn  hypercorn alone with a bare ASGI app giving a fixed answer: the floor under the edge

Pinning: the bench itself (load generator) and the mock backend run on core 0, every system under
test on core 1 (``taskset``), so the figures are per core. Without taskset or a second core the
bench still runs and says so in its results.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
LITELLM_VENV = BENCH / ".venv-litellm"
LITELLM_SPEC = "litellm[proxy]==1.108.7"  # the version NOTES measured (1.107.0 was a compromised release)
MASTER_KEY = "sk-bench-master"


def pinning() -> dict[str, Any]:
    """Which cores the load side and the system under test get, and why if none."""
    cores = sorted(os.sched_getaffinity(0))
    if not shutil.which("taskset"):
        return {"enabled": False, "reason": "taskset (util-linux) not found", "load": None, "sut": None}
    if len(cores) < 2:
        return {"enabled": False, "reason": f"only {len(cores)} core available", "load": None, "sut": None}
    return {"enabled": True, "reason": "", "load": cores[0], "sut": cores[1]}


def pin_prefix(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None else []


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    """A child process; waits for its ``ready:`` line; stops with SIGTERM, then SIGKILL."""

    def __init__(
        self, name: str, args: list[str], workdir: Path, env: dict[str, str] | None = None, drop: tuple[str, ...] = ()
    ) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.popen = subprocess.Popen(
            args, cwd=workdir, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.ready: dict[str, str] = {}

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_ready(self, timeout: float = 60.0) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        assert self.popen.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.popen.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(timeout=0.1):
                    if self.popen.poll() is not None:
                        break
                    continue
                line = self.popen.stdout.readline()
                if not line:
                    break
                if line.startswith("ready: "):
                    self.ready = dict(pair.split("=", 1) for pair in line[len("ready: ") :].split())
                    return self.ready
        raise RuntimeError(f"{self.name} did not become ready; log {self.log_path}:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self.popen.stdout:
            self.popen.stdout.close()
        self._log.close()


def wait_http(url: str, timeout: float, headers: dict[str, str] | None = None, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready within {timeout:g}s ({last})")


class System:
    """A running system under test: where to send requests, and which pids to meter."""

    name = "system"
    label = ""
    has_backend = True

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.base_url = ""
        self.headers: dict[str, str] = {}

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


class MockBackend(System):
    name = "direct"
    label = "(a) backend directly"

    def __init__(self, workdir: Path, core: int | None, models: tuple[str, ...] = ("bench",)) -> None:
        super().__init__()
        args = [*pin_prefix(core), sys.executable, str(BENCH / "mock_backend.py"), "--listen", "127.0.0.1:0"]
        for model in models:
            args += ["--model", model]
        proc = Proc("mock-backend", args, workdir)
        self.procs.append(proc)
        self.base_url = proc.wait_ready()["http"]


class HypercornFloor(System):
    name = "hypercorn"
    label = "(e) hypercorn alone, fixed answer"
    has_backend = False

    def __init__(self, workdir: Path, core: int | None) -> None:
        super().__init__()
        workdir.mkdir(parents=True, exist_ok=True)
        proc = Proc("hypercorn-floor", [*pin_prefix(core), sys.executable, str(BENCH / "http_floor.py")], workdir)
        self.procs.append(proc)
        self.base_url = proc.wait_ready()["http"]


def iop_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "iop_trio.cli", *args]


class IopCluster(System):
    """An edge and (optionally) one node, as separate processes, from config files in ``workdir``."""

    has_backend = True

    def __init__(
        self,
        name: str,
        workdir: Path,
        core: int | None,
        *,
        models: list[dict[str, Any]] | None,
        adapters: dict[str, Any] | None = None,
        capacity: int = 20000,
        heartbeat_interval: float = 30.0,
        log_level: str = "info",
        extra_certs: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.name = name
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        certs = ["--node", "node", *(arg for cert in extra_certs for arg in ("--node", cert))]
        subprocess.run(iop_command("certs", "init", "certs", *certs), cwd=workdir, check=True, capture_output=True)
        self.edge_config = self._write("edge.yaml", {
            "http": {"listen": "127.0.0.1:0", "graceful_timeout": 5},
            "iop": {"listen": "127.0.0.1:0"},
            "tls": {"enabled": True, "cert": "certs/edge.crt", "key": "certs/edge.key", "ca": "certs/ca.crt"},
            "data_dir": "data/edge",
            "nodes": {"max_concurrency": capacity, "heartbeat_interval": heartbeat_interval},
            "cancel_timeout": 5,
            "log_level": log_level,
        })
        self.edge = Proc(f"{name}-edge", [*pin_prefix(core), *iop_command("edge", "--config", str(self.edge_config))], workdir)
        self.procs.append(self.edge)
        ready = self.edge.wait_ready()
        self.base_url = ready["http"]
        self.iop_address = ready["iop"]
        self.node: Proc | None = None
        if models is not None:
            config = self._write("node.yaml", {
                "node_id": "node",
                "edge": self.iop_address,
                "server_name": "localhost",
                "token": self.create_token("node"),
                "tls": {"enabled": True, "cert": "certs/node.crt", "key": "certs/node.key", "ca": "certs/ca.crt"},
                "data_dir": "data/node",
                "capacity": capacity,
                "models": models,
                "adapters": adapters or {},
                "shutdown_grace": 5,
                "log_level": log_level,
            })
            self.node = Proc(f"{name}-node", [*pin_prefix(core), *iop_command("node", "--config", str(config))], workdir)
            self.procs.append(self.node)
            self.node.wait_ready()
            self.wait_models([m["name"] for m in models])

    def _write(self, name: str, data: dict[str, Any]) -> Path:
        path = self.workdir / name
        path.write_text(yaml.safe_dump(data))
        return path

    def create_token(self, node_id: str | None = None) -> str:
        args = ["tokens", "create", "--config", str(self.edge_config)]
        if node_id:
            args += ["--node", node_id]
        done = subprocess.run(iop_command(*args), cwd=self.workdir, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    def wait_models(self, models: list[str], timeout: float = 20.0) -> None:
        import json

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as reply:
                listed = {m["id"] for m in json.load(reply)["data"]}
            if set(models) <= listed:
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: models {models} never appeared")

    @property
    def edge_pids(self) -> list[int]:
        return [self.edge.pid]

    @property
    def node_pids(self) -> list[int]:
        return [self.node.pid] if self.node else []


def iop_vllm(workdir: Path, core: int | None, backend_url: str) -> IopCluster:
    system = IopCluster(
        "iop-vllm", workdir, core,
        models=[{"name": "bench", "adapter": "vllm"}],
        adapters={"vllm": {"base_url": f"{backend_url}/v1", "max_connections": 256}},
    )
    system.label = "(b) IOP-Trio edge + node, vllm adapter"
    return system


def iop_mock(workdir: Path, core: int | None, hold_seconds: tuple[float, ...] = ()) -> IopCluster:
    """The mock adapter answers like the mock backend (16 tokens, no delay); ``hold-<s>`` models
    stream 16 tokens after ``s`` seconds, for the many-open-streams scenario."""
    models: list[dict[str, Any]] = [{"name": "bench", "adapter": "mock", "options": {"tokens": 16}}]
    for hold in hold_seconds:
        models.append({"name": f"hold-{hold:g}", "adapter": "mock", "options": {"tokens": 16, "ttft": hold, "token_delay": 0.05}})
    system = IopCluster("iop-mock", workdir, core, models=models)
    system.label = "(c) IOP-Trio edge + node, mock adapter"
    system.has_backend = False  # nothing behind it to see a cancellation
    return system


# ---- LiteLLM -------------------------------------------------------------------------------

def ensure_litellm(install: bool) -> tuple[Path | None, str]:
    """The LiteLLM venv's ``litellm`` executable, creating the venv on demand; or why not."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if exe.exists():
        return exe, ""
    if not install:
        return None, f"{LITELLM_VENV} does not exist and installing was not allowed (--no-install)"
    print(f"bench: creating {LITELLM_VENV} with {LITELLM_SPEC} (about a minute, ~750 MB)", file=sys.stderr, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True, capture_output=True, timeout=300)
        done = subprocess.run(
            [str(LITELLM_VENV / "bin" / "pip"), "install", "--quiet", LITELLM_SPEC],
            capture_output=True, text=True, timeout=1200,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"cannot create the LiteLLM venv: {exc}"
    if done.returncode != 0 or not exe.exists():
        errors = [line for line in done.stderr.splitlines() if "ERROR" in line or "error" in line][-3:]
        shutil.rmtree(LITELLM_VENV, ignore_errors=True)
        return None, f"pip install {LITELLM_SPEC} failed: {' | '.join(errors) or done.returncode}"
    return exe, ""


class LiteLLM(System):
    name = "litellm"
    label = "(d) LiteLLM proxy"

    def __init__(self, exe: Path, workdir: Path, core: int | None, backend_url: str) -> None:
        super().__init__()
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "litellm.yaml"
        config.write_text(yaml.safe_dump({
            "model_list": [{
                "model_name": "bench",
                "litellm_params": {"model": "openai/bench", "api_base": f"{backend_url}/v1", "api_key": "sk-unused"},
            }],
            "litellm_settings": {"telemetry": False, "drop_params": True},
            "general_settings": {"master_key": MASTER_KEY},
        }))
        port = free_port()
        env = {
            "LITELLM_MASTER_KEY": MASTER_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no network fetch at start-up
            "LITELLM_LOG": "ERROR",
            "DISABLE_SCHEMA_UPDATE": "True",
        }
        args = [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
        proc = Proc("litellm", [*pin_prefix(core), *args], workdir, env, drop=("DATABASE_URL",))
        self.procs.append(proc)
        self.base_url = f"http://127.0.0.1:{port}"
        self.headers = {"authorization": f"Bearer {MASTER_KEY}"}
        wait_http(f"{self.base_url}/health/liveliness", 180, proc=proc)
