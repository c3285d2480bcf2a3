"""Results: ``results.json`` (everything), ``results.md`` (tables + targets) and ``chart.png``.

``results.md`` ends with the hand-written analysis kept in ``findings.md`` beside it, if any, so a
re-run refreshes the numbers without losing the explanation of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SYSTEM_ORDER = ("direct", "iop-vllm", "iop-mock", "litellm", "hypercorn")
LABELS = {
    "direct": "(a) backend directly",
    "iop-vllm": "(b) IOP-Trio, vllm adapter",
    "iop-mock": "(c) IOP-Trio, mock adapter",
    "litellm": "(d) LiteLLM proxy",
    "hypercorn": "(e) hypercorn alone, fixed answer",
}


def _get(data: dict[str, Any], *path: str) -> Any:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets for this round, each with its measured value and a verdict."""
    tp = results.get("throughput", {})
    rows = []

    def ratio(kind: str, what: str) -> None:
        iop, peer = _get(tp, f"{kind}-c32", "iop-vllm", "rps"), _get(tp, f"{kind}-c32", "litellm", "rps")
        value = round(iop / peer, 1) if iop and peer else None
        rows.append({"target": f"{what} at c=32: (b) >= 10x LiteLLM", "measured": f"{_fmt(value)}x ({_fmt(iop)} vs {_fmt(peer)}/s)",
                     "ok": None if value is None else value >= 10})

    ratio("nonstream", "non-streaming req/s")
    ratio("stream", "streams/s (16 tokens)")
    for kind in ("nonstream", "stream"):
        b, a = _get(tp, f"{kind}-c1", "iop-vllm", "latency_ms", "p50"), _get(tp, f"{kind}-c1", "direct", "latency_ms", "p50")
        added = round(b - a, 3) if b is not None and a is not None else None
        rows.append({"target": f"added p50 latency at c=1, {kind}: (b) - (a) <= 1.5 ms", "measured": f"{_fmt(added, 2)} ms",
                     "ok": None if added is None else added <= 1.5})
    lags = []
    for phase, per_system in results.get("cancellation", {}).items():
        entry = per_system.get("iop-vllm")
        if entry:
            worst = None if entry["never_seen"] or entry["lag_ms_max"] is None else entry["lag_ms_max"]
            lags.append((phase, worst))
    if lags:
        ok = all(w is not None and w <= 50 for _, w in lags)
        text = ", ".join(f"{p}: {'never' if w is None else f'{w:.1f}'}" for p, w in lags)
        rows.append({"target": "cancellation lag <= 50 ms, every phase (worst probe of (b))", "measured": text + " ms", "ok": ok})
    streams = results.get("many_streams", {})
    if streams:
        n = max(streams, key=int)
        s = streams[n]
        per = s.get("edge_kib_per_stream")
        upper = s["edge_rss_open_mb"] * 1024 / int(n) if s.get("edge_rss_open_mb") else None
        ok = s["completed"] == s["streams"] and upper is not None and upper <= 64
        rows.append({"target": f"{int(n):,} open streams on one edge: all complete, <= 64 KiB RSS each",
                     "measured": f"{s['completed']:,}/{s['streams']:,} complete; {_fmt(per)} KiB/stream added "
                                 f"(edge RSS / streams: {_fmt(upper)} KiB)", "ok": ok})
    return rows


def _systems(block: dict[str, Any]) -> list[str]:
    return [s for s in SYSTEM_ORDER if s in block] + [s for s in block if s not in SYSTEM_ORDER]


