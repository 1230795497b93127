"""An S3-compatible server behind a Service: the audit store of the demo and of the e2e
tests. It is moto in server mode, standing in for S3 or MinIO; everything else talks to it
exactly as it would to S3, at the Service's cluster IP.

Two ways to run it:
- `host_server` + `host_manifests` (the e2e tests, on both node modes): moto as a process
  of the checkout's venv on the node's address (10.244.0.1, the bridge the pods reach the
  API server and DNS through), behind a selector-less Service whose EndpointSlice names that
  address. No image has to carry moto (the product images must not: nothing test-only in
  them), so it works the same with the node agent and with the real kubelet.
- `manifests` (the demo): moto as a pod of the project's image. Only the node agent can run
  it (it maps the image to the checkout's venv, which has moto); it is also the shape a
  cluster whose host pods cannot reach (kind) would need, with an S3 image of its own.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from twinmq.localcluster.layout import GATEWAY_IP
from twinmq.testing.launcher import free_port
from twinmq.testing.waiting import accepts, wait_for

PORT = 5000
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "twinmq",
    "AWS_SECRET_ACCESS_KEY": "twinmq-local-s3",
    "AWS_REGION": "us-east-1",
}
"""What the server accepts (moto accepts any; these name the demo's)."""
LABELS = {"app.kubernetes.io/name": "s3"}


def manifests(image: str, name: str = "s3") -> list[dict[str, Any]]:
    """The server's Pod and Service (the pod runs only where `image` has moto: the node
    agent's mapping of the project image to the checkout's venv)."""
    return [
        {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": LABELS},
            "spec": {"automountServiceAccountToken": False, "containers": [{
                "name": "s3", "image": image,
                "command": ["python", "-m", "moto.server", "-H", "0.0.0.0", "-p", str(PORT)],
                "ports": [{"name": "s3", "containerPort": PORT}],
                "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 1},
            }]},
        },
        {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
            "spec": {"selector": LABELS,
                     "ports": [{"name": "s3", "port": PORT, "targetPort": "s3"}]},
        },
    ]  # fmt: skip


HOST = GATEWAY_IP
"""Where `host_server` listens: the node's address on the pod bridge (never off the machine)."""
MANAGER = "s3server.twinmq.io"
"""The EndpointSlice's `managed-by`: not the endpoint controller's (it must leave it alone)."""


@contextlib.contextmanager
def host_server(log: Path) -> Iterator[int]:
    """moto on `HOST` as a process of this venv (output to `log`) until the block ends; yields
    its port (a free one: the demo's or another suite's server may hold another)."""
    port = free_port(HOST)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"moto exited with {proc.returncode}: see {log}")
            return accepts(HOST, port)

        wait_for(f"moto on {HOST}:{port}", up, timeout=60)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
