"""The node agent refreshes projected service-account tokens as the kubelet does, against a
real API server (TokenRequest and TokenReview are the API server's own; the pod is stored,
not run: no node is needed to write its volumes)."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from apiserver import KubeApiServer

from twinmq.localcluster.kubeapi import KubeApi
from twinmq.localcluster.layout import GATEWAY_IP, Layout
from twinmq.localcluster.nodeagent.agent import Agent
from twinmq.localcluster.nodeagent.volumes import VolumeBuilder

LIFETIME = 600  # the TokenRequest API's minimum


@pytest.fixture
def agent(kube_apiserver: KubeApiServer, tmp_path: Path) -> Agent:
    """The node agent's API side (TokenRequest, Secrets...), on a layout of its own."""
    return Agent(Layout(tmp_path / "cluster"), str(kube_apiserver.kubeconfig))


def _stored_pod(kube: KubeApi) -> dict[str, Any]:
    """A namespace, a service account and a pod with a projected token volume."""
    namespace = f"tokens-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"metadata": {"name": namespace}})
    kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "app"}})
    pod = {
        "metadata": {"name": "app"},
        "spec": {
            "serviceAccountName": "app",
            "automountServiceAccountToken": False,  # no kube-root-ca.crt: no controllers here
            "containers": [{"name": "app", "image": "twinmq/twinmq:dev"}],
            "volumes": [{"name": "sa", "projected": {"sources": [{"serviceAccountToken": {
                "path": "token", "expirationSeconds": LIFETIME}}]}}],
        },
    }  # fmt: skip
    return kube.create(f"/api/v1/namespaces/{namespace}/pods", pod)


def _authenticated_as(kube: KubeApi, token: str) -> str | None:
    """Whom the API server says the token is (TokenReview), None if it refuses it."""
    review = kube.create(
        "/apis/authentication.k8s.io/v1/tokenreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
         "spec": {"token": token}},
    )  # fmt: skip
    status = review.get("status") or {}
    return status["user"]["username"] if status.get("authenticated") else None


def _builder(agent: Agent, pod: dict[str, Any], tmp_path: Path) -> VolumeBuilder:
    return VolumeBuilder(
        tmp_path / "pod", secrets=agent.secret, config_maps=agent.config_map,
        token=agent.token, claim_path=agent.claim_path, host_ip=GATEWAY_IP,
    )  # fmt: skip


def test_a_projected_token_is_replaced_in_place_once_80_percent_of_its_lifetime_passed(
    agent: Agent, tmp_path: Path
) -> None:
    pod = _stored_pod(agent.kube)
    namespace = pod["metadata"]["namespace"]
    builder = _builder(agent, pod, tmp_path)
    folder = builder.build(pod)["sa"]
    token_file = folder / "token"
    first = token_file.read_text()
    account = f"system:serviceaccount:{namespace}:app"
    assert _authenticated_as(agent.kube, first) == account
    [projected] = builder.tokens
    issued = projected.issued
    assert issued.lifetime == LIFETIME
    assert issued.refresh_at() == pytest.approx(issued.expires_at - 0.2 * LIFETIME)

    builder.refresh_tokens(issued.refresh_at() - 1)  # not due yet
    assert token_file.read_text() == first

    folder_inode, file_inode = folder.stat().st_ino, token_file.stat().st_ino
    builder.refresh_tokens(issued.refresh_at())
    second = token_file.read_text()
    assert second != first
    assert _authenticated_as(agent.kube, second) == account
    # Same folder (containers bind-mount it), a new file put there by one rename.
    assert folder.stat().st_ino == folder_inode
    assert token_file.stat().st_ino != file_inode
    assert sorted(p.name for p in folder.iterdir()) == ["token"]
    assert projected.issued.token == second  # the next refresh is reckoned from the new one


def test_a_failed_refresh_keeps_the_old_token_and_is_retried(
    agent: Agent, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pod = _stored_pod(agent.kube)
    namespace = pod["metadata"]["namespace"]
    builder = _builder(agent, pod, tmp_path)
    token_file = builder.build(pod)["sa"] / "token"
    first = token_file.read_text()
    [projected] = builder.tokens
    due = projected.issued.refresh_at()
    agent.kube.delete(f"/api/v1/namespaces/{namespace}/serviceaccounts/app")

    with caplog.at_level(logging.WARNING, logger="twinmq.nodeagent"):
        builder.refresh_tokens(due)
    assert token_file.read_text() == first
    assert "refreshing token" in caplog.text and "retrying" in caplog.text
    assert projected.retry_at > due

    agent.kube.create(
        f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "app"}}
    )
    builder.refresh_tokens(due)  # before the retry time: nothing happens
    assert token_file.read_text() == first
    builder.refresh_tokens(projected.retry_at)
    assert _authenticated_as(agent.kube, token_file.read_text()) == (
        f"system:serviceaccount:{namespace}:app"
    )


def test_writing_the_volumes_again_keeps_the_folder_a_running_container_mounted(
    agent: Agent, tmp_path: Path
) -> None:
    # A restarted node agent adopts running pods and writes their volumes again.
    pod = _stored_pod(agent.kube)
    folder = _builder(agent, pod, tmp_path).build(pod)["sa"]
    inode = folder.stat().st_ino
    again = _builder(agent, pod, tmp_path)
    assert again.build(pod)["sa"] == folder
    assert folder.stat().st_ino == inode
    assert [t.file for t in again.tokens] == [folder / "token"]
