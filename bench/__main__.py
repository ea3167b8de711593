"""``make bench``: sqla_delayedq against a hand-written psycopg baseline, in one run.

Each PostgreSQL figure is the median of ``--runs`` runs (min and max beside it); runs alternate
between the two systems so drift on a shared machine hits both. MariaDB and SQLite run the same
workloads through sqla_delayedq only. Results go to ``bench/results.json`` and a table.

    python -m bench                       # everything, synchronous_commit as configured (on)
    python -m bench --sync-commit off     # also repeat PostgreSQL with synchronous_commit=off
    python -m bench --only E1,C1 --scale 0.2 --backends postgresql
    python -m bench --only CTRL          # the queue controls only (bench/bench_controls.py)
    python -m bench --only GRP           # ordered delivery per group key (bench/bench_groups.py)
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._env import Measure, fresh_database, pg_settings, truncate
from .workloads import (
    BASE,
    CONTRACT,
    FLOOR,
    FLOOR_ENGINE,
    OURS,
    OURS_VARIANTS,
    SIZES,
    create_domain,
)

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


SYSTEM_LABELS = {
    "ours": "sqla_delayedq",
    "ours_lease": "sqla_delayedq (lease mode)",
    "ours_engine": "sqla_delayedq (Engine form)",
    "ours_2proc": "sqla_delayedq (2 processes)",
    "ours_lease_2proc": "sqla_delayedq (lease mode, 2 processes)",
    "procrastinate": "procrastinate",
    "pgqueuer": "pgqueuer",
    "baseline": "hand-written baseline",
    "contract": "same-contract reference",
    "floor": "SQLAlchemy floor",
    "floor_engine": "SQLAlchemy floor (Core connection)",
}
#: The floors, and the form of ours each one bounds (see bench/workloads.py).
FLOORS = {"floor": ("ours", FLOOR), "floor_engine": ("ours_engine", FLOOR_ENGINE)}
#: Issue 15's targets: ours against the best peer and against the same-contract reference.
BEST_PEER_TARGET = 1.25
CONTRACT_TARGET = 0.90
LATENCY = ("L1", "L1X")
ROW_LABELS = {"L1": "L1 (in-process)", "L1X": "L1X (producer in another process)"}
L1_NOTE = (
    "in-process: the producer runs inside the worker's process and wakes it in memory; "
    "the peers are measured across processes in L1X"
)


def systems_for(w: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The systems that run workload ``w`` on PostgreSQL, and those that cannot (with why)."""
    from .latency import L1X
    from .peers import NOT_EXPRESSIBLE, PEERS

    if w == "L1X":
        return dict(L1X), {}
    run: dict[str, Any] = {"ours": OURS[w]}
    run.update({k: forms[w] for k, forms in OURS_VARIANTS.items() if w in forms})
    for peer, fns in PEERS.items():
        if w in fns:
            run[peer] = fns[w]
    run["baseline"] = BASE[w]
    if w in CONTRACT:
        run["contract"] = CONTRACT[w]
    run.update({k: forms[w] for k, (_, forms) in FLOORS.items() if w in forms})
    na: dict[str, str] = {}
    for peer in PEERS:
        if peer not in run:
            na[peer] = L1_NOTE if w == "L1" else NOT_EXPRESSIBLE[peer].get(w, "not measured")
    return run, na


