"""The Kubernetes part of `make demo`: the operator runs a BrokerCluster on the local cluster.

Installs the chart (the operator, least-privilege RBAC, the CRD), applies
`examples/brokercluster.yaml`, sends confirmed traffic through the virtual-IP
Service, kills the active broker with `kill -9`, shows the automatic failover
(who is active, the epoch, nothing lost), recovers to the primary with a
declarative request, lets the operator audit the failover (a Job running the
Spark audit on what both brokers shipped to the S3 store) and prints a short
report. The cluster is left running for `kubectl twinmq status`.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pika

from twinmq.broker.names import AMQP_PORT, PASSIVE
from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults, s3server
from twinmq.localcluster.binaries import find
from twinmq.localcluster.examples import example_brokercluster
from twinmq.localcluster.kubeapi import KubeApi
from twinmq.localcluster.layout import Layout
from twinmq.testing.queues import drain
from twinmq.testing.waiting import accepts, wait_for

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "twinmq-demo"
API = "/apis/twinmq.io/v1alpha1"
MESSAGES = 1500
BUCKET = "twinmq-audits"


STEP_TIMEOUT = 180.0  # one step of the demo on a loaded machine


def audit_image(image: str) -> str:
    """The audit image (JRE + PySpark, `make image-audit`) of the release `image` runs: the
    broker image has no Spark."""
    return f"twinmq/twinmq-audit:{image.rpartition(':')[2]}"


def say(text: str) -> None:
    """One line of the story."""
    print(f"[cluster-demo] {text}", flush=True)


class Demo:
    """The demo's state: the API, the cluster's names."""

    def __init__(self) -> None:
        self.layout = Layout.default()
        self.kube = KubeApi(str(self.layout.kubeconfig))
        example = example_brokercluster()
        example["spec"]["audit"] = {
            "enabled": True, "storeUrl": f"s3://{BUCKET}/{example['metadata']['name']}",
            "storeSecretName": "audit-store", "segmentSeconds": 5, "afterFailover": True,
            "launcher": "job", "image": audit_image(str(example["spec"]["image"])),
        }  # fmt: skip
        self.example = example
        self.name = str(example["metadata"]["name"])
        self.path = f"{API}/namespaces/{NAMESPACE}/brokerclusters/{self.name}"

    def status(self) -> dict[str, Any]:
        return dict((self.kube.get(self.path) or {}).get("status") or {})

    def helm(self, *args: str) -> None:
        env = {"KUBECONFIG": str(self.layout.kubeconfig), "HOME": "/tmp/twinmq-demo-helm",
               "PATH": "/usr/bin:/bin"}  # fmt: skip
        subprocess.run([str(find("helm")), *args], check=True, env=env, capture_output=True)

    def install(self) -> None:
        if self.kube.get(f"/api/v1/namespaces/{NAMESPACE}") is not None:
            say(f"removing the previous demo's namespace {NAMESPACE}")
            if self.kube.get(self.path) is not None:
                self.kube.delete(self.path)
                wait_for(
                    "the old BrokerCluster to go",
                    lambda: self.kube.get(self.path) is None,
                    timeout=STEP_TIMEOUT,
                )
            self.helm("uninstall", "twinmq", "-n", NAMESPACE, "--ignore-not-found")
            self.kube.delete(f"/api/v1/namespaces/{NAMESPACE}")
            wait_for(
                "the old namespace to go",
                lambda: self.kube.get(f"/api/v1/namespaces/{NAMESPACE}") is None,
                timeout=STEP_TIMEOUT,
            )
        self.helm("install", "twinmq", str(REPO / "helm" / "twinmq"), "-n", NAMESPACE,
                  "--create-namespace", "--set", "operator.rbac.scope=namespace",
                  "--wait", "--timeout", "120s")  # fmt: skip
        say(f"chart installed in namespace {NAMESPACE}: the operator is running")
        # The store: moto as a host process on the node's address (no image carries moto),
        # behind a Service without selector, as in the e2e suite; `make cluster-down` stops it.
        port = s3server.start_daemon(self.layout)
        service, endpoints = s3server.host_manifests(port)
        url = s3server.endpoint(
            self.kube.create(f"/api/v1/namespaces/{NAMESPACE}/services", service)
        )
        self.kube.create(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
                         endpoints)  # fmt: skip
        self.kube.create(f"/api/v1/namespaces/{NAMESPACE}/secrets",
                         s3server.store_secret("audit-store", url))  # fmt: skip
        wait_for("the S3 store", lambda: s3server.try_create_bucket(url, BUCKET), timeout=60)
        say(f"audit store: s3://{BUCKET} on an S3-compatible server at {url}")

    def create(self) -> None:
        self.kube.create(f"{API}/namespaces/{NAMESPACE}/brokerclusters", self.example)

        def in_sync() -> bool:
            s = self.status()
            conditions = {c["type"]: c["status"] for c in s.get("conditions", [])}
            return s.get("phase") == "Ready" and conditions.get("Replicating") == "True"

        started = time.monotonic()
        wait_for("the BrokerCluster to be Ready and replicating", in_sync, timeout=STEP_TIMEOUT)
        # Ready says the brokers are; the virtual IP answers once kube-proxy caught up.
        wait_for("the virtual IP to answer", lambda: accepts(self.virtual_ip(), AMQP_PORT),
                 timeout=STEP_TIMEOUT)  # fmt: skip
        s = self.status()
        say(
            f"BrokerCluster {self.name} Ready in {time.monotonic() - started:.1f}s: "
            f"{s['activeBroker']} active in epoch {s['epoch']}, the other passive and in sync"
        )

    def url(self) -> str:
        secret = self.kube.get(f"/api/v1/namespaces/{NAMESPACE}/secrets/{self.name}-auth") or {}
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        return f"amqp://{data['username']}:{data['password']}@{self.virtual_ip()}:{AMQP_PORT}/%2F"

    def virtual_ip(self) -> str:
        """The cluster IP of the BrokerCluster's virtual-IP Service."""
        service = self.kube.get(f"/api/v1/namespaces/{NAMESPACE}/services/{self.name}") or {}
        return str(service["spec"]["clusterIP"])

    def traffic_through_failover(self, url: str) -> dict[str, float]:
        marks: dict[str, float] = {}

        async def run() -> None:
            publisher = ReliablePublisher([url], reconnect_delay=0.05, give_up_after=120)
            for i in range(MESSAGES):
                await publisher.publish(str(i).encode(), "orders", message_id=f"order-{i}")
                if i == MESSAGES // 3:
                    active = self.status()["activeBroker"]
                    faults.kill_pod(self.layout, NAMESPACE, f"{self.name}-{active}")
                    marks["killed"] = time.monotonic()
                    say(f"kill -9 of the active broker ({active}) after {i + 1} confirms")
                elif "killed" in marks and "first" not in marks and publisher.reconnects:
                    marks["first"] = time.monotonic()
            marks["resends"] = publisher.resends
            await publisher.close()

        asyncio.run(run())
        return marks

    def recover(self) -> float:
        started = time.monotonic()
        self.kube.patch(self.path, {"spec": {"requests": {"recover": {"id": "demo-recover-1"}}}})
        wait_for("recovery to the primary",
             lambda: self.status().get("handledRequests", {}).get("recover") == "demo-recover-1"
             and self.status().get("activeBroker") == "primary", timeout=STEP_TIMEOUT)  # fmt: skip
        return time.monotonic() - started

    def audit(self, epoch: int) -> str:
        """Wait for the operator's audit of the failovers up to `epoch`; its verdict line."""
        say("waiting for the operator to audit the failover (once both brokers are in sync)")

        seen: set[tuple[str, str]] = set()

        def done() -> dict[str, Any] | None:
            s = self.status()
            last = s.get("lastAudit") or {}
            run, verdict = str(last.get("run")), str(last.get("verdict"))
            if last and (run, verdict) not in seen:  # progress: each run and its verdict once
                seen.add((run, verdict))
                say(f"  audit run {run} ({last.get('reason')}): {verdict}")
            audited = (s.get("audit") or {}).get("auditedEpoch", 0) >= epoch
            return last if audited and last.get("verdict") not in (None, "RUNNING") else None

        # One Spark run per failover and recovery, one after the other: a minute each on a
        # quiet machine, several on a loaded one.
        last = wait_for("the audit of the failover", done, timeout=900)
        say(f"audit run {last['run']} ({last['reason']}): {last['verdict']}")
        return (
            f"{last['verdict']}: {last['messages']} messages, lost {last['lost']}, "
            f"duplicates {last['duplicates']}, reordered {last['reordered']}"
        )


