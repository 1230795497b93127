"""Unit tests of the node agent's pure parts: images, environment, phases, restarts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from twinmq.localcluster.layout import KUBERNETES_SERVICE_IP
from twinmq.localcluster.nodeagent import podstatus
from twinmq.localcluster.nodeagent.images import (
    CommandError,
    CommandMap,
    ImageError,
    check_image,
    image_repository,
)
from twinmq.localcluster.nodeagent.podenv import container_env, expand, field_ref
from twinmq.localcluster.nodeagent.runtime import resolv_conf
from twinmq.localcluster.nodeagent.shim import hidden_by_mounts, mount_order
from twinmq.localcluster.versions import staging_version


@pytest.mark.parametrize(
    "image",
    [
        "twinmq/twinmq",
        "twinmq/twinmq:dev",
        "docker.io/twinmq/twinmq:1.0",
        "twinmq/twinmq@sha256:abc",
    ],
)
def test_project_image_is_accepted_with_any_tag(image: str) -> None:
    check_image(image)
    assert image_repository(image) == "twinmq/twinmq"


@pytest.mark.parametrize(
    "image", ["docker.io/twinmq/twinmq-audit:dev", "twinmq/twinmq-audit:0.1.0"]
)
def test_the_audit_image_is_accepted_too(image: str) -> None:
    check_image(image)


@pytest.mark.parametrize(
    "image", ["nginx:1.25", "localhost:5000/twinmq/twinmq:dev", "twinmq", "twinmq/twinmq-other"]
)
def test_other_images_fail_like_an_unpullable_image(image: str) -> None:
    with pytest.raises(ImageError, match="not available"):
        check_image(image)


def test_console_scripts_map_to_the_agents_venv() -> None:
    commands = CommandMap(Path("/venv/bin"), exists=lambda p: str(p).startswith("/venv/bin/"))
    assert commands.resolve(["twinmq-broker"], ["--port=1"]) == [
        "/venv/bin/twinmq-broker",
        "--port=1",
    ]
    assert commands.resolve(["python", "-c", "x"], []) == ["/venv/bin/python", "-c", "x"]


def test_unknown_command_is_not_found_in_the_image() -> None:
    commands = CommandMap(Path("/venv/bin"), exists=lambda p: True)
    with pytest.raises(CommandError, match="executable file not found"):
        commands.resolve(["/usr/sbin/nginx"], [])
    with pytest.raises(CommandError, match="no command"):
        commands.resolve([], [])


def _pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "b-0", "namespace": "ns", "uid": "u1", "labels": {"role": "active"}},
        "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": []},
        "status": {"podIP": "10.244.0.7"},
    }


def test_env_has_downward_api_fields_secrets_and_expansion() -> None:
    container = {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ROLE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['role']"}}},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "t"}}},
            {"name": "URL", "value": "amqp://$(POD_IP):5672/$$x"},
        ],
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
    }
    env = container_env(
        _pod(),
        container,
        host_ip="10.244.0.1",
        secrets=lambda ns, n: {"t": "secret"},
        config_maps=lambda ns, n: {"a": "1"},
        base={"PATH": "/bin"},
    )
    assert env["POD_NAME"] == "b-0"
    assert env["POD_IP"] == "10.244.0.7"
    assert env["ROLE"] == "active"
    assert env["TOKEN"] == "secret"
    assert env["URL"] == "amqp://10.244.0.7:5672/$x"
    assert env["CM_a"] == "1"
    assert env["KUBERNETES_SERVICE_HOST"] == KUBERNETES_SERVICE_IP
    assert env["HOSTNAME"] == "b-0"


def test_missing_secret_key_fails_unless_optional() -> None:
    container = {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    with pytest.raises(KeyError):
        container_env(
            _pod(),
            container,
            host_ip="h",
            secrets=lambda ns, n: {},
            config_maps=lambda ns, n: {},
            base={},
        )
    container["env"][0]["valueFrom"]["secretKeyRef"]["optional"] = True  # type: ignore[index]
    env = container_env(
        _pod(),
        container,
        host_ip="h",
        secrets=lambda ns, n: {},
        config_maps=lambda ns, n: {},
        base={},
    )
    assert "X" not in env


def test_expand_leaves_unknown_references() -> None:
    assert expand("$(A)-$(B)", {"A": "1"}) == "1-$(B)"
    assert field_ref(_pod(), "spec.nodeName", "h") == "n"


def test_restart_policy_and_backoff_follow_the_kubelet() -> None:
    assert podstatus.should_restart("Always", 0)
    assert podstatus.should_restart("OnFailure", 1) and not podstatus.should_restart("OnFailure", 0)
    assert not podstatus.should_restart("Never", 137)
    assert [podstatus.restart_delay(n) for n in range(4)] == [0.0, 10.0, 20.0, 40.0]
    assert podstatus.restart_delay(50) == podstatus.BACKOFF_MAX


def test_pod_phase() -> None:
    view = podstatus.ContainerView
    assert podstatus.pod_phase([view(True, None, False)], initialized=True) == "Running"
    assert podstatus.pod_phase([view(False, 0, False)], initialized=True) == "Succeeded"
    assert podstatus.pod_phase([view(False, 0, False), view(False, 2, False)], True) == "Failed"
    assert podstatus.pod_phase([view(False, None, True)], initialized=True) == "Pending"
    assert podstatus.pod_phase([view(True, None, False)], initialized=False) == "Pending"


def test_pod_dns_searches_its_namespace_first() -> None:
    text = resolv_conf("ns")
    assert "nameserver 10.96.0.10" in text
    assert "search ns.svc.cluster.local svc.cluster.local cluster.local" in text


def test_staging_modules_use_the_matching_v0_version() -> None:
    assert staging_version("v1.36.3") == "v0.36.3"


def test_log_tail_returns_the_last_lines() -> None:
    from twinmq.localcluster.nodeagent.logserver import tail

    assert tail(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert tail(b"a\nb\n", None) == b"a\nb\n"
    assert tail(b"a\n", 0) == b""


def test_a_mount_over_a_folder_holding_another_mounts_source_comes_last() -> None:
    # A checkout under /tmp: the pod's emptyDir over /tmp hid the token volume's source.
    tmp = "/tmp/ci/.cluster/node/pods/u/volumes/tmp:/tmp"
    token = "/tmp/ci/.cluster/node/pods/u/volumes/kube-api-access:/var/run/secrets/sa:ro"
    data = "/tmp/ci/.cluster/volumes/pvc-1:/var/lib/twinmq/data"
    assert mount_order([tmp, token, data]) == [token, data, tmp]
    assert mount_order([token, data]) == [token, data]


def test_a_checkout_under_a_pods_tmp_mount_is_kept_visible_with_its_state(tmp_path: Path) -> None:
    """A pod's emptyDir over /tmp hides a checkout under /tmp (its venv's commands, the
    container's state folder): those folders are bound back, outermost only."""
    checkout = tmp_path / "ck"
    state = checkout / ".cluster" / "node" / "pods" / "p" / "containers" / "broker"
    elsewhere = Path("/opt/venv")
    mounts = [f"/var/empty:{tmp_path}", "/x/token:/var/run/secrets/token"]
    assert hidden_by_mounts(mounts, [checkout, state, elsewhere]) == [checkout]
    assert hidden_by_mounts(["/x:/srv/data"], [checkout, state]) == []