def compare(w: str, sync: str, summaries: dict[str, Any], na: dict[str, str]) -> dict[str, Any]:
    """Ratios of ours (each mode) to the best peer, to the reference and to the baseline."""
    from .peers import PEERS

    entry: dict[str, Any] = {}
    peers = {p: summaries[p] for p in PEERS if p in summaries}
    entry["peers"] = {**peers, **{p: {"n/a": why} for p, why in na.items()}}
    ours_modes = [k for k in ("ours", *OURS_VARIANTS) if k in summaries]
    if w in LATENCY:
        for k in ours_modes:
            entry[f"{k}_p99_ms"] = summaries[k]["p99_ms"]
        if peers:
            best = min(peers, key=lambda p: peers[p]["p99_ms"])
            entry["best_peer"] = best
            for k in ours_modes:
                # Below 1: ours starts handlers sooner than the best peer at p99.
                entry[f"{k}_p99_over_best_peer"] = summaries[k]["p99_ms"] / peers[best]["p99_ms"]
        if w == "L1":
            entry["note"] = L1_NOTE
        return entry
    ours = summaries["ours"]["rate_median"]
    base = summaries["baseline"]["rate_median"]
    entry["ratio"] = ours / base
    if w in TARGETS[sync]:
        entry["target_ratio"] = TARGETS[sync][w]  # issue 9's, against the baseline
        entry["meets_target"] = entry["ratio"] >= TARGETS[sync][w]
    if w == "E0":
        # What the offer costs a transaction beyond a hand-written insert of the same row.
        entry["marginal_cost_us_per_txn"] = 1e6 / ours - 1e6 / base
    if "contract" in summaries:
        c = summaries["contract"]["rate_median"]
        entry["contract_ratio"] = c / base
    if peers:
        best = max(peers, key=lambda p: peers[p]["rate_median"])
        entry["best_peer"] = best
    for k in ours_modes:
        mine = summaries[k]["rate_median"]
        prefix = "" if k == "ours" else f"{k}_"
        if peers:
            r = entry[f"{prefix}ratio_to_best_peer"] = mine / peers[best]["rate_median"]
            entry[f"{prefix}meets_best_peer_target"] = r >= BEST_PEER_TARGET
        if "contract" in summaries:
            r = entry[f"{prefix}ratio_to_contract"] = mine / summaries["contract"]["rate_median"]
            entry[f"{prefix}meets_contract_target"] = r >= CONTRACT_TARGET
    for floor, (form, _) in FLOORS.items():
        # What SQLAlchemy alone allows: a floor below a target puts that target out of reach of
        # any library on the same API, whatever its own code does.
        if floor not in summaries or form not in summaries:
            continue
        rate = summaries[floor]["rate_median"]
        entry[f"{form}_ratio_to_{floor}"] = summaries[form]["rate_median"] / rate
        if peers:
            entry[f"{floor}_ratio_to_best_peer"] = rate / peers[best]["rate_median"]
        if "contract" in summaries:
            entry[f"{floor}_ratio_to_contract"] = rate / summaries["contract"]["rate_median"]
    return entry


def run_postgresql(
    workloads: list[str], runs: int, scale: float, sync: str, tmp: Path
) -> dict[str, Any]:
    from . import peers

    results: dict[str, Any] = {}
    with fresh_database("postgresql", tmp, sync_commit_off=(sync == "off")) as url:
        settings = pg_settings(url)
        peers.install(url)
        create_domain(url)
        for w in workloads:
            n = max(100, int(SIZES[w] * scale))
            systems, na = systems_for(w)
            measures: dict[str, list[Measure]] = {label: [] for label in systems}
            for r in range(runs):
                order = list(systems.items())
                # Rotate, so each system runs first, second and last in turn.
                order = order[r % len(order) :] + order[: r % len(order)]
                for label, fn in order:
                    truncate(url)
                    peers.truncate(url)
                    m = fn(url, "postgresql", n)
                    measures[label].append(m)
                    print(
                        f"  postgresql sync={sync} {w} run {r + 1} {label}: {m.rate:,.0f} msg/s"
                        f" cpu={m.client_cpu / m.messages * 1e6:,.0f}us/msg"
                        + "".join(f" {k}={v:.2f}" for k, v in m.extra.items()),
                        flush=True,
                    )
            summaries = {label: summarise(ms) for label, ms in measures.items()}
            entry: dict[str, Any] = {"messages": n}
            entry.update({k: v for k, v in summaries.items() if k not in peers.PEERS})
            entry.update(compare(w, sync, summaries, na))
            results[w] = entry
    return {"settings": settings, "workloads": results}