def markdown(results: dict[str, Any], findings: str) -> str:
    meta = results["meta"]
    out = [
        "# IOP-Trio bench results",
        "",
        f"Run {meta['started']} ({meta['mode']} mode, {meta['elapsed_s']:.0f} s), {meta['machine']}. "
        f"Pinning: {meta['pinning_text']}. Throughput: {meta['rounds']} alternating round(s) of {meta['duration_s']:g} s "
        f"after {meta['warmup_s']:g} s warm-up per system and scenario; the median round is shown. "
        f"Product sources (iop_trio/*.py) sha256 {meta.get('product_sha256', '?')}.",
        "",
    ]
    for section, note in (meta.get("sections") or {}).items():
        out += [f"Section `{section}` comes from a later run: {note}.", ""]
    if meta.get("skipped"):
        out += ["Skipped: " + "; ".join(f"**{k}**: {v}" for k, v in meta["skipped"].items()), ""]
    rows = targets(results)
    if rows:
        out += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        for row in rows:
            verdict = "n/a" if row["ok"] is None else ("yes" if row["ok"] else "**no**")
            out.append(f"| {row['target']} | {row['measured']} | {verdict} |")
        out.append("")
    tp = results.get("throughput", {})
    for kind, title in (("nonstream", "Non-streaming"), ("stream", "Streaming, 16 tokens")):
        keys = [k for k in tp if k.startswith(kind + "-")]
        if not keys:
            continue
        stream = kind == "stream"
        head = "| system | c | req/s | p50 ms | p90 ms | p99 ms |" + (" TTFB p50 | TTFT p50 |" if stream else "") + " SUT CPU ms/req | SUT peak RSS MB | errors |"
        out += [f"## {title}", "", head, "|" + "---|" * (head.count("|") - 1)]
        for key in sorted(keys, key=lambda k: int(k.split("-c")[1])):
            for system in _systems(tp[key]):
                r = tp[key][system]
                lat = r["latency_ms"]
                cells = [LABELS.get(system, system), key.split("-c")[1], _fmt(r["rps"]), _fmt(lat["p50"], 2), _fmt(lat["p90"], 2), _fmt(lat["p99"], 2)]
                if stream:
                    cells += [_fmt(_get(r, "ttfb_ms", "p50"), 2), _fmt(_get(r, "ttft_ms", "p50"), 2)]
                cells += [_fmt(r["sut_cpu_per_request_ms"], 3), _fmt(r["sut_peak_rss_mb"]), str(r["errors"])]
                out.append("| " + " | ".join(cells) + " |")
        out.append("")
    cancel = results.get("cancellation", {})
    if cancel:
        systems = sorted({s for per in cancel.values() for s in per}, key=lambda s: SYSTEM_ORDER.index(s) if s in SYSTEM_ORDER else 99)
        out += ["## Cancellation lag (client closes -> backend sees its connection close)", "",
                "Median / worst of the probes, ms; *never* = the backend did not see it within the wait.", "",
                "| phase | " + " | ".join(LABELS.get(s, s) for s in systems) + " |", "|---|" + "---|" * len(systems)]
        for phase, per in cancel.items():
            cells = []
            for s in systems:
                e = per.get(s)
                if not e:
                    cells.append("–")
                elif e["errors"] and e["lag_ms_median"] is None and not e["never_seen"]:
                    cells.append("error: " + e["errors"][0][:60])
                else:
                    text = f"{_fmt(e['lag_ms_median'], 1)} / {_fmt(e['lag_ms_max'], 1)}"
                    if e["never_seen"]:
                        text += f", never {e['never_seen']}/{e['probes']} (waited {e['never_seen_wait_s']:g} s)"
                    cells.append(text)
            out.append(f"| {phase} | " + " | ".join(cells) + " |")
        out.append("")
    streams = results.get("many_streams", {})
    if streams:
        out += ["## Many open streams on one edge ((c): edge + node, mock adapter)", "",
                "KiB/stream = (RSS with all open - RSS idle) / streams; *upper bound* = RSS with all open / streams.", "",
                "| streams | opened | completed | failed | all open after s | edge RSS idle -> open MB | edge KiB/stream | edge upper bound | node KiB/stream | SUT CPU s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for n, s in sorted(streams.items(), key=lambda item: int(item[0])):
            upper = s["edge_rss_open_mb"] * 1024 / int(n) if s.get("edge_rss_open_mb") else None
            out.append(f"| {int(n):,} | {s['opened']:,} | {s['completed']:,} | {s['failed']:,} | {_fmt(s.get('open_all_s'))} | "
                       f"{_fmt(s['edge_rss_idle_mb'])} -> {_fmt(s.get('edge_rss_open_mb'))} | {_fmt(s.get('edge_kib_per_stream'))} | "
                       f"{_fmt(upper)} | {_fmt(s.get('node_kib_per_stream'))} | {_fmt(s['sut_cpu_s'], 1)} |")
        samples = [x for s in streams.values() for x in s.get("failure_samples", [])]
        if samples:
            out += ["", "Failures seen: " + "; ".join(sorted(set(samples))[:3])]
        out.append("")
    nodes = results.get("many_nodes")
    if nodes:
        out += [f"## Many nodes on one edge (simulated, mTLS, heartbeat every {nodes['heartbeat_interval_s']:g} s)", "",
                "| nodes | registered in s | edge RSS MB | edge KiB/node | edge CPU at rest | c=1 p50 ms | c=16 req/s | edge CPU ms/req | scheduling decision us | errors |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for label in ("one", "many"):
            e = nodes[label]
            out.append(f"| {e['nodes']:,} | {_fmt(e['register_s'], 2)} | {_fmt(e['edge_rss_mb'])} | {_fmt(e['edge_kib_per_node'])} | "
                       f"{_fmt(e['edge_rest_cpu_pct'], 2)}% | {_fmt(e['c1_p50_ms'], 2)} | {_fmt(e['c16_rps'])} | {_fmt(e['edge_cpu_per_request_ms'], 3)} | "
                       f"{_fmt(e.get('decision_us'))} | {e['errors']} |")
        prof = _get(nodes, "many", "edge_profile_c16") or {}
        if prof.get("self"):
            out += ["", f"Edge with {nodes['nodes']:,} nodes under c=16 load, top functions (self, % of busy samples): "
                    + ", ".join(f"`{n}` {v}%" for n, v in prof["self"][:8])]
        out += ["", f"Scheduling among {nodes['nodes']:,} nodes instead of 1 adds {_fmt(nodes.get('scheduling_added_p50_ms'), 3)} ms "
                f"to the c=1 p50 and {_fmt(nodes.get('scheduling_added_cpu_ms'), 3)} ms of edge CPU per request. "
                "*Scheduling decision* is the mean of the edge's `iop_schedule_wait_seconds` over the c=16 load "
                "(no request queued: every node had free slots), i.e. the time to pick a node and reserve its slot.", ""]
    profiles = results.get("profiles", {})
    if profiles:
        out += ["## Where the time goes (py-spy, % of busy samples, inclusive by component)", ""]
        for name, prof in profiles.items():
            if "skipped" in prof:
                out += [f"- {name}: skipped ({prof['skipped']})"]
                continue
            out += [f"### {name} (load ran at {_fmt(prof.get('rps_while_profiled'))} req/s while profiled)", ""]
            for role in ("edge", "node"):
                p = prof.get(role) or {}
                if "inclusive_by_component" not in p:
                    out.append(f"- {role}: {p.get('error', 'no samples')}")
                    continue
                comps = ", ".join(f"{n} {v}%" for n, v in p["inclusive_by_component"][:10])
                own = ", ".join(f"{n} {v}%" for n, v in p.get("self_by_component", [])[:6])
                top = ", ".join(f"`{n}` {v}%" for n, v in p["self"][:6])
                out += [f"- **{role}** ({p['samples']} busy samples) inclusive: {comps}",
                        f"  - self time by component: {own}", f"  - top functions (self): {top}"]
            out.append("")
    out += [
        "## How to read this",
        "",
        "- **req/s** counts requests that both started and finished inside the measured window; a stream counts once, "
        "after `data: [DONE]` with all 16 tokens of content checked (counted as words: a gateway may forward tokens that reached it together in one chunk).",
        "- **SUT CPU ms/req** is the CPU the system under test (every process of it) spent per request: on one core, "
        "1000 / that is the ceiling on req/s. **peak RSS** is the largest sum of RSS over its processes, sampled every 100 ms.",
        "- (a) is the mock backend with no gateway: its figures are the floor under every other row, and at high "
        "concurrency they are limited by the load generator that shares core 0 with it.",
        "- (c) has no backend hop, so (b) - (c) is what the vllm adapter and the extra HTTP hop cost.",
        "- (e) is hypercorn alone answering from a bare ASGI app: the floor under the edge, whose HTTP server DESIGN.md fixes as hypercorn. (b) - (e) is what the edge's own work, the IOP hop, the node and the backend hop cost together.",
        "- Cancellation phases: *queued* = waiting in the backend's queue (its only slot is busy), *before_first_token* = "
        "backend accepted, first token 3 s away, *mid_stream* = after 3 tokens, *non_stream* = a non-streaming request being generated.",
        "",
    ]
    if findings:
        out += [findings.strip(), ""]
    return "\n".join(out)


def chart(results: dict[str, Any], path: Path) -> str:
    """Throughput and latency per system; returns ``""`` or why no chart was drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed"
    tp = results.get("throughput", {})
    if not tp:
        return "no throughput results"
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = {"direct": "#7f7f7f", "iop-vllm": "#1f77b4", "iop-mock": "#2ca02c", "litellm": "#d62728", "hypercorn": "#9467bd"}
    for col, (kind, title) in enumerate((("nonstream", "non-streaming"), ("stream", "streaming, 16 tokens"))):
        keys = sorted((k for k in tp if k.startswith(kind + "-")), key=lambda k: int(k.split("-c")[1]))
        systems = [s for s in SYSTEM_ORDER if any(s in tp[k] for k in keys)]
        width = 0.8 / max(1, len(systems))
        for metric_row, (metric, ylabel) in enumerate((("rps", "requests/s (log)"), ("p50", "p50 latency, ms (log)"))):
            ax = axes[metric_row][col]
            for i, system in enumerate(systems):
                values = []
                for k in keys:
                    r = tp[k].get(system)
                    values.append((r["rps"] if metric == "rps" else r["latency_ms"]["p50"]) if r else 0)
                xs = [j + i * width for j in range(len(keys))]
                bars = ax.bar(xs, [v or 0 for v in values], width, label=LABELS[system], color=colors.get(system))
                for bar, v in zip(bars, values, strict=True):
                    if v:
                        ax.annotate(f"{v:,.0f}" if metric == "rps" else f"{v:.1f}", (bar.get_x() + bar.get_width() / 2, v),
                                    ha="center", va="bottom", fontsize=7)
            ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(keys))], [f"c={k.split('-c')[1]}" for k in keys])
            ax.set_yscale("log")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {'throughput' if metric == 'rps' else 'median latency'}")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(f"IOP-Trio bench, {results['meta']['started']} ({results['meta']['pinning_text']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ""


def write(results: dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    findings_path = out_dir / "findings.md"
    findings = findings_path.read_text() if findings_path.exists() else ""
    why = chart(results, out_dir / "chart.png")
    if why:
        results["meta"]["chart"] = f"not drawn: {why}"
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "results.md").write_text(markdown(results, findings))
