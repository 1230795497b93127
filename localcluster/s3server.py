"""An S3-compatible server as a pod and a Service: the audit store of the demo and of the e2e
tests. It is moto in server mode, standing in for S3 or MinIO (no object-store image can run
on the process-backed node); everything else talks to it exactly as it would to S3."""

from __future__ import annotations

from typing import Any

PORT = 5000
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "twinmq",
    "AWS_SECRET_ACCESS_KEY": "twinmq-local-s3",
    "AWS_REGION": "us-east-1",
}
"""What the server accepts (moto accepts any; these name the demo's)."""
LABELS = {"app.kubernetes.io/name": "s3"}


def manifests(image: str, name: str = "s3") -> list[dict[str, Any]]:
    """The server's Pod and Service."""
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
