"""Rolling updates end to end: a pod template change reaches both pods, passive first, under
confirmed traffic through the virtual IP; a new image that cannot run stops the rollout.

On the local cluster's process-backed node every tag of `twinmq/twinmq` runs this
checkout's console scripts, so a new tag is a real new pod template that a real
broker runs; any other image fails to "pull" (ErrImagePull), as a bad image does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_path,
    cluster_status,
    condition,
    create_cluster,
    drain,
    publish_confirmed,
    reasons_when,
)
from support import IMAGE, Cluster, pod_path

from twinmq.client import ReliablePublisher
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
NEW_IMAGE = (
    IMAGE.removeprefix("docker.io/") if IMAGE.startswith("docker.io/") else f"docker.io/{IMAGE}"
)
"""Another spelling of the suite's image: a new spec.image for the operator (which rolls
out on any change), the same image for a node (a real one can run only the images it
holds: the suite's, imported or loaded)."""


def images(cluster: Cluster, namespace: str, name: str) -> dict[str, str]:
    """The broker image of each pod (absent pods left out)."""
    out = {}
    for broker in ("primary", "backup"):
        pod = cluster.kube.get(pod_path(namespace, f"{name}-{broker}"))
        if pod is not None:
            out[broker] = pod["spec"]["containers"][0]["image"]
    return out


def rolled_out(cluster: Cluster, namespace: str, name: str, generation: int) -> bool:
    """The rollout of `generation` is complete: observed, both brokers back in sync."""
    s = cluster_status(cluster, namespace, name)
    return (
        s.get("observedGeneration") == generation
        and (s.get("rollout") or {}).get("step") == "Complete"
        and condition(s, "Replicating") == "True"
    )


def test_an_image_change_rolls_out_passive_first_under_confirmed_traffic_losing_nothing(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    url = amqp_url(cluster, namespace, name)
    path = cluster_path(namespace, name)
    publish_confirmed(url, "orders", b"-1")
    drain(url, "orders")
    generation: dict[str, int] = {}
    seen_steps: list[str] = []

    async def traffic() -> tuple[int, ReliablePublisher]:
        publisher = ReliablePublisher([url], reconnect_delay=0.2, give_up_after=120)
        sent = 0
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            await publisher.publish(str(sent).encode(), "orders", message_id=f"o-{sent}")
            sent += 1
            if sent == 200:
                patched = cluster.kube.patch(path, {"spec": {"image": NEW_IMAGE}})
                generation["new"] = patched["metadata"]["generation"]
            if "new" in generation and sent % 20 == 0:
                step = (cluster_status(cluster, namespace, name).get("rollout") or {}).get("step")
                if step and (not seen_steps or seen_steps[-1] != step):
                    seen_steps.append(step)
                if rolled_out(cluster, namespace, name, generation["new"]):
                    break
        await publisher.close()
        return sent, publisher

    sent, publisher = asyncio.run(traffic())
    assert rolled_out(cluster, namespace, name, generation["new"]), "the rollout did not finish"
    received = drain(url, "orders")
    lost = sorted(set(range(sent)) - set(received))
    duplicates = len(received) - len(set(received))
    print(
        f"rollout under traffic: {sent} confirmed, lost {len(lost)}, duplicates {duplicates}, "
        f"client reconnects {publisher.reconnects}, re-sent {publisher.resends}; "
        f"steps {seen_steps}"
    )
    assert not lost, f"confirmed messages lost: {lost[:20]}"
    assert images(cluster, namespace, name) == {"primary": NEW_IMAGE, "backup": NEW_IMAGE}
    status = cluster_status(cluster, namespace, name)
    assert status["activeBroker"] == "backup", "the updated passive took over by switchover"
    assert status["lastFailover"]["reason"] == "promote" and status["epoch"] == 3
    assert status["handledRequests"].get("promote") is None, "the rollout is no user request"
    reasons = reasons_when(cluster, namespace, "RollingUpdate and SwitchedOver Events",
                           lambda r: "RollingUpdate" in r and "SwitchedOver" in r)  # fmt: skip
    assert "FailedOver" not in reasons, "a controlled switchover, not a failover"


def test_a_failing_new_image_stalls_the_rollout_and_the_active_keeps_serving(
    cluster: Cluster, operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    path = cluster_path(namespace, name)
    old_image = images(cluster, namespace, name)["primary"]
    patched = cluster.kube.patch(path, {"spec": {"image": "registry.invalid/not-twinmq:1"}})
    generation = patched["metadata"]["generation"]

    def stalled() -> dict[str, Any] | None:
        s = cluster_status(cluster, namespace, name)
        return s if (s.get("rollout") or {}).get("step") == "Stalled" else None

    status = wait_for("the rollout stalled", stalled, timeout=60)
    assert status["rollout"]["broker"] == "backup"
    assert "ImagePull" in status["rollout"]["message"]  # ErrImagePull, then ImagePullBackOff
    assert condition(status, "Stalled") == "True" and condition(status, "Ready") == "True"
    assert status["activeBroker"] == "primary" and status["epoch"] == 1
    assert status["observedGeneration"] < generation, "a stalled spec is not observed"
    assert images(cluster, namespace, name)["primary"] == old_image, "the active untouched"
    publish_confirmed(amqp_url(cluster, namespace, name), "orders", b"1")
    reasons_when(cluster, namespace, "a RolloutStalled Event", lambda r: "RolloutStalled" in r)

    # Reverting the image rolls the passive back; the primary stays active throughout.
    reverted = cluster.kube.patch(path, {"spec": {"image": old_image}})
    wait_for(
        "the revert rolled out",
        lambda: rolled_out(cluster, namespace, name, reverted["metadata"]["generation"]),
        timeout=90,
    )
    status = cluster_status(cluster, namespace, name)
    assert (status["activeBroker"], status["epoch"]) == ("primary", 1)
    assert images(cluster, namespace, name) == {"primary": old_image, "backup": old_image}
