"""Failover time of a BrokerCluster: `kill -9` of the active to the first confirmed publish
through the virtual IP, over many runs, on the local cluster with default settings.

    .venv/bin/python bench/failover_time.py --runs 20

Each run uses a fresh BrokerCluster (pod restart back-off would otherwise grow),
publishes continuously through the VIP with `twinmq.client.ReliablePublisher`,
kills the active broker's process, and checks afterwards that every confirmed
message is there exactly once. Prints p50/p99/max and the per-run figures.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pika
import yaml

from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.kubeapi import KubeApi
from twinmq.localcluster.layout import Layout

REPO = Path(__file__).resolve().parent.parent
API = "/apis/twinmq.io/v1alpha1"


def wait(what: str, check: Any, timeout: float = 120) -> Any:
    """Poll until `check()` is truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(what)


def one_run(kube: KubeApi, index: int) -> tuple[float, int, int]:
    """(seconds from kill to first confirm after it, confirmed, received) of one run."""
    namespace = f"failover-{index}-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    try:
        example = yaml.safe_load((REPO / "examples" / "brokercluster.yaml").read_text())
        kube.create(f"{API}/namespaces/{namespace}/brokerclusters", example)
        name = example["metadata"]["name"]

        def in_sync() -> bool:
            obj = kube.get(f"{API}/namespaces/{namespace}/brokerclusters/{name}") or {}
            status = obj.get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            return status.get("phase") == "Ready" and conditions.get("Replicating") == "True"

        wait("cluster in sync", in_sync)
        secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        ip = (kube.get(f"/api/v1/namespaces/{namespace}/services/{name}") or {})["spec"][
            "clusterIP"
        ]
        url = f"amqp://{data['username']}:{data['password']}@{ip}:5672/%2F"
        conn = pika.BlockingConnection(pika.URLParameters(url))
        conn.channel().queue_declare("bench", durable=True)
        conn.close()
        marks: dict[str, float] = {}

        async def traffic() -> int:
            publisher = ReliablePublisher([url], reconnect_delay=0.05, give_up_after=120)
            confirmed = 0
            while "after" not in marks or confirmed < marks["kill_at"] + 50:
                await publisher.publish(
                    str(confirmed).encode(), "bench", message_id=f"m-{confirmed}"
                )
                confirmed += 1
                if confirmed == 100:
                    faults.kill_pod(Layout.default(), namespace, f"{name}-primary")
                    marks["killed"] = time.monotonic()
                    marks["kill_at"] = confirmed
                elif "killed" in marks and "after" not in marks and publisher.reconnects:
                    marks["after"] = time.monotonic()
            await publisher.close()
            return confirmed

        confirmed = asyncio.run(traffic())
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        received = 0
        while ch.basic_get("bench", auto_ack=True)[0] is not None:
            received += 1
        conn.close()
        return marks["after"] - marks["killed"], confirmed, received
    finally:
        kube.delete(f"/api/v1/namespaces/{namespace}")


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def main() -> None:
    """Run the measurement and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    layout = Layout.default()
    kube = KubeApi(str(layout.kubeconfig))
    crd = yaml.safe_load((REPO / "crds" / "brokercluster.yaml").read_text())
    kube.apply(
        f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
        crd, "bench",
    )  # fmt: skip
    log = open(REPO / ".cluster" / "logs" / "bench-operator.log", "ab")  # noqa: SIM115
    operator = subprocess.Popen(
        [sys.executable, "-m", "twinmq.operator.main"], stdout=log, stderr=log,
        env={"KUBECONFIG": str(layout.kubeconfig), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    times: list[float] = []
    lost = 0
    try:
        for index in range(args.runs):
            seconds, confirmed, received = one_run(kube, index)
            times.append(seconds)
            lost += max(0, confirmed - received)
            print(
                f"run {index + 1:2d}: {seconds:5.2f}s kill -9 -> first confirm, "
                f"{confirmed} confirmed, {received} received",
                flush=True,
            )
    finally:
        operator.terminate()
        operator.wait(15)
    print(
        f"runs {len(times)}: p50 {statistics.median(times):.2f}s, "
        f"p99 {percentile(times, 99):.2f}s, max {max(times):.2f}s, lost {lost}"
    )


if __name__ == "__main__":
    main()
