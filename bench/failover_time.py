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
per run, and each run's timeline from the kill (`--timeline`, on by default): the
broker container seen stopped or restarted in the pod's status, the operator woken,
its decision, the backup active (POST /role answered), the virtual IP's
EndpointSlice without the old active and with the new one, the client's refused
connection attempts, its reconnect and the first confirm. The operator's steps are
read from its log (`.cluster/logs/bench-operator.log`), the brokers' (activation,
self-fencing) from their pod logs; all wall-clock timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import logging
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import pika
import yaml

from twinmq.broker.names import AMQP_PORT
from twinmq.client import ReliablePublisher
from twinmq.localcluster import faults
from twinmq.localcluster.examples import example_brokercluster
from twinmq.localcluster.kubeapi import ApiError, KubeApi
from twinmq.localcluster.layout import Layout
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

REPO = Path(__file__).resolve().parent.parent
API = "/apis/twinmq.io/v1alpha1"
OPERATOR_LOG = REPO / ".cluster" / "logs" / "bench-operator.log"
# The operator's log lines that mark a failover's steps (`operator/main.py`).
OPERATOR_STEPS = {
    "woken": re.compile(r"woken by a pod change"),
    "decided": re.compile(r"activating on"),
    "activated": re.compile(r"backup is now active"),
}
# The brokers' log lines that mark a failover's steps (pod logs under .cluster/logs/pods).
BROKER_STEPS = {
    "active": re.compile(r"promoted to active"),
    "FENCED ITSELF": re.compile(r"self-fencing"),
}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


STEP_TIMEOUT = 120.0  # one setup step on a loaded machine


class Timeline:
    """Wall-clock moments of one run's failover, from watches, the client and the operator's
    log; each step keeps its first occurrence after the kill."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, str]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def mark(self, what: str, at: float | None = None) -> None:
        """Record a step (now, unless `at`)."""
        with self.lock:
            self.marks.append((time.time() if at is None else at, what))

    def watch(self, kube: KubeApi, path: str, on_object: Any) -> None:
        """Feed each watch event's object of `path` to `on_object` until stopped."""

        def run() -> None:
            version = str((kube.get(path) or {})["metadata"]["resourceVersion"])
            while not self.stop.is_set():
                for event in kube.watch(path, version, timeout=30):
                    obj = event.get("object") or {}
                    version = obj.get("metadata", {}).get("resourceVersion", version)
                    if event.get("type") != "BOOKMARK":
                        on_object(obj)
                    if self.stop.is_set():
                        return

        threading.Thread(target=run, daemon=True).start()

    def render(self, killed: float) -> str:
        """`step +seconds` in time order, from the kill (taken just before it); each step's
        first occurrence after it."""
        seen: set[str] = set()
        parts = []
        for at, what in sorted(self.marks):
            key = what.split(" (")[0]
            if at < killed or key in seen:
                continue
            seen.add(key)
            parts.append(f"{what} {at - killed:+.2f}")
        return ", ".join(parts)


def logged_steps(
    path: Path,
    prefix: str,
    steps: dict[str, re.Pattern[str]],
    since: float,
    timeline: Timeline,
    only: str = "",
) -> None:
    """Add the steps logged in `path` after `since` (in lines containing `only`)."""
    if not path.exists():
        return
    with path.open(errors="replace") as f:
        for line in f:
            match = LOG_TIME.match(line.removeprefix("["))
            if only not in line or match is None:
                continue
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if at < since:
                continue
            for step, pattern in steps.items():
                if pattern.search(line):
                    timeline.mark(f"{prefix} {step}", at)


def operator_and_broker_steps(namespace: str, since: float, timeline: Timeline) -> None:
    """Add the operator's steps for `namespace` and its brokers' to the timeline."""
    logged_steps(OPERATOR_LOG, "operator", OPERATOR_STEPS, since, timeline, only=namespace)
    for broker in ("primary", "backup"):
        for path in (REPO / ".cluster" / "logs" / "pods").glob(
            f"{namespace}_*-{broker}_broker.log"
        ):
            logged_steps(path, broker, BROKER_STEPS, since, timeline)