def run_ours_only(
    backend: str, workloads: list[str], runs: int, scale: float, tmp: Path
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with fresh_database(backend, tmp) as url:
        create_domain(url)
        for w in workloads:
            if w == "L1X":
                continue  # cross-process wake-up is LISTEN/NOTIFY: PostgreSQL only
            n = max(100, int(SIZES[w] * scale))
            systems: dict[str, Callable[..., Measure]] = {"ours": OURS[w]}
            systems.update({k: forms[w] for k, forms in OURS_VARIANTS.items() if w in forms})
            if w == "E0":
                systems["baseline"] = BASE[w]
            measures: dict[str, list[Measure]] = {label: [] for label in systems}
            for r in range(runs):
                for label, fn in systems.items():
                    truncate(url)
                    m = fn(url, backend, n)
                    measures[label].append(m)
                    print(
                        f"  {backend} {w} run {r + 1} {label}: {m.rate:,.0f} msg/s"
                        f" cpu={m.client_cpu / m.messages * 1e6:,.0f}us/msg"
                        + "".join(f" {k}={v:.2f}" for k, v in m.extra.items()),
                        flush=True,
                    )
            entry: dict[str, Any] = {"messages": n}
            entry.update({label: summarise(ms) for label, ms in measures.items()})
            if w == "E0":
                ours, base = entry["ours"]["rate_median"], entry["baseline"]["rate_median"]
                entry["ratio"] = ours / base
                entry["marginal_cost_us_per_txn"] = 1e6 / ours - 1e6 / base
            results[w] = entry
    return {"workloads": results}


COLUMNS = ("ours", "ours_lease", "procrastinate", "pgqueuer", "baseline", "contract")


def _cell(w: str, e: dict[str, Any], label: str) -> str:
    s = e.get(label) or e.get("peers", {}).get(label)
    if s is None:
        return "–"
    if "n/a" in s:
        return "n/a"
    if w in LATENCY:
        return f"{s['p50_ms']:.1f} / {s['p95_ms']:.1f} / {s['p99_ms']:.1f} ms"
    return f"{s['rate_median']:,.0f} ({s['rate_min']:,.0f}–{s['rate_max']:,.0f})"


def _ratio(e: dict[str, Any], key: str) -> str:
    return f"{e[key]:.2f}×" if key in e else "–"


#: Forms of ours shown below the tables rather than in a column of their own.
BELOW = {
    "ours_engine": "in the Engine form (`q.offer(engine, ...)`, no transaction of the caller's)",
    "ours_2proc": "by 2 worker processes of 2 consumers (`delayedq worker --processes 2`)",
    "ours_lease_2proc": "in lease mode by 2 worker processes of 2 consumers",
}


def _below(workloads: dict[str, Any], ratios: bool) -> list[str]:
    """The figures of the forms in ``BELOW``, a line each, with their ratios when ``ratios``."""
    lines = []
    for w, e in workloads.items():
        for k, what in BELOW.items():
            if k not in e:
                continue
            line = (
                f"{w} {what}: {_cell(w, e, k)} msg/s,"
                f" {e[k]['client_cpu_us_per_msg']:,.0f} µs of client CPU per message"
            )
            if ratios:
                line += (
                    f"; {_ratio(e, k + '_ratio_to_best_peer')} the best peer,"
                    f" {_ratio(e, k + '_ratio_to_contract')} the same-contract reference"
                )
            lines.append(line + ".")
    return ["", *lines] if lines else []


def _floors(workloads: dict[str, Any]) -> list[str]:
    """The SQLAlchemy floors, a line each: the ceiling SQLAlchemy puts on any library."""
    lines = []
    for w, e in workloads.items():
        for floor, (form, _) in FLOORS.items():
            if floor not in e or form not in e:
                continue
            lines.append(
                f"{w} {SYSTEM_LABELS[floor]} (the reference's SQL through SQLAlchemy, no code of"
                f" ours): {_cell(w, e, floor)} msg/s, {e[floor]['client_cpu_us_per_msg']:,.0f} µs"
                f" of client CPU per message; {_ratio(e, floor + '_ratio_to_best_peer')} the best"
                f" peer, {_ratio(e, floor + '_ratio_to_contract')} the reference;"
                f" {SYSTEM_LABELS[form]} = {_ratio(e, f'{form}_ratio_to_{floor}')} the floor."
            )
    return ["", *lines] if lines else []


def table(report: dict[str, Any]) -> str:
    """Throughput (msg/s, median and min to max) or latency (p50 / p95 / p99), then CPU."""
    head = " | ".join(SYSTEM_LABELS[c] for c in COLUMNS)
    lines: list[str] = []
    for key, block in report["postgresql"].items():
        lines += [
            f"PostgreSQL, synchronous_commit={key}",
            "",
            f"| workload | {head} | ours / best peer | lease / best peer | ours / reference | lease / reference |",
            "|---|" + "---|" * (len(COLUMNS) + 4),
        ]
        for w, e in block["workloads"].items():
            cells = " | ".join(_cell(w, e, c) for c in COLUMNS)
            if w in LATENCY:
                ratios = (
                    f"p99 {_ratio(e, 'ours_p99_over_best_peer')} | p99 {_ratio(e, 'ours_lease_p99_over_best_peer')} | – | –"
                    if "best_peer" in e
                    else "– | – | – | –"
                )
            else:
                ratios = (
                    f"{_ratio(e, 'ratio_to_best_peer')} | {_ratio(e, 'ours_lease_ratio_to_best_peer')}"
                    f" | {_ratio(e, 'ratio_to_contract')} | {_ratio(e, 'ours_lease_ratio_to_contract')}"
                )
            lines.append(f"| {ROW_LABELS.get(w, w)} | {cells} | {ratios} |")
        lines += _below(block["workloads"], ratios=True)
        lines += _floors(block["workloads"])
        e0 = block["workloads"].get("E0")
        if e0:
            lines += [
                "",
                f"E0: ours / the hand-written insert in the same transaction = {e0['ratio']:.2f}×;"
                f" wall time per transaction, ours minus hand-written: {e0['marginal_cost_us_per_txn']:+,.0f} µs;"
                f" client CPU per transaction: {e0['ours']['client_cpu_us_per_msg']:,.0f} µs against"
                f" {e0['baseline']['client_cpu_us_per_msg']:,.0f} µs.",
            ]
        lines += [
            "",
            f"Client CPU per message (µs), synchronous_commit={key}",
            "",
            f"| workload | {head} |",
            "|---|" + "---|" * len(COLUMNS),
        ]
        for w, e in block["workloads"].items():
            cpu = []
            for c in COLUMNS:
                s = e.get(c) or e.get("peers", {}).get(c)
                cpu.append(f"{s['client_cpu_us_per_msg']:,.0f}" if s and "n/a" not in s else "–")
            lines.append(f"| {ROW_LABELS.get(w, w)} | {' | '.join(cpu)} |")
        lines.append("")
    for backend in ("mariadb", "sqlite"):
        wl = report.get(backend, {}).get("workloads", {})
        if not wl:
            continue
        lines += [
            f"{backend} (sqla_delayedq only)",
            "",
            "| workload | sqla_delayedq | lease mode | hand-written (E0) | client CPU µs/msg |",
            "|---|---|---|---|---|",
        ]
        for w, e in wl.items():
            lines.append(
                f"| {ROW_LABELS.get(w, w)} | {_cell(w, e, 'ours')} | {_cell(w, e, 'ours_lease')} | {_cell(w, e, 'baseline')}"
                f" | {e['ours']['client_cpu_us_per_msg']:,.0f} |"
            )
        lines += _below(wl, ratios=False)
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the standard sizes")
    parser.add_argument("--only", default="E0,E1,E2,C1,C2,L1,L1X,CTRL,GRP")
    parser.add_argument("--backends", default="postgresql,mariadb,sqlite")
    parser.add_argument("--sync-commit", choices=["on", "off", "both"], default="both")
    parser.add_argument("--output", default=str(Path(__file__).with_name("results.json")))
    args = parser.parse_args(argv)
    workloads = [w.strip().upper() for w in args.only.split(",") if w.strip()]
    controls = "CTRL" in workloads  # queue controls: bench/bench_controls.py
    groups = "GRP" in workloads  # ordered delivery per group key: bench/bench_groups.py
    workloads = [w for w in workloads if w not in ("CTRL", "GRP")]
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
        if workloads and "postgresql" in backends:
            modes = ["on", "off"] if args.sync_commit == "both" else [args.sync_commit]
            for sync in modes:
                print(f"PostgreSQL, synchronous_commit={sync}", flush=True)
                report["postgresql"][sync] = run_postgresql(
                    workloads, args.runs, args.scale, sync, Path(tmp)
                )
        for backend in ("mariadb", "sqlite"):
            if workloads and backend in backends:
                print(backend, flush=True)
                report[backend] = run_ours_only(
                    backend, workloads, args.runs, args.scale, Path(tmp)
                )
        if controls:
            from . import bench_controls

            servers = [b for b in ("postgresql", "mariadb") if b in backends]
            n = max(500, int(4000 * args.scale))
            print("queue controls", flush=True)
            report["controls"] = bench_controls.run(
                servers, list(bench_controls.SETTINGS), args.runs, n, True
            )
        if groups:
            from . import bench_groups

            servers = [b for b in ("postgresql", "mariadb") if b in backends]
            per_group = max(5, int(20 * args.scale))
            print("groups", flush=True)
            report["groups"] = bench_groups.run(servers, args.runs, 200, per_group)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print()
    print(table(report))
    if controls:
        print(bench_controls.report(report["controls"], n, args.runs))
    if groups:
        print(bench_groups.report(report["groups"], 200, per_group, args.runs))
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
