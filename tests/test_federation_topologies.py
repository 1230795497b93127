"""Several federated servers (a ring, a diamond, a mesh) under random link flaps: every
confirmed message reaches every server it should exactly once, with the same `max-hops`
on every link (tests/federationtopologies.py; bench/fed_topologies.py runs the same at
a million messages)."""

from __future__ import annotations

from pathlib import Path

import federationtopologies as ft
import pytest


def test_the_recipients_follow_the_links_that_carry_messages_on() -> None:
    assert ft.recipients(ft.ring(3), "s0", 3) == {"s1", "s2"}
    assert ft.recipients(ft.ring(3), "s0", 1) == {"s1"}
    # s3's second link feeds its own exchange, which nobody federates: s0 still reaches it.
    assert ft.recipients(ft.diamond(), "s0", 4) == {"s1", "s2", "s3"}
    assert ft.recipients(ft.diamond(), "s3", 4) == set()
    assert ft.recipients(ft.mesh(4), "s2", 1) == {"s0", "s1", "s3"}


# The ring (the simplest: no second path to drop) runs in `make soak`, the diamond and
# the mesh in `make test`: the same proof, fewer minutes.
RING = pytest.mark.soak


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "servers"), [pytest.param("ring", 3, marks=RING), ("diamond", 4), ("mesh", 3)]
)
def test_every_confirmed_message_reaches_every_server_once_under_link_flaps(
    tmp_path: Path, name: str, servers: int
) -> None:
    with ft.federated_servers(tmp_path, ft.topology(name, servers)) as mesh:
        outcome = ft.run_traffic(mesh, 3_000, flap_every=0.5, flap_for=0.5)
    print(ft.describe(outcome))
    assert outcome.flaps > 0
    assert outcome.total_lost == 0, ft.describe(outcome)
    assert outcome.total_duplicates == 0, ft.describe(outcome)
    if name != "ring":
        assert outcome.dedup_dropped > 0  # the second paths were there, and dropped


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "servers", "pairs"),
    [pytest.param("ring", 3, ["s1"], marks=RING), ("diamond", 4, ["s1", "s3"])],
)
def test_every_confirmed_message_reaches_every_server_once_across_pair_failovers(
    tmp_path: Path, name: str, servers: int, pairs: list[str]
) -> None:
    """Some servers are pairs and their actives are killed (kill -9) twice while the
    messages flow and the links flap: a pair is a server both upstream (its clients'
    messages and what it carries on) and downstream (its links move to the promoted
    passive), and its dedup window, journaled and replicated, drops what the old active
    had republished but not acknowledged upstream."""
    with ft.federated_servers(tmp_path, ft.topology(name, servers), pairs) as mesh:
        outcome = ft.run_traffic(mesh, 20_000, flap_every=0.5, flap_for=0.5, failovers=2)
    print(ft.describe(outcome))
    assert outcome.failovers == 2, ft.describe(outcome)
    assert outcome.total_lost == 0, ft.describe(outcome)
    assert outcome.total_duplicates == 0, ft.describe(outcome)
