"""Role configuration: YAML files structured strictly into attrs classes.

Every key has a safe default where one exists; an unknown key or a wrong type is a
:class:`ConfigError` that names the file and the key path (``edge.yaml: extra fields found
(colour) @ $.tls``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import cattrs
import yaml
from attrs import define, field, frozen
from attrs.validators import ge, gt, in_, min_len

from .transport.tls import TlsConfig
from .wire.converter import describe_error, make_strict_converter
from .wire.framing import DEFAULT_MAX_FRAME_SIZE

T = TypeVar("T")


LOG_LEVELS = ("debug", "info", "warning", "error")


def _lower(value: str) -> str:
    return value.lower()


class ConfigError(ValueError):
    """A config file is missing, not YAML, or does not match its schema."""


@frozen
class HttpConfig:
    listen: str = "127.0.0.1:8080"
    #: Largest accepted request body, in bytes (below the IOP frame limit, which must carry it).
    max_body_size: int = field(default=8 * 1024 * 1024, validator=gt(0))
    #: Seconds in-flight HTTP requests get to finish on shutdown.
    graceful_timeout: float = 30.0


@frozen
class IopListenConfig:
    listen: str = "127.0.0.1:7070"
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    handshake_timeout: float = 10.0
    register_timeout: float = 10.0


@frozen
class NodeOverride:
    """A ``max_concurrency`` for the nodes this entry matches: by ``node_id``, or by carrying all
    of ``labels``. The first matching entry wins; a node's own ``capacity`` still caps it."""

    max_concurrency: int = field(validator=gt(0))
    node_id: str = ""
    labels: dict[str, str] = field(factory=dict)


@frozen
class NodeDefaults:
    """Centrally managed node settings, sent to every node in ``register.response``."""

    max_concurrency: int = field(default=64, validator=gt(0))
    heartbeat_interval: float = field(default=30.0, validator=gt(0))
    overrides: tuple[NodeOverride, ...] = ()


@frozen
class QueueConfig:
    """Backpressure: when every candidate node is full, requests wait here, per model."""

    #: Requests waiting per model beyond which new ones get 429 at once.
    max_waiting: int = field(default=256, validator=ge(0))
    #: Seconds a request may wait for a free node before it gets 429.
    timeout: float = field(default=30.0, validator=ge(0))


@frozen
class ModelPolicy:
    """Placement: only nodes carrying all of ``node_labels`` serve this model."""

    node_labels: dict[str, str] = field(factory=dict)


@frozen
class ApiKeyConfig:
    """An API key: which models it may use, its rate limits (0 = unlimited) and its priority.
    In YAML a plain string is a key with no limits."""

    key: str = field(validator=min_len(1))
    name: str = ""
    models: tuple[str, ...] = ()
    requests_per_minute: int = field(default=0, validator=ge(0))
    tokens_per_minute: int = field(default=0, validator=ge(0))
    priority: int = 0


@frozen
class RetryConfig:
    """Transparent retries of a run whose node failed before its first token."""

    max_attempts: int = field(default=3, validator=gt(0))


@frozen
class EdgeConfig:
    http: HttpConfig = HttpConfig()
    iop: IopListenConfig = IopListenConfig()
    tls: TlsConfig = TlsConfig(cert="certs/edge.crt", key="certs/edge.key", ca="certs/ca.crt")
    data_dir: str = "iop-data/edge"
    #: Bearer keys accepted by the HTTP API; empty means no authentication.
    api_keys: tuple[ApiKeyConfig, ...] = ()
    #: Bearer key for the admin API (``/admin/...``); empty disables it.
    admin_key: str = ""
    nodes: NodeDefaults = NodeDefaults()
    queue: QueueConfig = QueueConfig()
    models: dict[str, ModelPolicy] = field(factory=dict)
    retry: RetryConfig = RetryConfig()
    #: Budget for telling a node to cancel a run whose client went away.
    cancel_timeout: float = 5.0
    #: Default deadline for a run, in seconds (0 = none).
    run_deadline: float = 600.0
    log_level: str = field(default="info", converter=_lower, validator=in_(LOG_LEVELS))

    @property
    def database(self) -> Path:
        return Path(self.data_dir) / "edge.db"


