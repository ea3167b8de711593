"""``make bench``'s report: ratios to the best peer and to the reference, ``n/a`` with a reason.

No database: the summaries are made up; the peers' packages (the ``bench`` extra) are not
needed either.
"""

from __future__ import annotations

from bench.__main__ import compare, systems_for, table


def _s(rate: float, cpu: float = 100.0, **extra: float) -> dict:
    return {
        "rate_median": rate,
        "rate_min": rate,
        "rate_max": rate,
        "client_cpu_us_per_msg": cpu,
        "server_cpu_us_per_msg": 0.0,
        **extra,
    }


def test_ratios_name_the_best_peer_and_the_reference() -> None:
    summaries = {
        "ours": _s(900),
        "ours_lease": _s(500),
        "procrastinate": _s(400),
        "pgqueuer": _s(600),
        "baseline": _s(4000),
        "contract": _s(1000),
    }
    e = compare("C1", "on", summaries, {})
    assert e["best_peer"] == "pgqueuer"
    assert e["ratio_to_best_peer"] == 1.5
    assert e["meets_best_peer_target"]
    assert abs(e["ours_lease_ratio_to_best_peer"] - 500 / 600) < 1e-9
    assert e["ratio_to_contract"] == 0.9
    assert e["meets_contract_target"]
    assert not e["ours_lease_meets_contract_target"]


def test_a_workload_a_peer_cannot_express_is_na_with_its_reason() -> None:
    systems, na = systems_for("C2")
    assert "pgqueuer" in systems and "procrastinate" not in systems
    assert "batch" in na["procrastinate"]
    summaries = {k: _s(1000) for k in systems}
    report = {
        "postgresql": {
            "on": {
                "workloads": {
                    "C2": {"messages": 1, **summaries, **compare("C2", "on", summaries, na)}
                }
            }
        }
    }
    assert report["postgresql"]["on"]["workloads"]["C2"]["peers"]["procrastinate"]["n/a"]
    assert "| C2 |" in table(report) and "n/a" in table(report)


def test_latency_compares_p99_and_keeps_the_in_process_figure_apart() -> None:
    lat = {"p50_ms": 1.0, "p95_ms": 2.0, "p99_ms": 3.0}
    summaries = {
        "ours": _s(200, **lat),
        "ours_lease": _s(200, **lat),
        "procrastinate": _s(200, **{**lat, "p99_ms": 6.0}),
        "pgqueuer": _s(200, **{**lat, "p99_ms": 4.0}),
    }
    e = compare("L1X", "on", summaries, {})
    assert e["best_peer"] == "pgqueuer" and e["ours_p99_over_best_peer"] == 0.75
    _, na = systems_for("L1")
    assert set(na) == {"procrastinate", "pgqueuer"} and "in-process" in na["pgqueuer"]


def test_the_floors_bound_their_own_form_and_say_how_far_the_peers_are() -> None:
    systems, _ = systems_for("E1")
    assert {"floor", "floor_engine", "ours", "ours_engine"} <= set(systems)
    for drain in ("C1", "C2"):  # the drains' floors: the reference's takes through Sessions
        assert "floor" in systems_for(drain)[0] and "floor_engine" not in systems_for(drain)[0]
    assert "floor" not in systems_for("E0")[0] and "floor" not in systems_for("L1")[0]
    summaries = {
        "ours": _s(900),
        "ours_engine": _s(1200),
        "pgqueuer": _s(2000),
        "procrastinate": _s(700),
        "baseline": _s(3000),
        "contract": _s(2000),
        "floor": _s(1000),
        "floor_engine": _s(1600),
    }
    e = compare("E1", "on", summaries, {})
    assert e["ours_ratio_to_floor"] == 0.9
    assert e["ours_engine_ratio_to_floor_engine"] == 0.75
    assert e["floor_ratio_to_best_peer"] == 0.5
    assert e["floor_engine_ratio_to_contract"] == 0.8
    report = {"postgresql": {"on": {"workloads": {"E1": {"messages": 1, **summaries, **e}}}}}
    text = table(report)
    assert "E1 SQLAlchemy floor (the reference's SQL" in text
    assert "0.50\u00d7 the best peer" in text and "sqla_delayedq = 0.90\u00d7 the floor" in text
