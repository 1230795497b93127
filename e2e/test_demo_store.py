"""`make demo`'s audit store: moto as a daemon of the local cluster on the node's address,
behind a Service without selector (`s3server.start_daemon`), as the e2e audit tests' store
is (`s3server.host_server`). It runs on both node modes because no image has to carry moto.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import Cluster, new_namespace

from twinmq.localcluster import daemons, s3server
from twinmq.localcluster.layout import Layout
from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


def _buckets(url: str) -> set[str]:
    import boto3

    client = boto3.client(
        "s3", endpoint_url=url, region_name=s3server.CREDENTIALS["AWS_REGION"],
        aws_access_key_id=s3server.CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3server.CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    return {bucket["Name"] for bucket in client.list_buckets()["Buckets"]}


def test_the_demo_store_serves_through_its_service_starts_empty_again_and_stops(
    cluster: Cluster, tmp_path: Path
) -> None:
    if not cluster.local:
        pytest.skip("the store listens on the local cluster's node address")
    # Its own pid and log folders: a demo's store of this checkout is left alone.
    layout = Layout(tmp_path / "cluster")
    namespace = new_namespace(cluster, "e2e-store")
    kube = cluster.kube
    try:
        port = s3server.start_daemon(layout)
        first = daemons.read_pid(layout, s3server.DAEMON)
        service, endpoints = s3server.host_manifests(port)
        url = s3server.endpoint(kube.create(f"/api/v1/namespaces/{namespace}/services", service))
        kube.create(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices", endpoints)
        wait_for("a bucket made through the Service",
                 lambda: s3server.try_create_bucket(url, "demo"), 30)  # fmt: skip
        assert _buckets(url) == {"demo"}

        # A second demo replaces the store: the old daemon is gone, the new one is empty.
        port = s3server.start_daemon(layout)
        assert daemons.read_pid(layout, s3server.DAEMON) not in (None, first)
        assert first is not None and daemons.process_start_time(first) is None
        assert _buckets(f"http://{s3server.HOST}:{port}") == set()

        # What `make cluster-down` calls.
        second = daemons.read_pid(layout, s3server.DAEMON)
        assert s3server.stop_daemon(layout)
        assert second is not None and daemons.process_start_time(second) is None
        assert not s3server.stop_daemon(layout)
    finally:
        s3server.stop_daemon(layout)
        kube.delete(f"/api/v1/namespaces/{namespace}")
