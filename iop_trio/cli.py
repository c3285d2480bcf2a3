"""``iop-trio``: the operator interface (see docs/operations.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from .certs import init_certs
from .config import LOG_LEVELS, ConfigError, EdgeConfig, NodeSettings, load_config
from .controlplane import TokenStore
from .node.core import RegistrationRefused
from .roles import Shutdown, print_ready, run_with_signals
from .store import FINAL_STATUSES, RunStore
from .transport import TlsConfigError

log = logging.getLogger("iop_trio")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="iop-trio", description="Inference Operations Platform on Trio")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="edge + mock nodes in one process, mTLS on")
    up.add_argument("--http", default="127.0.0.1:8080", help="HTTP listen address (HOST:PORT)")
    up.add_argument("--nodes", type=int, default=1, help="number of mock nodes")
    up.add_argument("--data-dir", default="iop-data", help="where run history is kept")
    up.add_argument("--log-level", default="info", choices=LOG_LEVELS)

    certs = commands.add_parser("certs", help="development certificates")
    certs_commands = certs.add_subparsers(dest="certs_command", required=True)
    certs_init = certs_commands.add_parser("init", help="write a dev CA, edge and node certificates")
    certs_init.add_argument("dir")
    certs_init.add_argument("--node", action="append", dest="nodes", help="node certificate name (repeatable)")
    certs_init.add_argument("--host", action="append", dest="hosts", help="edge host name or IP (repeatable)")

    tokens = commands.add_parser("tokens", help="registration tokens")
    token_commands = tokens.add_subparsers(dest="tokens_command", required=True)
    create = token_commands.add_parser("create", help="issue a token (printed once)")
    create.add_argument("--config", required=True)
    create.add_argument("--node", help="only this node id may register with the token")
    create.add_argument("--out", help="also write the token to this file (mode 0600)")
    revoke = token_commands.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("--config", required=True)
    revoke.add_argument("token_id")
    listing = token_commands.add_parser("list", help="list tokens (ids only, never secrets)")
    listing.add_argument("--config", required=True)

    for role in ("edge", "node", "worker"):
        role_parser = commands.add_parser(role, help=f"run the {role} role")
        role_parser.add_argument("--config", required=True)

    nodes = commands.add_parser("nodes", help="list the nodes connected to an edge (admin API)")
    nodes.add_argument("--config", help="the edge's config: its HTTP address and admin_key")
    nodes.add_argument("--url", help="the edge's HTTP URL (instead of --config)")
    nodes.add_argument("--admin-key", default=os.environ.get("IOP_ADMIN_KEY", ""), help="or IOP_ADMIN_KEY")

    runs = commands.add_parser("runs", help="show run history")
    runs.add_argument("--db", required=True)
    runs.add_argument("--status", choices=("running", *FINAL_STATUSES))
    runs.add_argument("--limit", type=int, default=20)
    return parser


def _edge(args: argparse.Namespace) -> None:
    from .edge.server import run_edge

    config = load_config(args.config, EdgeConfig)
    _setup_logging(config.log_level)

    async def role(shutdown: Shutdown) -> None:
        async with trio.open_nursery() as nursery:
            addresses = await nursery.start(run_edge, config, shutdown)
            print_ready(**addresses)

    _serve(args.config, role)


def _serve(config_path: str, role: Callable[[Shutdown], Awaitable[None]]) -> None:
    """Run a role until its signals say stop; configuration errors raised while it starts
    (TLS files, addresses, the edge database) name the config file."""
    try:
        trio.run(run_with_signals, role)
    except* (ConfigError, TlsConfigError) as group:
        raise ConfigError("; ".join(_in_file(config_path, exc) for exc in _leaves(group))) from None


def _node(args: argparse.Namespace) -> None:
    from .node.runner import build_node

    settings = load_config(args.config, NodeSettings)
    _setup_logging(settings.log_level)
    try:
        runner = build_node(settings, args.config)
    except (ConfigError, TlsConfigError) as exc:
        raise ConfigError(_in_file(args.config, exc)) from exc

    async def role(shutdown: Shutdown) -> None:
        try:
            async with trio.open_nursery() as nursery:
                edge = await nursery.start(runner.run, shutdown)
                if edge:  # empty: shut down before it ever registered
                    print_ready(node=settings.node_id, edge=edge)
        finally:
            runner.store.close()

    _serve(args.config, role)


def _worker(args: argparse.Namespace) -> None:
    from .config import WorkerConfig
    from .worker import run_worker

    config = load_config(args.config, WorkerConfig)
    _setup_logging(config.log_level)

    async def role(shutdown: Shutdown) -> None:
        async with trio.open_nursery() as nursery:
            print_ready(**await nursery.start(run_worker, config, shutdown))

    _serve(args.config, role)


def _up(args: argparse.Namespace) -> None:
    from .up import run_up

    _setup_logging(args.log_level)
    if args.nodes < 1:
        raise ConfigError("--nodes must be at least 1")

    async def role(shutdown: Shutdown) -> None:
        await run_up(args.http, args.nodes, Path(args.data_dir), shutdown)

    trio.run(run_with_signals, role)


def _tokens(args: argparse.Namespace) -> None:
    store = TokenStore(load_config(args.config, EdgeConfig).database)
    try:
        if args.tokens_command == "create":
            issued = store.create(args.node)
            if args.out:
                fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.fchmod(fd, 0o600)  # O_CREAT's mode only applies to a new file
                with os.fdopen(fd, "w") as handle:
                    handle.write(issued.token + "\n")
            print(issued.token)
            print(f"token id {issued.token_id} (revoke with: iop-trio tokens revoke --config {args.config} {issued.token_id})", file=sys.stderr)
        elif args.tokens_command == "revoke":
            if not store.revoke(args.token_id):
                raise ConfigError(f"no active token with id {args.token_id!r}")
            print(f"revoked {args.token_id}")
        else:
            for row in store.list():
                state = "revoked" if row["revoked_at"] else "active"
                print(f"{row['token_id']}  {state:8}  node={row['node_id'] or '*'}  created={_when(row['created_at'])}")
    finally:
        store.close()


def _runs(args: argparse.Namespace) -> None:
    if not Path(args.db).is_file():
        raise ConfigError(f"--db: no such database: {args.db}")
    store = RunStore(args.db, owner=False)
    try:
        rows = store.list_runs(args.status, args.limit)
    finally:
        store.close()
    columns = ("run_id", "node_id", "model", "status", "started", "ttft_ms", "prompt", "completion", "error")
    print("  ".join(columns))
    for row in rows:
        ttft = "-" if row["ttft_ms"] is None else f"{row['ttft_ms']:.1f}"
        print(
            "  ".join(
                str(value)
                for value in (
                    row["run_id"], row["node_id"], row["model"], row["status"], _when(row["started_at"]),
                    ttft, row["prompt_tokens"], row["completion_tokens"], row["error"] or "",
                )
            )
        )


def _nodes(args: argparse.Namespace) -> None:
    import httpx

    url, admin_key = args.url, args.admin_key
    if args.config:
        config = load_config(args.config, EdgeConfig)
        url = url or f"http://{config.http.listen}"
        admin_key = admin_key or config.admin_key
    if not url:
        raise ConfigError("nodes: give --config or --url")
    try:
        response = httpx.get(f"{url.rstrip('/')}/admin/nodes", headers={"Authorization": f"Bearer {admin_key}"})
    except httpx.TransportError as exc:
        raise ConfigError(f"nodes: cannot reach the edge at {url}: {exc}") from exc
    if response.status_code != 200:
        raise ConfigError(f"nodes: {response.status_code}: {response.json()['error']['message']}")
    columns = ("node_id", "state", "outstanding", "max_concurrency", "heartbeat_age_s", "models", "labels", "queued")
    print("  ".join(columns))
    for node in response.json()["data"]:
        labels = ",".join(f"{k}={v}" for k, v in node["labels"].items()) or "-"
        queued = ",".join(f"{m}={n}" for m, n in node["queued"].items()) or "-"
        print(
            f"{node['node_id']}  {node['state']}  {node['outstanding']}  {node['max_concurrency']}  "
            f"{node['last_heartbeat_age_s']}  {','.join(node['models'])}  {labels}  {queued}"
        )


def _certs(args: argparse.Namespace) -> None:
    kwargs = {"hosts": args.hosts} if args.hosts else {}
    for path in init_certs(args.dir, nodes=args.nodes or ["node"], **kwargs):
        print(path)


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))


def _setup_logging(level: str) -> None:
    from .logging import setup_logging

    setup_logging(level)


COMMANDS = {
    "up": _up,
    "edge": _edge,
    "node": _node,
    "worker": _worker,
    "tokens": _tokens,
    "runs": _runs,
    "certs": _certs,
    "nodes": _nodes,
}


def _in_file(path: str, exc: BaseException) -> str:
    text = str(exc)
    return text if text.startswith(str(path)) else f"{path}: {text}"


def _leaves(group: BaseException) -> list[BaseException]:
    """The exceptions inside ``group``, however deeply the nurseries nested them."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for exc in group.exceptions for leaf in _leaves(exc)]
    return [group]


def _report(group: BaseExceptionGroup[Exception]) -> None:
    """Print each operator-facing error once."""
    seen = set()
    for exc in _leaves(group):
        if str(exc) not in seen:
            seen.add(str(exc))
            print(f"iop-trio: error: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    code = 0
    try:
        COMMANDS[args.command](args)
    except* (ConfigError, TlsConfigError) as group:
        _report(group)
        code = 2
    except* KeyboardInterrupt:
        code = 130
    except* RegistrationRefused as group:
        _report(group)
        code = 1
    except* OSError as group:  # e.g. an address already in use
        _report(group)
        code = 1
    return code


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
