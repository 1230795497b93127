"""Failover time of a BrokerCluster: `kill -9` of the active to the first confirmed publish
through the virtual IP, over many runs, on the local cluster with default settings.

    .venv/bin/python bench/failover_time.py --runs 20

Each run uses a fresh BrokerCluster (pod restart back-off would otherwise grow),
publishes numbered messages continuously through the VIP with
`twinmq.client.ReliablePublisher`, kills the active broker's process (`kill -9`
of the broker container of the pod the status names active), and checks
afterwards the exact set of messages in the queue: every confirmed number once
(lost and duplicated numbers are counted apart, so a duplicate cannot hide a
loss). Prints p50/p99/max, the operator's failover reason and the machine's load
per run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pika
import yaml

from twinmq.broker.names import AMQP_PORT
from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.examples import example_brokercluster
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


class Run:
    """One run's figures."""

    def __init__(self, seconds: float, confirmed: int, received: list[int], reason: str) -> None:
        self.seconds = seconds
        self.confirmed = confirmed
        self.lost = sorted(set(range(confirmed)) - set(received))
        self.duplicates = len(received) - len(set(received))
        self.unexpected = sorted(set(received) - set(range(confirmed)))
        self.reason = reason


def one_run(kube: KubeApi, index: int) -> Run:
    """Kill the active of a fresh BrokerCluster under load; the figures of that run."""
    namespace = f"failover-{index}-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    try:
        example = example_brokercluster()
        kube.create(f"{API}/namespaces/{namespace}/brokerclusters", example)
        name = example["metadata"]["name"]

        def in_sync() -> bool:
            obj = kube.get(f"{API}/namespaces/{namespace}/brokerclusters/{name}") or {}
            status = obj.get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
            return status.get("phase") == "Ready" and conditions.get("Replicating") == "True"

        wait("cluster in sync", in_sync)
        path = f"{API}/namespaces/{namespace}/brokerclusters/{name}"
        active = ((kube.get(path) or {}).get("status") or {})["activeBroker"]
        secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        ip = (kube.get(f"/api/v1/namespaces/{namespace}/services/{name}") or {})["spec"][
            "clusterIP"
        ]
        url = f"amqp://{data['username']}:{data['password']}@{ip}:{AMQP_PORT}/%2F"
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
                    faults.kill_pod(Layout.default(), namespace, f"{name}-{active}", "broker")
                    marks["killed"] = time.monotonic()
                    marks["kill_at"] = confirmed
                elif "killed" in marks and "after" not in marks and publisher.reconnects:
                    marks["after"] = time.monotonic()
            await publisher.close()
            return confirmed

        confirmed = asyncio.run(traffic())
        conn = pika.BlockingConnection(pika.URLParameters(url))
        ch = conn.channel()
        received: list[int] = []
        while True:
            method, _props, body = ch.basic_get("bench", auto_ack=True)
            if method is None:
                break
            received.append(int(body))
        conn.close()
        status = (kube.get(path) or {}).get("status") or {}
        reason = (status.get("lastFailover") or {}).get("reason", "?")
        return Run(marks["after"] - marks["killed"], confirmed, received, reason)
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
    runs: list[Run] = []
    try:
        for index in range(args.runs):
            run = one_run(kube, index)
            runs.append(run)
            print(
                f"run {index + 1:2d}: {run.seconds:5.2f}s kill -9 -> first confirm, "
                f"{run.confirmed} confirmed, {len(run.lost)} lost, {run.duplicates} duplicates, "
                f"{len(run.unexpected)} unexpected; {run.reason}; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    finally:
        operator.terminate()
        operator.wait(15)
    times = [r.seconds for r in runs]
    print(
        f"runs {len(times)}: p50 {statistics.median(times):.2f}s, "
        f"p99 {percentile(times, 99):.2f}s, max {max(times):.2f}s, "
        f"lost {sum(len(r.lost) for r in runs)}, duplicates {sum(r.duplicates for r in runs)}, "
        f"unexpected {sum(len(r.unexpected) for r in runs)}"
    )


if __name__ == "__main__":
    main()
