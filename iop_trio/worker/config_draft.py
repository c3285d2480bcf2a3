"""DRAFT: moved to the end of iop_trio/config.py at the end of the work."""

from __future__ import annotations

from attrs import field, frozen, validators


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
    concurrency: int = field(default=16, validator=validators.ge(1))
    #: ``X-IOP-Priority`` of batch lines; interactive requests have 0, higher is served first.
    priority: int = -10
    #: Seconds between looks for new work, cancelled batches and expired completion windows.
    poll_interval: float = field(default=1.0, validator=validators.gt(0))
    #: Seconds a line lease lasts without renewal; renewed every third of it.
    lease_ttl: float = field(default=30.0, validator=validators.gt(0))
    #: Seconds one line's request may take before it is recorded as failed.
    request_timeout: float = field(default=600.0, validator=validators.gt(0))
    #: Backoff between retries of a line the edge answered 429/503 (or could not be reached).
    retry_initial: float = field(default=0.5, validator=validators.gt(0))
    retry_maximum: float = field(default=10.0, validator=validators.gt(0))
    #: On SIGINT/SIGTERM: seconds in-flight lines may finish before they are cancelled.
    shutdown_grace: float = 30.0
    log_level: str = "info"
