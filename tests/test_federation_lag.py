"""A path into a server lagging far past the dedup window (and the former 10x stretch):
real brokers, the triangle A -> B -> C and A -> C, B -> C partitioned while A's messages
reach C directly; after the heal B's late copies must all be dropped (0 twice, 0 lost)."""

from __future__ import annotations

from pathlib import Path

from test_federation import lag_path_via_b, triangle

from twinmq.broker.admin_client import metric_samples
from twinmq.testing.launcher import BrokerProcess

FORCED = "twinmq_federation_dedup_forced_total"
WINDOW = 20
# 100 times the window, 10 times the former stretch (10x the window): that window forgot
# keys while B -> C was cut and let their late copies through (the first test fails with
# main's dedup.py from before the bitmaps).
LATE = 100 * WINDOW


def forced(broker: BrokerProcess) -> float:
    """Keys the broker's window forgot while a link had not passed them."""
    return metric_samples(broker.admin.metrics(timeout=5)).get(FORCED, 0.0)


def test_a_path_lagging_a_hundred_times_the_window_brings_no_second_copy(
    tmp_path: Path,
) -> None:
    with triangle(tmp_path, "fanout", "", {"dedup-window": WINDOW}) as shape:
        lag_path_via_b(shape, warm_up=10, late=LATE)
        assert forced(shape.c) == 0


def test_a_restart_while_a_path_lags_a_hundred_times_the_window_brings_no_second_copy(
    tmp_path: Path,
) -> None:
    """C restarted while B -> C is cut: the lagged keys come back from the journal's
    snapshot records, and B's late copies are still dropped."""
    with triangle(tmp_path, "fanout", "", {"dedup-window": WINDOW}) as shape:
        lag_path_via_b(shape, warm_up=10, late=LATE, restart_c=True)
        assert forced(shape.c) == 0
