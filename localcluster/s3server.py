"""An S3-compatible server behind a Service: the audit store of the demo and of the e2e
tests. It is moto in server mode, standing in for S3 or MinIO; everything else talks to it
exactly as it would to S3, at the Service's cluster IP.

Two ways to run it, one command (`_command`) and one readiness check (`_wait_until_up`):
- `host_server` (the e2e tests) and `start_daemon` (`make demo`, on both node modes): moto as
  a process of the checkout's venv on the node's address (10.244.0.1, the bridge the pods
  reach the API server and DNS through), behind a selector-less Service whose EndpointSlice
  (`host_manifests`) names that address. No image has to carry moto (the product images
  must not: nothing test-only in them), so it works the same with the node agent and with
  the real kubelet. `host_server` lives as long as its `with` block; the demo's store is a
  daemon of the cluster (`DAEMON`), so the pair the demo leaves running keeps its store
  until `make cluster-down` stops it (or the next `make demo` replaces it).
Where pods cannot reach the host (kind), the store would have to be a pod of an S3 image of
its own (the project's images have no moto); not written, as kind has not been run here.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from twinmq.localcluster import daemons
from twinmq.localcluster.layout import GATEWAY_IP, Layout
from twinmq.testing.launcher import free_port
from twinmq.testing.waiting import accepts, wait_for

PORT = 5000
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "twinmq",
    "AWS_SECRET_ACCESS_KEY": "twinmq-local-s3",
    "AWS_REGION": "us-east-1",
}
"""What the server accepts (moto accepts any; these name the demo's)."""

HOST = GATEWAY_IP
"""Where `host_server` and `start_daemon` listen: the node's address on the pod bridge
(never off the machine)."""
MANAGER = "s3server.twinmq.io"
"""The EndpointSlice's `managed-by`: not the endpoint controller's (it must leave it alone)."""

DAEMON = "s3-store"
"""The demo's store as a daemon of the cluster (`start_daemon`; `make cluster-down` stops it)."""


def _command(port: int) -> list[str]:
    """moto in server mode on `HOST`:`port`, run by this venv's Python (it has moto)."""
    return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]


def _wait_until_up(port: int, exit_code: Callable[[], int | None], log: Path) -> None:
    """Wait until moto accepts on `port`; fail at once if it exited (`exit_code` not None)."""

    def up() -> bool:
        code = exit_code()
        if code is not None:
            raise RuntimeError(f"moto exited with {code}: see {log}")
        return accepts(HOST, port)

    wait_for(f"moto on {HOST}:{port}", up, timeout=60)


@contextlib.contextmanager
def host_server(log: Path) -> Iterator[int]:
    """moto on `HOST` as a process of this venv (output to `log`) until the block ends; yields
    its port (a free one: the demo's or another suite's server may hold another)."""
    port = free_port(HOST)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            _command(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        _wait_until_up(port, proc.poll, log)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_daemon(layout: Layout) -> int:
    """(Re)start the store as the cluster's daemon `DAEMON` on a free port of `HOST`, empty
    (a previous one is stopped: its buckets belonged to the previous demo); return the port.
    It outlives the caller; `make cluster-down` (`stop_daemon`) stops it."""
    stop_daemon(layout)
    port = free_port(HOST)
    pid = daemons.start(layout, DAEMON, _command(port))

    def exit_code() -> int | None:
        return None if daemons.read_pid(layout, DAEMON) == pid else 1

    _wait_until_up(port, exit_code, layout.logs / f"{DAEMON}.log")
    return port


def stop_daemon(layout: Layout) -> bool:
    """Stop the demo's store if it runs; return whether it did."""
    return daemons.stop(layout, DAEMON, timeout=10)


def host_manifests(port: int, name: str = "s3") -> list[dict[str, Any]]:
    """A Service without selector on `PORT` and the EndpointSlice that sends it to
    `host_server`'s port on the node (kube-proxy DNATs pods' and the host's connections)."""
    return [
        {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"ports": [{"name": "s3", "port": PORT, "targetPort": port}]},
        },
        {
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-host", "labels": {
                "kubernetes.io/service-name": name,
                "endpointslice.kubernetes.io/managed-by": MANAGER,
            }},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [HOST], "conditions": {"ready": True}}],
            "ports": [{"name": "s3", "port": port, "protocol": "TCP"}],
        },
    ]  # fmt: skip


def endpoint(service: dict[str, Any]) -> str:
    """The server's URL at its Service's cluster IP (reachable from pods and from the host,
    where the demo and the tests run, without cluster DNS)."""
    return f"http://{service['spec']['clusterIP']}:{PORT}"


def store_secret(name: str, url: str) -> dict[str, Any]:
    """A Secret with the store credentials, as `spec.audit.storeSecretName` expects them."""
    return {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
        "stringData": {**CREDENTIALS, "AWS_ENDPOINT_URL": url},
    }  # fmt: skip


def try_create_bucket(url: str, bucket: str) -> bool:
    """Create a bucket; False while the server cannot be reached yet (callers retry)."""
    import boto3
    import botocore.exceptions

    client = boto3.client(
        "s3", endpoint_url=url, region_name=CREDENTIALS["AWS_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    try:
        client.create_bucket(Bucket=bucket)
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectionError):
        return False
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return True
