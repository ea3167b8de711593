"""``make bench``: sqla_delayedq against a hand-written psycopg baseline, in one run.

Each PostgreSQL figure is the median of ``--runs`` runs (min and max beside it); runs alternate
between the two systems so drift on a shared machine hits both. MariaDB and SQLite run the same
workloads through sqla_delayedq only. Results go to ``bench/results.json`` and a table.

    python -m bench                       # everything, synchronous_commit as configured (on)
    python -m bench --sync-commit off     # also repeat PostgreSQL with synchronous_commit=off
    python -m bench --only E1,C1 --scale 0.2 --backends postgresql
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._env import Measure, fresh_database, pg_settings, truncate
from .workloads import BASE, CONTRACT, OURS, SIZES

TARGETS = {
    "on": {"E1": 0.90, "E2": 0.60, "C1": 0.85, "C2": 0.60},
    "off": {"E1": 0.50, "E2": 0.60, "C1": 0.50, "C2": 0.60},
}
L1_P99_TARGET_MS = 5.0


def summarise(measures: list[Measure]) -> dict[str, Any]:
    rates = [m.rate for m in measures]
    out: dict[str, Any] = {
        "rate_median": statistics.median(rates),
        "rate_min": min(rates),
        "rate_max": max(rates),
        "client_cpu_us_per_msg": statistics.median(
            m.client_cpu / m.messages * 1e6 for m in measures
        ),
        "server_cpu_us_per_msg": statistics.median(
            m.server_cpu / m.messages * 1e6 for m in measures
        ),
    }
    for key in measures[0].extra:
        values = [m.extra[key] for m in measures]
        out[key] = statistics.median(values)
        out[key + "_min"] = min(values)
        out[key + "_max"] = max(values)
    return out


def run_postgresql(
    workloads: list[str], runs: int, scale: float, sync: str, tmp: Path
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with fresh_database("postgresql", tmp, sync_commit_off=(sync == "off")) as url:
        settings = pg_settings(url)
        for w in workloads:
            n = max(100, int(SIZES[w] * scale))
            ours: list[Measure] = []
            base: list[Measure] = []
            contract: list[Measure] = []
            for r in range(runs):
                order = [("ours", OURS[w], ours), ("base", BASE[w], base)]
                if w in CONTRACT:
                    order.append(("contract", CONTRACT[w], contract))
                # Rotate, so each system runs first, second and last in turn.
                order = order[r % len(order) :] + order[: r % len(order)]
                for label, fn, sink in order:
                    truncate(url)
                    m = fn(url, "postgresql", n)
                    sink.append(m)
                    print(
                        f"  postgresql sync={sync} {w} run {r + 1} {label}: {m.rate:,.0f} msg/s"
                        + "".join(f" {k}={v:.2f}" for k, v in m.extra.items()),
                        flush=True,
                    )
            o, b = summarise(ours), summarise(base)
            entry: dict[str, Any] = {"messages": n, "ours": o, "baseline": b}
            if w == "L1":
                entry["p99_ms"] = o["p99_ms"]
                entry["target_p99_ms"] = L1_P99_TARGET_MS
                entry["meets_target"] = o["p99_ms"] <= L1_P99_TARGET_MS
            else:
                entry["ratio"] = o["rate_median"] / b["rate_median"]
                entry["target_ratio"] = TARGETS[sync][w]
                entry["meets_target"] = entry["ratio"] >= TARGETS[sync][w]
                if contract:
                    c = entry["contract"] = summarise(contract)
                    entry["contract_ratio"] = c["rate_median"] / b["rate_median"]
                    entry["ratio_to_contract"] = o["rate_median"] / c["rate_median"]
            results[w] = entry
    return {"settings": settings, "workloads": results}


def run_ours_only(
    backend: str, workloads: list[str], runs: int, scale: float, tmp: Path
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with fresh_database(backend, tmp) as url:
        for w in workloads:
            n = max(100, int(SIZES[w] * scale))
            measures = []
            for r in range(runs):
                truncate(url)
                m = OURS[w](url, backend, n)
                measures.append(m)
                print(
                    f"  {backend} {w} run {r + 1}: {m.rate:,.0f} msg/s"
                    + "".join(f" {k}={v:.2f}" for k, v in m.extra.items()),
                    flush=True,
                )
            results[w] = {"messages": n, "ours": summarise(measures)}
    return {"workloads": results}


def table(report: dict[str, Any]) -> str:
    lines = [
        "| backend | sync commit | workload | sqla_delayedq msg/s (min–max) | baseline msg/s | ratio | target | met | same-contract psycopg msg/s (its ratio) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, block in report["postgresql"].items():
        for w, e in block["workloads"].items():
            o, b = e["ours"], e["baseline"]
            if w == "L1":
                ours_cell = (
                    f"p50 {o['p50_ms']:.2f} / p95 {o['p95_ms']:.2f} / p99 {o['p99_ms']:.2f} ms"
                )
                base_cell = f"p99 {b['p99_ms']:.2f} ms"
                lines.append(
                    f"| postgresql | {key} | L1 | {ours_cell} | {base_cell} | – | p99 ≤ 5 ms | {'yes' if e['meets_target'] else 'NO'} | – |"
                )
                continue
            lines.append(
                f"| postgresql | {key} | {w} | {o['rate_median']:,.0f} ({o['rate_min']:,.0f}–{o['rate_max']:,.0f}) "
                f"| {b['rate_median']:,.0f} | {e['ratio']:.2f} | ≥ {e['target_ratio']:.2f} | {'yes' if e['meets_target'] else 'NO'} "
                + (
                    f"| {e['contract']['rate_median']:,.0f} ({e['contract_ratio']:.2f}) |"
                    if "contract" in e
                    else "| – |"
                )
            )
    for backend in ("mariadb", "sqlite"):
        for w, e in report.get(backend, {}).get("workloads", {}).items():
            o = e["ours"]
            cell = (
                f"p50 {o['p50_ms']:.2f} / p99 {o['p99_ms']:.2f} ms"
                if w == "L1"
                else f"{o['rate_median']:,.0f} ({o['rate_min']:,.0f}–{o['rate_max']:,.0f})"
            )
            lines.append(f"| {backend} | default | {w} | {cell} | – | – | – | – | – |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the standard sizes")
    parser.add_argument("--only", default="E1,E2,C1,C2,L1")
    parser.add_argument("--backends", default="postgresql,mariadb,sqlite")
    parser.add_argument("--sync-commit", choices=["on", "off", "both"], default="both")
    parser.add_argument("--output", default=str(Path(__file__).with_name("results.json")))
    args = parser.parse_args(argv)
    workloads = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "runs": args.runs,
        "scale": args.scale,
        "postgresql": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        if "postgresql" in backends:
            modes = ["on", "off"] if args.sync_commit == "both" else [args.sync_commit]
            for sync in modes:
                print(f"PostgreSQL, synchronous_commit={sync}", flush=True)
                report["postgresql"][sync] = run_postgresql(
                    workloads, args.runs, args.scale, sync, Path(tmp)
                )
        for backend in ("mariadb", "sqlite"):
            if backend in backends:
                print(backend, flush=True)
                report[backend] = run_ours_only(
                    backend, workloads, args.runs, args.scale, Path(tmp)
                )
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(report))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