def main() -> None:
    """Run the Kubernetes demo."""
    for noisy in ("aiormq", "aio_pika", "pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    demo = Demo()
    demo.install()
    demo.create()
    url = demo.url()
    conn = pika.BlockingConnection(pika.URLParameters(url))
    conn.channel().queue_declare("orders", durable=True)
    conn.close()
    marks = demo.traffic_through_failover(url)
    wait_for(
        "the failover to settle",
        lambda: demo.status().get("activeBroker") == "backup",
        timeout=STEP_TIMEOUT,
    )
    after = demo.status()
    say(
        f"failover: {after['activeBroker']} active in epoch {after['epoch']} "
        f"({after.get('lastFailover', {}).get('reason', '')})"
    )
    wait_for("the old primary back as a ready passive", lambda: any(
        b["name"] == "primary" and b["role"] == PASSIVE and b["ready"]
        for b in demo.status().get("brokers", [])), timeout=STEP_TIMEOUT)  # fmt: skip
    say("the primary came back passive and caught up from the backup")
    recovery = demo.recover()
    final = demo.status()
    say(
        f"recovered: primary active in epoch {final['epoch']} ({recovery:.1f}s: backup "
        "demoted first, primary activated once it reported passive)"
    )
    received = [int(body) for body in drain(url, "orders")]
    lost = len(set(range(MESSAGES)) - set(received))
    duplicates = len(received) - len(set(received))
    verdict = demo.audit(final["epoch"])
    print()
    print("TwinMQ on Kubernetes: report")
    print(f"  messages confirmed through the VIP   {MESSAGES}")
    print(f"  kill -9 to first confirm (failover)  {marks['first'] - marks['killed']:.2f}s")
    print(f"  re-sent by the publisher             {int(marks['resends'])}")
    print(f"  lost confirmed messages              {lost}")
    print(f"  duplicates                           {duplicates}")
    print(f"  epochs                               1 -> {after['epoch']} -> {final['epoch']}")
    print(f"  replication audit                    {verdict}")
    print(f"  try: source .cluster/env && kubectl twinmq status -n {NAMESPACE}")
    if lost or duplicates or not verdict.startswith("PASS"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
