"""The bench's scenarios. Each takes running systems and returns plain data for the report.

* throughput: non-streaming and streaming (16 tokens) at fixed concurrency, systems measured
  alternately (round-robin, the order rotated each round) so drift on a shared machine hits
  every system alike; the round with the median requests/s is reported.
* cancellation: per phase, the time from the client closing its connection to the backend
  seeing its own connection close (both clocks CLOCK_MONOTONIC on one host).
* many streams: N slow streams open at once on one edge; RSS per stream and that all complete.
* many nodes: N simulated nodes registered and heartbeating to one edge; edge CPU at rest and
  the cost of a scheduling decision (the edge's own ``iop_schedule_wait_seconds``, and the
  added latency and CPU per request).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import profiling
from loadgen import Target, disconnect_probe, hold_streams, run_load
from procstat import Meter, cpu_seconds, rss_bytes, tree_pids
from systems import BENCH, IopCluster, Proc, System, pin_prefix

TOKENS = 16
CHAT = "/v1/chat/completions"


def chat_body(stream: bool, content: str = "hello", model: str = "bench") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ---- throughput ----------------------------------------------------------------------------

def throughput(systems: list[System], kind: str, concurrency: int, *, rounds: int, duration: float, warmup: float) -> dict[str, Any]:
    stream = kind == "stream"
    per_system: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    for round_index in range(rounds):
        order = systems[round_index % len(systems) :] + systems[: round_index % len(systems)]
        for system in order:
            target = Target(system.base_url + CHAT, chat_body(stream), system.headers)
            result = asyncio.run(
                run_load(target, concurrency=concurrency, duration=duration, warmup=warmup, sut_pids=system.pids,
                         expect_tokens=TOKENS if stream else None)
            )
            per_system[system.name].append(result)
            print(f"  {kind:9} c={concurrency:<3} {system.name:9} round {round_index + 1}: "
                  f"{result['rps']:>8} req/s p50 {result['latency_ms']['p50']} ms errors {result['errors']}", flush=True)
    out = {}
    for name, results in per_system.items():
        ordered = sorted(results, key=lambda r: r["rps"])
        chosen = dict(ordered[len(ordered) // 2])
        chosen["rounds_rps"] = [r["rps"] for r in results]
        chosen["errors"] = sum(r["errors"] for r in results)
        out[name] = chosen
    return out


# ---- cancellation --------------------------------------------------------------------------

PHASES = ("queued", "before_first_token", "mid_stream", "non_stream")


def _probe_content(phase: str, tag: str) -> tuple[str, bool, dict[str, float]]:
    """Prompt directives for the backend, whether to stream, and when the client leaves."""
    if phase == "queued":
        return f"bench:tag={tag} bench:pool={tag} bench:slots=1 bench:tokens=4", True, {"after": 0.3}
    if phase == "before_first_token":
        return f"bench:tag={tag} bench:ttft=3 bench:tokens=4", True, {"after": 0.3}
    if phase == "mid_stream":
        return f"bench:tag={tag} bench:tokens=400 bench:delay=0.02", True, {"after_tokens": 3}
    return f"bench:tag={tag} bench:tokens=100 bench:delay=0.02", False, {"after": 0.3}


def _backend_stats(backend_url: str, tag: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{backend_url}/_stats?tag={tag}", timeout=5) as reply:
        return json.load(reply)


async def _one_probe(system: System, backend_url: str, phase: str, wait: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:12]
    content, stream, when = _probe_content(phase, tag)
    blocker = None
    if phase == "queued":
        # Holds the pool's only slot for 2 s, so the probe waits in the backend's queue.
        block = Target(system.base_url + CHAT, chat_body(True, f"bench:tag={tag}-blocker bench:pool={tag} bench:slots=1 bench:ttft=2 bench:tokens=1"), system.headers)
        blocker = asyncio.ensure_future(disconnect_probe(block, after=5.0))
        await asyncio.sleep(0.2)
    target = Target(system.base_url + CHAT, chat_body(stream, content), system.headers)
    probe = await disconnect_probe(target, **when)
    if "error" in probe:
        return {"error": probe["error"]}
    deadline = time.monotonic() + wait
    seen: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        records = _backend_stats(backend_url, tag)["disconnects"]
        if records:
            seen = records[0]
            break
        await asyncio.sleep(0.01)
    if blocker is not None:
        blocker.cancel()
    if seen is None:
        return {"lag_ms": None, "seen_phase": None}
    return {"lag_ms": round((seen["t"] - probe["t_close"]) * 1000, 2), "seen_phase": seen["phase"]}


def cancellation(systems: list[System], backend_url: str, phase: str, *, repeats: int, wait: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system in systems:
        if not system.has_backend:
            continue
        probes = [asyncio.run(_one_probe(system, backend_url, phase, wait)) for _ in range(repeats)]
        lags = [p["lag_ms"] for p in probes if p.get("lag_ms") is not None]
        errors = sorted({p["error"] for p in probes if "error" in p})
        unseen = sum(1 for p in probes if "error" not in p and p["lag_ms"] is None)
        out[system.name] = {
            "probes": repeats,
            "lag_ms_median": round(statistics.median(lags), 2) if lags else None,
            "lag_ms_max": max(lags) if lags else None,
            "never_seen": unseen,
            "never_seen_wait_s": wait,
            "errors": errors,
            "backend_phases": sorted({p["seen_phase"] for p in probes if p.get("seen_phase")}),
        }
        shown = out[system.name]
        print(f"  cancel {phase:18} {system.name:9} median {shown['lag_ms_median']} ms max {shown['lag_ms_max']} "
              f"never {unseen}/{repeats} {errors[:1]}", flush=True)
    return out


# ---- many open streams ---------------------------------------------------------------------

def many_streams(system: IopCluster, n: int, hold: float) -> dict[str, Any]:
    """``n`` streams of model ``hold-<hold>``: all open together, then 16 tokens each."""
    edge, node = system.edge_pids, system.node_pids
    rss_idle = {"edge": rss_bytes(edge), "node": rss_bytes(node)}
    cpu_start = cpu_seconds(tree_pids(system.pids))
    at_open: dict[str, int] = {}
    meter = Meter(edge)
    meter.start()

    async def when_all_open() -> None:
        await asyncio.sleep(0.5)  # let the last requests' first chunks settle
        at_open["edge"] = rss_bytes(edge)
        at_open["node"] = rss_bytes(node)

    async def run() -> dict[str, Any]:
        async def sampler() -> None:
            while True:
                meter.sample()
                await asyncio.sleep(0.25)

        sampling = asyncio.ensure_future(sampler())
        target = Target(system.base_url + CHAT, chat_body(True, model=f"hold-{hold:g}"), system.headers)
        try:
            return await hold_streams(target, n, give_up_after=hold + 60 + n / 50, on_all_open=when_all_open)
        finally:
            sampling.cancel()

    result = asyncio.run(run())
    meter.stop()
    result["hold_s"] = hold
    result["edge_rss_idle_mb"] = round(rss_idle["edge"] / 2**20, 1)
    result["edge_rss_peak_mb"] = round(meter.peak_rss / 2**20, 1)
    if at_open:
        result["edge_rss_open_mb"] = round(at_open["edge"] / 2**20, 1)
        result["node_rss_open_mb"] = round(at_open["node"] / 2**20, 1)
        result["edge_kib_per_stream"] = round((at_open["edge"] - rss_idle["edge"]) / n / 1024, 1)
        result["node_kib_per_stream"] = round((at_open["node"] - rss_idle["node"]) / n / 1024, 1)
    result["edge_kib_per_stream_peak"] = round((meter.peak_rss - rss_idle["edge"]) / n / 1024, 1)
    result["sut_cpu_s"] = round(cpu_seconds(tree_pids(system.pids)) - cpu_start, 2)
    print(f"  streams {n:>6}: opened {result['opened']} completed {result['completed']} failed {result['failed']} "
          f"edge {result.get('edge_kib_per_stream')} KiB/stream (peak {result['edge_kib_per_stream_peak']})", flush=True)
    return result


# ---- many nodes ----------------------------------------------------------------------------

def _start_sims(cluster: IopCluster, count: int, token: str, core: int | None) -> tuple[Proc, float]:
    certs = cluster.workdir / "certs"
    args = [*pin_prefix(core), sys.executable, str(BENCH / "sim_nodes.py"), "--edge", cluster.iop_address, "--token", token,
            "--cert", str(certs / "sim.crt"), "--key", str(certs / "sim.key"), "--ca", str(certs / "ca.crt"), "--count", str(count)]
    proc = Proc(f"sim-nodes-{count}", args, cluster.workdir)
    ready = proc.wait_ready(timeout=120 + count / 5)
    return proc, float(ready["register_s"])


def _stop_sims(proc: Proc) -> dict[str, int]:
    proc.popen.send_signal(2)
    try:
        out, _ = proc.popen.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.popen.kill()
        out, _ = proc.popen.communicate()
    proc.stop()
    for line in (out or "").splitlines():
        if line.startswith("served: "):
            return json.loads(line[len("served: ") :])
    return {}


def _wait_nodes(cluster: IopCluster, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{cluster.base_url}/healthz", timeout=5) as reply:
            if json.load(reply).get("nodes") == count:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{count} nodes never showed in /healthz")


def many_nodes(workdir: Path, count: int, *, sut_core: int | None, load_core: int | None, rest: float, duration: float, heartbeat: float) -> dict[str, Any]:
    """Compare one simulated node with ``count`` of them on the same edge: registration time,
    edge RSS and CPU at rest (heartbeats only), and request latency / edge CPU per request."""
    cluster = IopCluster("nodes", workdir, sut_core, models=None, heartbeat_interval=heartbeat, extra_certs=("sim",))
    token = cluster.create_token()
    out: dict[str, Any] = {"nodes": count, "heartbeat_interval_s": heartbeat}
    try:
        for label, n in (("one", 1), ("many", count)):
            rss_before = rss_bytes(cluster.edge_pids)
            sims, register_s = _start_sims(cluster, n, token, load_core)
            try:
                _wait_nodes(cluster, n)
                time.sleep(min(2.0, rest))
                cpu0 = cpu_seconds(cluster.edge_pids)
                time.sleep(rest)
                rest_cpu = cpu_seconds(cluster.edge_pids) - cpu0
                rss = rss_bytes(cluster.edge_pids)
                target = Target(cluster.base_url + CHAT, chat_body(False))
                c1 = asyncio.run(run_load(target, concurrency=1, duration=duration, warmup=min(1.0, duration / 2), sut_pids=cluster.edge_pids))
                raw = workdir / f"edge-{n}-nodes.raw"
                spy = profiling.start(cluster.edge_pids[0], duration, raw, load_core)
                waited_before = _schedule_wait(cluster)
                c16 = asyncio.run(run_load(target, concurrency=16, duration=duration, warmup=min(1.0, duration / 2), sut_pids=cluster.edge_pids))
                waited_after = _schedule_wait(cluster)
                edge_profile = _finish_profile(spy, raw)
            finally:
                served = _stop_sims(sims)
            _wait_nodes(cluster, 0)
            out[label] = {
                "nodes": n,
                "register_s": register_s,
                "edge_rss_mb": round(rss / 2**20, 1),
                "edge_kib_per_node": round((rss - rss_before) / n / 1024, 1),
                "edge_rest_cpu_pct": round(100 * rest_cpu / rest, 2),
                "c1_p50_ms": c1["latency_ms"]["p50"],
                "c1_rps": c1["rps"],
                "c16_rps": c16["rps"],
                "edge_cpu_per_request_ms": c16["sut_cpu_per_request_ms"],
                "decision_us": _mean_us(waited_before, waited_after),
                "errors": c1["errors"] + c16["errors"],
                "error_samples": (c1["error_samples"] + c16["error_samples"])[:2],
                "nodes_that_served": len(served),
                "edge_profile_c16": edge_profile,
            }
            print(f"  nodes {n:>5}: registered in {register_s:.2f}s, edge at rest {out[label]['edge_rest_cpu_pct']}% CPU, "
                  f"c=1 p50 {c1['latency_ms']['p50']} ms, {out[label]['edge_cpu_per_request_ms']} ms CPU/request", flush=True)
    finally:
        cluster.stop()
    one, many = out["one"], out["many"]
    if one["c1_p50_ms"] is not None and many["c1_p50_ms"] is not None:
        out["scheduling_added_p50_ms"] = round(many["c1_p50_ms"] - one["c1_p50_ms"], 3)
    if one["edge_cpu_per_request_ms"] and many["edge_cpu_per_request_ms"]:
        out["scheduling_added_cpu_ms"] = round(many["edge_cpu_per_request_ms"] - one["edge_cpu_per_request_ms"], 3)
    return out


def _schedule_wait(cluster: IopCluster) -> tuple[float, float]:
    """The edge's ``iop_schedule_wait_seconds`` histogram: (sum, count) so far."""
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("iop_schedule_wait_seconds_sum", "iop_schedule_wait_seconds_count"):
            values[name] = float(value)
    return values.get("iop_schedule_wait_seconds_sum", 0.0), values.get("iop_schedule_wait_seconds_count", 0.0)


