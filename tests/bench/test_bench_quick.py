"""The bench's quick mode, end to end, so bench/ never rots.

Runs ``bench/run.py --quick`` on a subset (the backend directly, IOP-Trio with the mock adapter
and with the vllm adapter, hypercorn alone; non-streaming and streaming at concurrency 1; one cancellation phase)
as real processes, and checks that it produced sane numbers. Never a timed assertion: the
targets are judged by the full bench run, by people, not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("direct", "iop-mock", "iop-vllm", "hypercorn")
HARD_TIMEOUT = 120


@pytest.mark.e2e
def test_quick_bench_produces_sane_numbers(tmp_path: Path) -> None:
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--quick", "--no-install",
         "--systems", ",".join(SYSTEMS), "--scenarios", "nonstream-c1,stream-c1,cancel-mid_stream", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=HARD_TIMEOUT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["failures"] == []
    assert (out / "results.md").read_text().startswith("# IOP-Trio bench results")

    for scenario in ("nonstream-c1", "stream-c1"):
        for system in SYSTEMS:
            figures = results["throughput"][scenario][system]
            assert figures["requests"] > 0, (scenario, system, figures)
            assert figures["errors"] == 0, (scenario, system, figures["error_samples"])
            assert figures["latency_ms"]["p50"] > 0
            assert figures["sut_peak_rss_mb"] > 0
    assert results["throughput"]["stream-c1"]["iop-vllm"]["ttft_ms"]["p50"] is not None

    lag = results["cancellation"]["mid_stream"]
    for system in ("direct", "iop-vllm"):  # the mock adapter has no backend to see a cancel
        assert lag[system]["errors"] == [], lag[system]
        assert lag[system]["never_seen"] == 0, lag[system]
        assert lag[system]["lag_ms_median"] is not None
    if "chart" not in results["meta"]:  # drawn whenever matplotlib is installed
        assert (out / "chart.png").stat().st_size > 0
