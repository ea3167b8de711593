"""Ordered delivery per group key across processes: ``delayedq worker --groups -p 4 -c 4`` (4
processes x 4 threads) on PostgreSQL and MariaDB, in both modes, with 200 groups of 20 messages
offered interleaved in one batch. The handlers write when they started and finished
(``tests.cli_handlers:timed``): every message is handled once, each group's messages one after
the other (the next starts after the previous finished) and in their order."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from typing import Any

import pytest

from sqla_delayedq import DelayedQueue
from tests import test_worker_processes as processes
from tests.test_controls_processes import workers
from tests.test_worker_processes import QUEUE, started_workers

supervise = processes.supervise  # the fixture: a ``delayedq worker -p N`` subprocess

GROUPS, PER_GROUP = 200, 20


def offer_groups(backend: Any) -> list[str]:
    """Message i of every group, then i + 1 of every group: the groups interleave in the due
    order, so consumers keep meeting groups whose head is in flight."""
    messages = [
        (f"g{g:03d}/{i:02d}", {"sleep": 0.002}, None, f"g{g:03d}")
        for i in range(PER_GROUP)
        for g in range(GROUPS)
    ]
    with backend.Session() as s, s.begin():
        DelayedQueue[Any](QUEUE, groups=True).offer_batch(s, messages)
    return [key for key, *_ in messages]


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_200_groups_of_20_in_order_and_one_at_a_time_across_4_processes_of_4_threads(
    server_backend: Any, supervise: Any, mode: str
) -> None:
    run = supervise(server_backend, *workers("--groups", mode=mode))
    run.wait(started_workers(run, 4), "four worker processes consuming")
    keys = offer_groups(server_backend)
    run.wait(lambda: len(run.lines("done")) >= len(keys), "every message handled", timeout=240)
    assert run.stop() == 0, run.text()
    assert Counter(line[1] for line in run.lines("done")) == Counter(keys)  # each once
    starts = {line[1]: float(line[3]) for line in run.lines("start")}
    dones = {line[1]: float(line[3]) for line in run.lines("done")}
    by_group: dict[str, list[str]] = defaultdict(list)
    for key in sorted(starts, key=lambda k: starts[k]):
        by_group[key.split("/")[0]].append(key)
    for group, handled in by_group.items():
        assert handled == sorted(handled), (group, handled)  # in the group's order
        for earlier, later in itertools.pairwise(handled):
            assert dones[earlier] <= starts[later], (group, earlier, later)  # never two at once
    assert len({line[2] for line in run.lines("start")}) == 4  # every process took part