class ClientLog(logging.Handler):
    """The publisher's lost connection and refused connection attempts, into the timeline."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__(logging.INFO)
        self.timeline = timeline

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "not confirmed" in message:
            self.timeline.mark("client lost its connection", record.created)
        elif "unavailable" in message:
            why = message.split("(", 1)[-1].split(")")[0][:60]
            self.timeline.mark(f"client refused ({why})", record.created)


class Run:
    """One run's figures."""

    def __init__(
        self, seconds: float, confirmed: int, received: list[int], reason: str, timeline: str
    ) -> None:
        self.seconds = seconds
        self.timeline = timeline
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

        wait_for("cluster in sync", in_sync, timeout=STEP_TIMEOUT)
        path = f"{API}/namespaces/{namespace}/brokerclusters/{name}"
        active = ((kube.get(path) or {}).get("status") or {})["activeBroker"]
        secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-auth") or {}
        data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
        ip = (kube.get(f"/api/v1/namespaces/{namespace}/services/{name}") or {})["spec"][
            "clusterIP"
        ]
        url = f"amqp://{data['username']}:{data['password']}@{ip}:{AMQP_PORT}/%2F"

        def declared() -> bool:
            # A new Service may not be programmed by kube-proxy yet: refused, then served.
            try:
                conn = pika.BlockingConnection(pika.URLParameters(url))
            except pika.exceptions.AMQPConnectionError:
                return False
            conn.channel().queue_declare("bench", durable=True)
            conn.close()
            return True

        wait_for("the virtual IP serves", declared, timeout=60)
        marks: dict[str, float] = {}
        timeline = Timeline()
        ips = {
            str(((kube.get(f"/api/v1/namespaces/{namespace}/pods/{name}-{b}") or {})
                 .get("status") or {}).get("podIP")): b
            for b in ("primary", "backup")
        }  # fmt: skip

        def on_pod(pod: dict[str, Any]) -> None:
            if pod.get("metadata", {}).get("name") != f"{name}-{active}":
                return
            for c in (pod.get("status") or {}).get("containerStatuses") or []:
                if c.get("name") == "broker" and "running" not in (c.get("state") or {}):
                    timeline.mark("pod: broker not running")
                elif c.get("name") == "broker" and int(c.get("restartCount") or 0) > 0:
                    timeline.mark("pod: broker restarted")

        def on_slice(obj: dict[str, Any]) -> None:
            ready = {
                ips.get(a, a)
                for e in obj.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready", True)
                for a in e.get("addresses") or []
            }
            if active not in ready:
                timeline.mark("VIP: old active out")
            if ready - {active}:
                timeline.mark(f"VIP: {'+'.join(sorted(ready))} in")

        timeline.watch(kube, f"/api/v1/namespaces/{namespace}/pods", on_pod)
        timeline.watch(
            kube, f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
            lambda obj: on_slice(obj)
            if obj.get("metadata", {}).get("labels", {}).get("kubernetes.io/service-name") == name
            else None,
        )  # fmt: skip
        client_log = ClientLog(timeline)
        logging.getLogger("twinmq.client.publisher").addHandler(client_log)
        logging.getLogger("twinmq.client.publisher").setLevel(logging.INFO)

        async def traffic() -> int:
            publisher = ReliablePublisher([url], reconnect_delay=0.05, give_up_after=120)
            confirmed = 0
            while "after" not in marks or confirmed < marks["kill_at"] + 50:
                await publisher.publish(
                    str(confirmed).encode(), "bench", message_id=f"m-{confirmed}"
                )
                confirmed += 1
                if confirmed == 100:
                    marks["killed_wall"] = time.time()
                    faults.kill_pod(Layout.default(), namespace, f"{name}-{active}", "broker")
                    marks["killed"] = time.monotonic()
                    marks["kill_at"] = confirmed
                elif "killed" in marks and "after" not in marks and publisher.reconnects:
                    marks["after"] = time.monotonic()
                    timeline.mark("first confirm")
            await publisher.close()
            return confirmed

        try:
            confirmed = asyncio.run(traffic())
        finally:
            logging.getLogger("twinmq.client.publisher").removeHandler(client_log)
            timeline.stop.set()
        received = [int(body) for body in drain(url, "bench")]
        status = (kube.get(path) or {}).get("status") or {}
        reason = (status.get("lastFailover") or {}).get("reason", "?")
        operator_and_broker_steps(namespace, marks["killed_wall"] - 1, timeline)
        return Run(
            marks["after"] - marks["killed"], confirmed, received, reason,
            timeline.render(marks["killed_wall"]),
        )  # fmt: skip
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
    # aiormq logs every refused connection attempt at ERROR: the timeline has them.
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    layout = Layout.default()
    kube = KubeApi(str(layout.kubeconfig))
    crd = yaml.safe_load((REPO / "crds" / "brokercluster.yaml").read_text())
    kube.apply(
        f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}",
        crd, "bench",
    )  # fmt: skip

    def served() -> bool:
        try:
            return kube.get(f"{API}/brokerclusters") is not None
        except ApiError:  # 429 while the API server's storage (re)initialises
            return False

    wait_for("the CRD served", served, timeout=STEP_TIMEOUT)
    OPERATOR_LOG.parent.mkdir(parents=True, exist_ok=True)
    log = open(OPERATOR_LOG, "ab")  # noqa: SIM115
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
            print(f"        {run.timeline}", flush=True)
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
