"""Run the IOP-Trio bench: one command, side by side with the backend alone and with LiteLLM.

    .venv/bin/python bench/run.py            # the full run (~15-20 min), results in bench/results/
    .venv/bin/python bench/run.py --quick    # a few seconds per scenario (CI keeps the scripts alive)

It installs what it needs first (bench/requirements.txt into this interpreter; LiteLLM's proxy into
bench/.venv-litellm, created on demand) unless ``--no-install``. See bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import report  # noqa: E402
import scenarios  # noqa: E402
import systems as sut  # noqa: E402

BENCH = Path(__file__).resolve().parent
ALL_SYSTEMS = ("direct", "iop-vllm", "iop-mock", "litellm", "hypercorn")
GROUPS = {
    "throughput": [f"{kind}-c{c}" for kind in ("nonstream", "stream") for c in (1, 32, 64)],
    "cancel": [f"cancel-{phase}" for phase in scenarios.PHASES],
    "streams": ["streams"],
    "nodes": ["nodes"],
    "profile": ["profile"],
}
DEFAULT = ["throughput", "cancel", "streams", "nodes", "profile"]


def ensure_requirements(install: bool) -> list[str]:
    """Install bench/requirements.txt into this interpreter if something is missing."""
    wanted = {"matplotlib": "matplotlib", "py_spy": "py-spy", "uvloop": "uvloop"}
    missing = [name for module, name in wanted.items()
               if importlib.util.find_spec(module) is None and not (module == "py_spy" and Path(sys.executable).with_name("py-spy").exists())]
    if missing and install:
        print(f"bench: installing {', '.join(missing)} from bench/requirements.txt", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "-r", str(BENCH / "requirements.txt")],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
        missing = [name for module, name in wanted.items() if importlib.util.find_spec(module) is None
                   and not (module == "py_spy" and Path(sys.executable).with_name("py-spy").exists())]
    return missing


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (max(hard, 65536), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            continue
    return soft


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu or platform.machine()}), {mem:.0f} GiB, Python {platform.python_version()}"


def product_fingerprint() -> str:
    """A digest of iop_trio/'s sources, so a result can be tied to the code it measured."""
    digest = hashlib.sha256()
    package = BENCH.parent / "iop_trio"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def selected(args: argparse.Namespace) -> list[str]:
    names: list[str] = []
    for item in args.scenarios.split(","):
        item = item.strip()
        names += GROUPS.get(item, [item] if item else [])
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="IOP-Trio bench")
    parser.add_argument("--quick", action="store_true", help="a few seconds per scenario")
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS), help=f"comma list of {', '.join(ALL_SYSTEMS)}")
    parser.add_argument("--scenarios", default=",".join(DEFAULT),
                        help="comma list of groups (throughput, cancel, streams, nodes, profile) or ids (nonstream-c32, cancel-mid_stream)")
    parser.add_argument("--out", default=str(BENCH / "results"), help="where results go")
    parser.add_argument("--no-install", action="store_true", help="never pip install anything; skip what is missing")
    parser.add_argument("--rounds", type=int, help="alternating rounds per throughput scenario")
    parser.add_argument("--duration", type=float, help="measured seconds per throughput run")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per throughput run")
    parser.add_argument("--streams", default="", help="comma list of open-stream counts (default 1000,5000,10000)")
    parser.add_argument("--nodes", type=int, help="simulated nodes (default 1000)")
    parser.add_argument("--repeats", type=int, help="probes per cancellation phase and system (default 5)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs, databases)")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite results.md and chart.png from results.json (after editing findings.md)")
    parser.add_argument("--merge", action="store_true",
                        help="update an existing results.json in --out with only the scenarios run now")
    args = parser.parse_args(argv)
    quick = args.quick
    args.rounds = args.rounds or (1 if quick else 3)
    args.duration = args.duration or (1.0 if quick else 8.0)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if quick else 2.0)
    args.stream_counts = [int(n) for n in args.streams.split(",") if n] or ([200] if quick else [1000, 5000, 10000])
    args.nodes = args.nodes or (50 if quick else 1000)
    args.repeats = args.repeats or (2 if quick else 5)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        report.write(json.loads((Path(args.out) / "results.json").read_text()), Path(args.out))
        print(f"bench: rewrote {args.out}/results.md", flush=True)
        return 0
    started = time.time()
    wanted_systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    names = selected(args)
    skipped: dict[str, str] = {}
    missing = ensure_requirements(not args.no_install)
    if missing:
        skipped["dependencies"] = f"not installed: {', '.join(missing)}"
    fd_limit = raise_fd_limit()
    pin = sut.pinning()
    if pin["enabled"]:
        os.sched_setaffinity(0, {pin["load"]})
        pin_text = f"load generator + mock backend on core {pin['load']}, system under test on core {pin['sut']} (taskset)"
    else:
        pin_text = f"none ({pin['reason']})"
    workdir = Path(tempfile.mkdtemp(prefix="iop-bench-"))
    results: dict[str, Any] = {"meta": {
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
        "product_sha256": product_fingerprint(),
        "pinning": pin, "pinning_text": pin_text, "fd_limit": fd_limit,
        "rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup,
        "systems": wanted_systems, "scenarios": names, "skipped": skipped, "workdir": str(workdir),
    }}
    running: list[sut.System] = []
    failures: list[str] = []
    try:
        backend = sut.MockBackend(workdir, pin["load"])
        running.append(backend)
        by_name: dict[str, sut.System] = {}
        for name in wanted_systems:
            try:
                if name == "direct":
                    by_name[name] = backend
                elif name == "iop-vllm":
                    by_name[name] = sut.iop_vllm(workdir / "iop-vllm", pin["sut"], backend.base_url)
                elif name == "iop-mock":
                    by_name[name] = sut.iop_mock(workdir / "iop-mock", pin["sut"])
                elif name == "litellm":
                    exe, why = sut.ensure_litellm(not args.no_install)
                    if exe is None:
                        skipped["litellm"] = why
                        continue
                    by_name[name] = sut.LiteLLM(exe, workdir / "litellm", pin["sut"], backend.base_url)
                elif name == "hypercorn":
                    by_name[name] = sut.HypercornFloor(workdir / "hypercorn", pin["sut"])
                else:
                    raise SystemExit(f"unknown system {name!r} (known: {', '.join(ALL_SYSTEMS)})")
            except RuntimeError as exc:
                skipped[name] = f"did not start: {str(exc).splitlines()[0]}"
                continue
            if by_name[name] is not backend:
                running.append(by_name[name])
        active = [by_name[n] for n in wanted_systems if n in by_name]
        print(f"bench: systems {', '.join(s.name for s in active)}; {pin_text}", flush=True)
        run_scenarios(args, names, active, backend, workdir, pin, results, failures)
    finally:
        for system in reversed(running):
            system.stop()
        results["meta"]["elapsed_s"] = time.time() - started
        results["meta"]["failures"] = failures
        if args.merge:
            results = merged(Path(args.out) / "results.json", results)
        report.write(results, Path(args.out))
        if args.keep or failures:
            print(f"bench: work directory kept: {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"bench: results in {args.out}/results.md", flush=True)
    return 1 if failures else 0


def merged(path: Path, new: dict[str, Any]) -> dict[str, Any]:
    """The previous results with this run's sections laid over them; each section remembers
    the run it came from (``meta.sections``)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return new
    sections = old["meta"].setdefault("sections", {})
    for key, value in new.items():
        if key == "meta":
            continue
        if isinstance(value, dict) and isinstance(old.get(key), dict) and key != "many_nodes":
            old[key].update(value)
        else:
            old[key] = value
        sections[key] = f"{new['meta']['started']} (product sha256 {new['meta'].get('product_sha256', '?')})"
    old["meta"]["failures"] = old["meta"].get("failures", []) + new["meta"]["failures"]
    old["meta"]["skipped"].update(new["meta"]["skipped"])
    return old


def run_scenarios(args: argparse.Namespace, names: list[str], active: list[sut.System], backend: sut.System,
                  workdir: Path, pin: dict[str, Any], results: dict[str, Any], failures: list[str]) -> None:
    def guarded(label: str, fn: Any, *a: Any, **kw: Any) -> Any:
        try:
            return fn(*a, **kw)
        except Exception as exc:  # one scenario's failure must not lose the others' results
            failures.append(f"{label}: {exc!r}")
            traceback.print_exc()
            return None

    for name in names:
        if name.startswith(("nonstream-c", "stream-c")):
            kind, c = name.split("-c")
            out = guarded(name, scenarios.throughput, active, kind, int(c), rounds=args.rounds, duration=args.duration, warmup=args.warmup)
            if out is not None:
                results.setdefault("throughput", {})[name] = out
        elif name.startswith("cancel-"):
            phase = name[len("cancel-") :]
            out = guarded(name, scenarios.cancellation, active, backend.base_url, phase, repeats=args.repeats, wait=3.0)
            if out is not None:
                results.setdefault("cancellation", {})[phase] = out
        elif name == "streams":
            for n in args.stream_counts:
                # A fresh edge per count: Python keeps freed memory, so a reused edge would make
                # the next count's "idle" RSS already hold the previous one's peak.
                hold = 3.0 if args.quick else 20.0 + n / 250
                cluster = guarded("streams start", sut.iop_mock, workdir / f"streams-{n}", pin["sut"], (hold,))
                if cluster is None:
                    continue
                try:
                    out = guarded(f"streams-{n}", scenarios.many_streams, cluster, n, hold)
                    if out is not None:
                        results.setdefault("many_streams", {})[str(n)] = out
                finally:
                    cluster.stop()
        elif name == "nodes":
            out = guarded("nodes", scenarios.many_nodes, workdir / "nodes", args.nodes, sut_core=pin["sut"], load_core=pin["load"],
                          rest=3.0 if args.quick else 20.0, duration=1.0 if args.quick else 5.0, heartbeat=2.0 if args.quick else 5.0)
            if out is not None:
                results["many_nodes"] = out
        elif name == "profile":
            profiled = [s for s in active if isinstance(s, sut.IopCluster)]
            for system in profiled:
                for kind in ("nonstream", "stream"):
                    out = guarded(f"profile {system.name}", scenarios.profile, system, kind, 32, 3.0 if args.quick else 10.0,
                                  workdir / "profiles", pin["load"])
                    if out is not None:
                        results.setdefault("profiles", {})[f"{system.name} {kind} c=32"] = out
        else:
            failures.append(f"unknown scenario {name!r}")


if __name__ == "__main__":
    sys.exit(main())
