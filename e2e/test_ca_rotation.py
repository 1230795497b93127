"""Rotating the operator-managed CA on the local cluster (issue 16; docs/security.md,
"Rotating the managed CA"): requested under confirmed traffic, the three phases reach the
pods through the kubelet's updates of their Secret volumes; the pair stays replicated over
mutual TLS, a client that refreshed the published bundle keeps verifying the broker, and
a failover after the rotation pairs the restarted broker under the new CA, every confirmed
message kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    create_cluster,
    drain,
    in_sync,
    operator_fixture,
    publish_confirmed,
    reasons_when,
)
from support import Cluster
from test_tls_operator import (
    fail_over_over_mutual_tls,
    passive_link_tls,
    published_ca,
    tls_params,
)

from twinmq.client import ReliablePublisher
from twinmq.operator.carotation import CA_GRACE_ENV
from twinmq.testing.waiting import wait_for

# Each phase held 90 s: the kubelet refreshes a Secret volume within about a minute.
GRACE = 90

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rotating_operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    """The operator, holding each phase of a CA rotation 90 s."""
    yield from operator_fixture(cluster, {CA_GRACE_ENV: str(GRACE)})


def round_trip(cluster: Cluster, namespace: str, name: str, ca: Path) -> None:
    """A client trusting `ca` publishes over AMQPS through the virtual IP."""
    connection = pika.BlockingConnection(tls_params(cluster, namespace, name, ca))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare("verified", durable=True)
    channel.basic_publish("", "verified", b"x", pika.BasicProperties(delivery_mode=2))
    connection.close()


@pytest.mark.slow  # three phases of 90 s, then a failover: minutes
@pytest.mark.timeout(900)
def test_ca_rotation_under_traffic_keeps_the_pair_and_its_clients_trusting_each_other(
    cluster: Cluster, rotating_operator: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    for folder in ("before", "staged", "after"):
        (tmp_path / folder).mkdir()
    name = create_cluster(cluster, namespace)
    url = amqp_url(cluster, namespace, name)
    wait_for("the passive's link over mutual TLS",
             lambda: passive_link_tls(cluster_status(cluster, namespace, name)), 60)  # fmt: skip
    before = published_ca(cluster, namespace, name, tmp_path / "before")
    round_trip(cluster, namespace, name, before)
    publish_confirmed(url, "rotating", b"-1")  # declares the durable queue
    drain(url, "rotating")
    phases: list[str] = []

    def phase() -> str:
        rotation = cluster_status(cluster, namespace, name).get("caRotation") or {}
        current = str(rotation.get("phase", ""))
        if current and (not phases or phases[-1] != current):
            phases.append(current)
        return current

    async def traffic() -> tuple[int, ReliablePublisher]:
        publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=120)
        sent = 0
        deadline = time.monotonic() + 4 * GRACE + 300
        while time.monotonic() < deadline:
            await publisher.publish(str(sent).encode(), "rotating", message_id=f"m-{sent}")
            sent += 1
            if sent == 100:
                patch = {"spec": {"requests": {"rotateCa": {"id": "rotate-1"}}}}
                cluster.kube.patch(cluster_path(namespace, name), patch)
            if sent > 100 and sent % 50 == 0:
                if phase() == "Staged" and not (tmp_path / "staged" / "ca.crt").exists():
                    # An application refreshing its copy of the bundle meanwhile.
                    published_ca(cluster, namespace, name, tmp_path / "staged")
                if phases and phases[-1] == "Complete":
                    break
            await asyncio.sleep(0.01)
        await publisher.close()
        return sent, publisher

    sent, publisher = asyncio.run(traffic())
    assert phases[-1:] == ["Complete"], f"the rotation did not complete: {phases}"
    assert "Staged" in phases and "Switched" in phases
    status = cluster_status(cluster, namespace, name)
    assert status["handledRequests"]["rotateCa"] == "rotate-1"
    assert in_sync(status) and passive_link_tls(status)
    refreshed = tmp_path / "staged" / "ca.crt"
    assert refreshed.exists(), "the Staged phase was never seen"
    # The bundle refreshed during the first grace period verifies whatever the broker
    # serves; the final one (the new CA only) once the pod's volume has the new-signed
    # certificate (it was issued a grace period ago).
    round_trip(cluster, namespace, name, refreshed)
    after = published_ca(cluster, namespace, name, tmp_path / "after")
    wait_for("a certificate of the new CA served", lambda: _verifies(
        cluster, namespace, name, after), timeout=180, interval=5)  # fmt: skip
    # A failover: the restarted broker pairs again over mutual TLS under the new CA.
    fail_over_over_mutual_tls(cluster, namespace, name, status["activeBroker"])
    received = drain(url, "rotating")
    lost = sorted(set(range(sent)) - set(received))
    print(f"CA rotated under traffic: {sent} confirmed, lost {len(lost)}, client reconnects "
          f"{publisher.reconnects}; phases {phases}")  # fmt: skip
    assert not lost, f"confirmed messages lost: {lost[:20]}"
    reasons = reasons_when(cluster, namespace, "three CaRotation Events",
                           lambda r: r.count("CaRotation") >= 3)  # fmt: skip
    assert reasons.count("CaRotation") == 3


def _verifies(cluster: Cluster, namespace: str, name: str, ca: Path) -> bool:
    try:
        round_trip(cluster, namespace, name, ca)
    except (pika.exceptions.AMQPError, OSError):
        return False
    return True