@frozen
class ModelConfig:
    """A model this node serves: the client-facing ``name``, the adapter that runs it, the name
    the backend knows it by (defaults to ``name``) and adapter-specific ``options``."""

    name: str
    adapter: str
    backend_model: str = ""
    options: dict[str, Any] = field(factory=dict)


@frozen
class ReconnectConfig:
    initial: float = 0.5
    maximum: float = 30.0


@define
class NodeSettings:
    node_id: str = "node"
    #: host:port of the edge's IOP listener.
    edge: str = "127.0.0.1:7070"
    #: Expected name in the edge's certificate; defaults to the host part of ``edge``.
    server_name: str = ""
    token: str = ""
    token_file: str = ""
    tls: TlsConfig = TlsConfig(cert="certs/node.crt", key="certs/node.key", ca="certs/ca.crt")
    data_dir: str = "iop-data/node"
    capacity: int = 16
    labels: dict[str, str] = field(factory=dict)
    models: tuple[ModelConfig, ...] = ()
    adapters: dict[str, dict[str, Any]] = field(factory=dict)
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    handshake_timeout: float = 10.0
    register_timeout: float = 10.0
    reconnect: ReconnectConfig = ReconnectConfig()
    #: Seconds in-flight runs get to finish after SIGTERM before they are cancelled.
    shutdown_grace: float = 30.0
    log_level: str = field(default="info", converter=_lower, validator=in_(LOG_LEVELS))

    @property
    def database(self) -> Path:
        return Path(self.data_dir) / "runs.db"

    def resolve_token(self) -> str:
        if self.token:
            return self.token
        if self.token_file:
            try:
                return Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"token_file: cannot read {self.token_file}: {exc}") from exc
        raise ConfigError("node config needs 'token' or 'token_file'")


_converter = make_strict_converter()
_structure_api_key = _converter.get_structure_hook(ApiKeyConfig)
_converter.register_structure_hook(
    ApiKeyConfig,
    lambda value, cls: ApiKeyConfig(key=value) if isinstance(value, str) else _structure_api_key(value, cls),
)


def structure(data: Any, cls: type[T], source: str) -> T:
    """Structure plain data into ``cls``; errors name ``source`` and the key path."""
    try:
        return _converter.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{source}: {describe_error(exc)}") from exc


def load_config(path: str | Path, cls: type[T]) -> T:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return structure(data, cls, str(path))


def parse_host_port(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{what}: expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


@frozen
class WorkerConfig:
    """``iop-trio worker``: runs Batch API jobs through the edge, sharing the edge's store."""

    #: The edge's HTTP API; every batch line is sent there like any client request.
    edge_url: str = "http://127.0.0.1:8080"
    #: Bearer key for the edge's API (one of its ``api_keys``); empty = send none.
    api_key: str = ""
    #: The edge's ``data_dir``: the worker shares its ``edge.db`` and ``files/``.
    data_dir: str = "iop-data/edge"
    #: Lines in flight at once, across all batches.
    concurrency: int = field(default=16, validator=ge(1))
    #: ``X-IOP-Priority`` of batch lines; interactive requests have 0 and higher is served first.
    priority: int = -10
    #: Seconds between looks for new work, cancelled batches and expired completion windows.
    poll_interval: float = field(default=1.0, validator=gt(0))
    #: Seconds a line's lease lasts without renewal; renewed every third of it.
    lease_ttl: float = field(default=30.0, validator=gt(0))
    #: Seconds one line's request may take before the line is recorded as failed.
    request_timeout: float = field(default=600.0, validator=gt(0))
    #: Backoff between retries of a line the edge answered 429/503 or could not be reached for.
    retry_initial: float = field(default=0.5, validator=gt(0))
    retry_maximum: float = field(default=10.0, validator=gt(0))
    #: On SIGINT/SIGTERM: seconds in-flight lines may finish before they are cancelled.
    shutdown_grace: float = field(default=30.0, validator=ge(0))
    log_level: str = field(default="info", converter=_lower, validator=in_(LOG_LEVELS))
