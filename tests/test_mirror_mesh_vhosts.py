"""The full mesh carries every virtual host (docs/mirror.md, "Virtual hosts", "Full mesh").

Three real sites naming each other (`mirrorsites.Mesh`), one users file declaring `/`,
`v1` and `v2`, pika clients with publisher confirms: one message per site per vhost, in
a queue of the same name in `/` and `v1`, reaches the two other sites once (nothing
forwarded, nothing looped), an ack on one site settles the message on the two others in
its vhost only, a vhost's queue deleted on one site is gone on all three, and a site
killed while the two others publish in `v1` catches up with each message once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mirrorsites import Mesh, metric
from test_mirror_bidi_vhosts import converged as every_site_holds
from test_mirror_bidi_vhosts import publish_one_by_one
from test_mirror_vhosts import bodies, consume, held, users, vhosts
from test_vhosts import connect, publish


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    with Mesh(tmp_path, extra_args=["--users-file", users(tmp_path / "users.json")]) as sites:
        yield sites


def converged(mesh: Mesh, expected: dict[tuple[str, str], int]) -> None:
    """Wait until every site holds `expected` messages per (vhost, queue) (no other client
    queue) and nothing is in flight; nothing was forwarded or looped on the way."""
    every_site_holds(mesh, expected)
    for site in mesh.sites:
        assert (metric(site, "twinmq_mirror_forwarded_events_total") or 0.0) == 0.0
        assert (metric(site, "twinmq_mirror_looped_events_total") or 0.0) == 0.0


def test_one_message_per_site_per_vhost_reaches_the_two_others_once(mesh: Mesh) -> None:
    for site in mesh.sites:
        publish(site, "/", "mesh", [f"{site.name}-root".encode()])
        publish(site, "v1", "mesh", [f"{site.name}-v1".encode()])
    converged(mesh, {("/", "mesh"): 3, ("v1", "mesh"): 3})
    names = [site.name for site in mesh.sites]
    for site in mesh.sites:
        assert sorted(held(site, "/", "mesh")) == sorted(f"{n}-root".encode() for n in names)
        assert sorted(held(site, "v1", "mesh")) == sorted(f"{n}-v1".encode() for n in names)
        assert all(v["mirrored"] for v in vhosts(site).values())
    # C acks v1's three (one of each origin): settled on A and B, in v1 only.
    a, b, c = mesh.sites
    assert len(set(consume(c, "v1", "mesh", 3))) == 3
    converged(mesh, {("/", "mesh"): 3, ("v1", "mesh"): 0})
    # B deletes v1's queue: gone everywhere, `/`'s of that name kept.
    conn = connect(b, "admin", "v1")
    conn.channel().queue_delete("mesh")
    conn.close()
    converged(mesh, {("/", "mesh"): 3})
    assert sorted(held(a, "/", "mesh")) == sorted(f"{n}-root".encode() for n in names)


def test_a_site_killed_while_the_others_publish_in_a_vhost_catches_up_each_message_once(
    mesh: Mesh,
) -> None:
    a, b, c = mesh.sites
    publish(c, "v1", "stream", bodies("c", 20))
    mesh.caught_up()
    publish_one_by_one(a, "v1", "stream", bodies("a", 300), kill=c)
    publish_one_by_one(b, "v1", "stream", bodies("b", 100))
    publish(b, "/", "stream", bodies("b-root", 5))
    c.start()
    converged(mesh, {("v1", "stream"): 420, ("/", "stream"): 5})
    expected = sorted(bodies("a", 300) + bodies("b", 100) + bodies("c", 20))
    for site in mesh.sites:
        assert sorted(held(site, "v1", "stream")) == expected
        assert held(site, "/", "stream") == bodies("b-root", 5)
