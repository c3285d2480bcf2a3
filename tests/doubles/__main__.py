"""Run a backend double as a process: ``python -m tests.doubles openai --tokens 8 ...``.

Prints ``ready: url=<base url>`` once it serves (the OpenAI double's base url ends in ``/v1``).
"""

from __future__ import annotations

import argparse
from functools import partial

import trio

from .backends import Behaviour, Recorder, ollama_app, openai_app, serve_double


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("openai", "ollama"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--queue-delay", type=float, default=0.0)
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--model", action="append", dest="models")
    args = parser.parse_args()
    behaviour = Behaviour(
        tokens=args.tokens, queue_delay=args.queue_delay, ttft=args.ttft, token_delay=args.token_delay,
        models=tuple(args.models or ["double-model"]),
    )
    app = (openai_app if args.kind == "openai" else ollama_app)(behaviour, Recorder())

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_double, app, port=args.port))
            print(f"ready: url={url}{'/v1' if args.kind == 'openai' else ''}", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