def _mean_us(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    count = after[1] - before[1]
    return round(1e6 * (after[0] - before[0]) / count, 1) if count else None


# ---- profiles ------------------------------------------------------------------------------

def _finish_profile(spy: subprocess.Popen[bytes] | None, raw: Path) -> dict[str, Any]:
    if spy is None:
        return {"skipped": "py-spy not installed"}
    _, err = spy.communicate(timeout=120)
    if spy.returncode != 0 or not raw.exists():
        return {"error": (err or b"").decode(errors="replace")[-300:]}
    return profiling.summarise(raw)


def profile(system: IopCluster, kind: str, concurrency: int, seconds: float, out_dir: Path, load_core: int | None) -> dict[str, Any]:
    """py-spy on the edge and the node while ``kind`` load runs at ``concurrency``."""
    if not profiling.available():
        return {"skipped": "py-spy not installed (pip install py-spy)"}
    out_dir.mkdir(parents=True, exist_ok=True)
    raws = {role: out_dir / f"{system.name}-{kind}-c{concurrency}-{role}.raw" for role in ("edge", "node")}
    pids = {"edge": system.edge_pids[0], "node": system.node_pids[0]}
    spies = {role: profiling.start(pids[role], seconds, raws[role], load_core) for role in raws}
    target = Target(system.base_url + CHAT, chat_body(kind == "stream"), system.headers)
    load = asyncio.run(run_load(target, concurrency=concurrency, duration=seconds, warmup=0.5, sut_pids=system.pids))
    result: dict[str, Any] = {"rps_while_profiled": load["rps"]}
    for role, spy in spies.items():
        result[role] = _finish_profile(spy, raws[role])
    return result
