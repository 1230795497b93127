"""DR switchover, failover and fencing between two real sites (docs/mirror.md, "Switchover").

Each site has both ends (`reversible`): A starts as the source, B as its
read-only replica. A controlled switchover (demote A, promote B with A's token)
loses nothing and makes A a mirror of B; failback reverses it again. A forced
promotion reports its RPO; the old source is fenced as soon as it reaches the
promoted site. Clients always use pika.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, channel, demote, mirror_status, promote, publish, queues

from twinmq.broker.admin_client import MirrorRefused, mirror_promote_call
from twinmq.broker.api import DemotionToken, MirrorPromoteRequest
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    with Sites(tmp_path, reversible=True) as started:
        yield started


def publish_refusal(broker: BrokerProcess) -> str | None:
    """The reply text of a refused persistent publish on `broker` (None if it was accepted)."""
    connection, ch = channel(broker)
    try:
        ch.confirm_delivery()
        ch.basic_publish("", "orders", b"probe", PERSISTENT)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 403
        return str(exc.reply_text)
    finally:
        if connection.is_open:
            connection.close()
    return None


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def test_a_switchover_loses_nothing_fences_the_old_source_and_fails_back(
    sites: Sites,
) -> None:
    sites.mirror.stop()  # a backlog for the demotion to drain
    publish(sites.source, "orders", bodies("a", 300))
    sites.mirror.start()
    connection, ch = channel(sites.source)
    for _ in range(100):  # acks of the last lag window must reach B too
        method, _, _ = ch.basic_get("orders")
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    connection.close()
    started = time.monotonic()
    demoted = demote(sites.source)
    assert demoted.token is not None and demoted.role == "replica"
    assert demoted.token.origin == "site-a" and demoted.token.epoch == 1
    promoted = sites.promote_mirror(demoted.token)
    switchover = time.monotonic() - started
    print(f"switchover (demote + promote through the admin API): {switchover:.3f} s; "
          f"drain {demoted.seconds:.3f} s, promote {promoted.seconds:.3f} s")  # fmt: skip
    assert promoted.role == "source" and promoted.epoch == 1 and not promoted.forced
    # Never two writable sites: the demoted source refuses, the promoted one takes publishes.
    refused = publish_refusal(sites.source)
    assert refused is not None and "site-a-broker is a DR mirror (replica)" in refused
    assert publish_refusal(sites.mirror) is None  # the probe is "b"'s first own message
    assert queues(sites.mirror)["orders"]["messages"] == 201  # 200 of A's + the probe
    # The mirror reversed: B streams to A (A applies only what it lacks).
    publish(sites.mirror, "orders", bodies("b", 50))
    sites.caught_up(source=sites.mirror)
    assert queues(sites.source)["orders"]["messages"] == 251
    assert "mirror: seed (" not in sites.mirror.log_path.read_text()  # only the delta went back
    # Failback, the same way.
    back = demote(sites.mirror)
    assert back.token is not None and back.token.epoch == 2
    assert promote(sites.source, back.token).role == "source"
    assert publish_refusal(sites.mirror) is not None
    wait_for("A streams to B again", lambda: mirror_status(sites.source)["connected"], 30)
    assert drain(sites.source.url, "orders") == [*bodies("a", 300)[100:], b"probe",
                                                 *bodies("b", 50)]  # fmt: skip


def test_switch_requests_are_replay_safe_and_a_stale_token_is_refused(sites: Sites) -> None:
    publish(sites.source, "orders", [b"x"])
    first = demote(sites.source)
    assert demote(sites.source) == first  # the same token again, nothing demoted twice
    assert first.token is not None
    promoted = sites.promote_mirror(first.token)
    assert sites.promote_mirror(first.token) == promoted
    other = first.token.model_copy(update={"seq": first.token.seq + 1000})
    with pytest.raises(MirrorRefused, match="already"):
        sites.promote_mirror(other)
    with pytest.raises(MirrorRefused, match="token, or force"):
        promote(sites.source, None)


def test_a_token_the_mirror_has_not_applied_is_refused(sites: Sites) -> None:
    publish(sites.source, "orders", [b"x"])
    sites.caught_up()
    ahead = DemotionToken(origin="site-a", seq=10**12, epoch=1)
    call = mirror_promote_call(MirrorPromoteRequest(token=ahead, timeout=1))
    with pytest.raises(MirrorRefused, match="not applied up to the token"):
        sites.mirror.admin.send(call, 20)
    assert publish_refusal(sites.mirror) is not None  # still a replica


def test_a_forced_failover_reports_its_rpo_and_the_returning_source_is_fenced(
    sites: Sites,
) -> None:
    publish(sites.source, "orders", bodies("a", 50))
    sites.caught_up()  # "connected": a heartbeat went to B and back
    before = mirror_status(sites.mirror)
    assert before is not None and before["failover_rpo"]["seen_at"] is not None
    sites.source.kill()  # site A is gone
    failover = sites.promote_mirror(force=True)
    assert failover.forced and failover.role == "source" and failover.epoch == 1
    assert failover.rpo is not None
    assert failover.rpo.last_applied_seq > 0
    assert failover.rpo.seen_at is not None  # what B last heard from A, never hidden
    assert failover.rpo.source_unreplicated_seen >= 0
    section = mirror_status(sites.mirror)
    assert section is not None and section["rpo"] == failover.rpo.model_dump(mode="json")
    assert queues(sites.mirror)["orders"]["messages"] == 50
    # Mirrored, each may have been delivered at A: flagged so consumers can tell.
    connection, ch = channel(sites.mirror)
    method, _, _ = ch.basic_get("orders")
    assert method is not None and method.redelivered
    connection.close()
    assert publish_refusal(sites.mirror) is None
    # A returns still believing it is the source: its link meets epoch 1 and fences it.
    sites.source.start()
    wait_for("A fenced", lambda: (mirror_status(sites.source) or {}).get("role") == "replica", 30)
    refused = publish_refusal(sites.source)
    assert refused is not None and "replica" in refused
    assert mirror_status(sites.source)["state"] == "fenced"
