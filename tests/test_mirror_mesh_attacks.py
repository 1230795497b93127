"""Attacks on the full mesh (docs/mirror.md "Full mesh") as an unlucky operator would make
them, on real sites through pika: a confirmed message must reach every site exactly once."""

from __future__ import annotations

from pathlib import Path

from mirrorsites import Mesh, browse, mirror_status, publish
from test_mirror_mesh import at, bodies, converged, targets

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for


def without_target(site: BrokerProcess, address: str) -> list[str]:
    """`site`'s arguments without `--mirror-to address` (the operator drops a target)."""
    args = list(site.extra_args)
    i = args.index(address)
    assert args[i - 1] == "--mirror-to"
    return args[: i - 1] + args[i + 1 :]


def test_a_target_dropped_then_named_again_gets_what_was_trimmed_while_it_was_not_listed(
    tmp_path: Path,
) -> None:
    """C leaves A's list (A restarted without it), A's events meanwhile go to B alone and
    are trimmed once B has them; C named again (A restarted) must get them: its mark is
    below what was trimmed, so it needs the announcement, not a resume after its mark."""
    with Mesh(tmp_path, 3) as mesh:
        a, b, c = mesh.sites
        publish(a, "relisted", bodies("before", 10))
        converged(mesh, "relisted", 10)
        c_address = targets(a)["site-c"]["target"]
        full = list(a.extra_args)
        c.stop()
        a.stop()
        a.extra_args = without_target(a, c_address)
        a.start()
        publish(a, "relisted", bodies("unlisted", 20))
        at([a, b], "relisted", 30)
        # Trimmed: B has them all (and C, not listed, holds nothing back).
        wait_for("A's queue trimmed", lambda: (mirror_status(a) or {}).get("queue_events") == 0)
        a.stop()
        a.extra_args = full
        a.start()
        c.start()
        publish(a, "relisted", bodies("after", 5))
        # A's link to C streams and C acknowledges: nothing is left for it on A...
        wait_for("C linked", lambda: bool(targets(a)["site-c"]["connected"]))
        mesh.caught_up()
        expected = sorted(bodies("before", 10) + bodies("unlisted", 20) + bodies("after", 5))
        for site in mesh.sites:
            # ...so C holds every message A confirmed, once.
            assert sorted(browse(site, "relisted")) == expected, site.name
