"""The worker: finds batch work in the shared store, runs it through the edge, records results.

Nursery tree of one worker process::

    Worker.run
    ├── keep_leases             every lease_ttl/3: renew this worker's line leases; a line whose
    │                           lease another worker took over is cancelled
    └── jobs
        ├── claim loop          every poll_interval (or when a batch run ends): expire overdue
        │                       batches, stop cancelled ones, start jobs for the rest
        ├── validate <batch>    validating -> in_progress, or failed with errors
        ├── finalize <batch>    a frozen batch -> output and error files, final status
        └── run <batch>         the batch's cancel scope: claims one line per free slot
            └── line <n>        one request through the edge; at most `concurrency` lines at once,
                                across all batches (one CapacityLimiter)

Several workers may share a store: a line is only run under a lease (see store/batches.py), and
validation and finalization are guarded transitions that are safe to repeat. Cancelling a batch's
scope closes its in-flight HTTP requests, which makes the edge cancel the runs on their nodes.

Shutdown: stop claiming, let in-flight lines finish within ``shutdown_grace``, cancel the rest and
give their leases back so a restarted worker picks them up at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import attrs
import trio

from ..config import WorkerConfig
from ..store.batches import BatchStore, ClaimedLine, Ending, NewLine, OpenBatch
from .edge_client import EdgeUnavailable
from .results import LineFailure, LineResponse, finalize, render
from .validate import InputError, validate_input

log = logging.getLogger("iop_trio.worker")

#: Budget for giving a lease back when a line ends without a result (shielded).
RELEASE_BUDGET = 2.0


class Edge(Protocol):
    """What the worker needs from the edge (:class:`~iop_trio.worker.edge_client.EdgeClient`)."""

    async def models(self) -> frozenset[str]: ...

    async def execute(self, endpoint: str, body: dict[str, Any]) -> LineResponse | LineFailure: ...


@attrs.frozen
class Job:
    kind: Literal["validate", "run", "finalize"]
    scope: trio.CancelScope


def default_owner() -> str:
    """Unique per process: leases are never shared by two processes, even on one host."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Worker:
    def __init__(
        self,
        store: BatchStore,
        edge: Edge,
        config: WorkerConfig,
        *,
        clock: Callable[[], float] = time.time,
        owner: str | None = None,
    ) -> None:
        self.store = store
        self.edge = edge
        self.config = config
        #: Wall-clock seconds for leases, expiry and timestamps; MockClock tests pass trio.current_time.
        self.clock = clock
        self.owner = owner or default_owner()
        self.limiter = trio.CapacityLimiter(config.concurrency)
        #: batch id -> the job this worker runs for it (at most one).
        self.jobs: dict[str, Job] = {}
        #: lease id -> the cancel scope of the line running under it.
        self.leases: dict[str, trio.CancelScope] = {}
        self.draining = False
        self._wake = trio.Event()

    async def run(
        self, shutdown: Callable[[], Awaitable[None]], task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Work until ``shutdown`` returns, then drain. Reports the worker's lease owner id."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_leases)
            async with trio.open_nursery() as jobs:
                claiming = trio.CancelScope()
                jobs.start_soon(self._claim_loop, jobs, claiming)
                task_status.started(self.owner)
                await shutdown()
                log.info("worker draining", extra={"lines_in_flight": len(self.leases), "grace_s": self.config.shutdown_grace})
                self.draining = True
                claiming.cancel()
                # The jobs nursery waits for in-flight lines, but no longer than the grace period.
                jobs.cancel_scope.deadline = trio.current_time() + self.config.shutdown_grace
            nursery.cancel_scope.cancel()

    async def _claim_loop(self, jobs: trio.Nursery, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                try:
                    await self.poll(jobs)
                except sqlite3.OperationalError as exc:  # the database stayed locked: look again later
                    log.warning("poll failed", extra={"error": str(exc)})
                with trio.move_on_after(self.config.poll_interval):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def poll(self, jobs: trio.Nursery) -> None:
        """One look at every open batch: what needs doing here, and what must stop."""
        now = self.clock()
        for batch in await self.store.open_batches(now):
            if batch.ending is None and batch.expires_at <= now and await self.store.expire_batch(batch.id, now):
                log.info("batch expired", extra={"batch_id": batch.id, "pending": batch.pending})
                batch = attrs.evolve(batch, ending="expired")
            job = self.jobs.get(batch.id)
            if job is not None:
                if job.kind == "run" and (batch.ending is not None or batch.status != "in_progress"):
                    log.info("stopping batch", extra={"batch_id": batch.id, "status": batch.status, "ending": batch.ending})
                    job.scope.cancel()
            elif batch.ending is not None:
                self._start(jobs, "finalize", batch.id, self._finalize, batch.id, batch.ending)
            elif batch.status == "validating":
                self._start(jobs, "validate", batch.id, self._validate, batch)
            elif batch.status == "in_progress" and batch.pending == 0:
                self._start(jobs, "finalize", batch.id, self._complete, batch.id)
            elif batch.status == "in_progress" and batch.claimable:
                self._start(jobs, "run", batch.id, self._run_batch, batch.id, batch.endpoint)

    def _start(
        self, jobs: trio.Nursery, kind: Literal["validate", "run", "finalize"], batch_id: str,
        fn: Callable[..., Awaitable[None]], *args: Any,
    ) -> None:
        job = Job(kind, trio.CancelScope())
        self.jobs[batch_id] = job
        jobs.start_soon(self._job, batch_id, job, fn, *args, name=f"{kind} {batch_id}")

    async def _job(self, batch_id: str, job: Job, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """One batch's job. A failure is logged and the job is tried again at a later poll: one
        bad batch must not stop the others."""
        try:
            with job.scope:
                await fn(*args)
        except* Exception:
            log.exception("batch job failed", extra={"batch_id": batch_id, "job": job.kind})
        finally:
            del self.jobs[batch_id]

    async def _validate(self, batch: OpenBatch) -> None:
        content = await self.store.read_file(batch.input_file_id)
        lines: list[NewLine] = []
        if content is None:
            errors = [InputError("invalid_file", f"The input file {batch.input_file_id} no longer exists.")]
        else:
            try:
                models = await self.edge.models()
            except EdgeUnavailable as exc:
                log.warning("cannot validate batch yet", extra={"batch_id": batch.id, "error": str(exc)})
                return
            lines, errors = validate_input(content, batch.endpoint, models)
        if errors:
            if await self.store.fail_batch(batch.id, [error.to_api() for error in errors], self.clock()):
                log.info("batch failed validation", extra={"batch_id": batch.id, "errors": len(errors)})
        elif await self.store.begin_batch(batch.id, lines, self.clock()):
            log.info("batch in progress", extra={"batch_id": batch.id, "lines": len(lines)})

    async def _run_batch(self, batch_id: str, endpoint: str) -> None:
        """Claim lines while slots are free and lines are claimable; then wait for those in flight."""
        try:
            async with trio.open_nursery() as lines:
                while True:
                    slot = object()
                    await self.limiter.acquire_on_behalf_of(slot)
                    line = None
                    try:
                        if not self.draining:
                            line = await self.store.claim_line(batch_id, self.owner, self.clock(), self.config.lease_ttl)
                    finally:
                        if line is None:
                            self.limiter.release_on_behalf_of(slot)
                    if line is None:
                        break
                    lines.start_soon(self._run_line, endpoint, line, slot, name=f"line {batch_id}:{line.line_no}")
        finally:
            self._wake.set()  # maybe every line is done now: finalize without waiting for a poll

    async def _run_line(self, endpoint: str, line: ClaimedLine, slot: object) -> None:
        committed = False
        try:
            with trio.CancelScope() as scope:
                self.leases[line.lease_id] = scope
                outcome = await self.edge.execute(endpoint, line.body)
                # From here the store decides: a lost lease or a stopped batch makes it a no-op.
                del self.leases[line.lease_id]
                result, ok = render(line.batch_id, line.line_no, line.custom_id, outcome)
                with trio.CancelScope(shield=True):  # the answer is in hand: never throw it away
                    committed = await self.store.complete_line(line, result, ok, self.clock())
                if not committed:
                    log.info("line result dropped: lease lost or batch stopped", extra={"batch_id": line.batch_id, "line": line.line_no})
        finally:
            self.leases.pop(line.lease_id, None)
            self.limiter.release_on_behalf_of(slot)
            if not committed:
                with trio.move_on_after(RELEASE_BUDGET, shield=True):
                    await self.store.release_leases([line.lease_id])

    async def _keep_leases(self) -> None:
        while True:
            await trio.sleep(self.config.lease_ttl / 3)
            running = set(self.leases)
            try:
                held = await self.store.renew_leases(self.owner, self.clock(), self.config.lease_ttl)
            except sqlite3.OperationalError as exc:
                # Safe to skip: a lease that expires meanwhile is found lost at the next renewal.
                log.warning("lease renewal failed", extra={"error": str(exc)})
                continue
            for lease_id in running - held:
                scope = self.leases.get(lease_id)
                if scope is not None:
                    log.warning("lease taken over by another worker; line cancelled", extra={"lease_id": lease_id})
                    scope.cancel()

    async def _complete(self, batch_id: str) -> None:
        if await self.store.begin_finalizing(batch_id, self.clock()):
            await finalize(self.store, batch_id, "completed", self.clock())

    async def _finalize(self, batch_id: str, ending: Ending) -> None:
        await finalize(self.store, batch_id, ending, self.clock())
