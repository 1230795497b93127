"""The Helm chart lints and renders a broker the process node (and kind) can run."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from twinmq.localcluster.binaries import find
from twinmq.localcluster.layout import repo_root

CHART = repo_root() / "helm" / "twinmq"


def _helm(*args: str) -> str:
    try:
        helm = find("helm")
    except FileNotFoundError:
        pytest.skip("helm is not built yet (make cluster-binaries)")
    return subprocess.run([str(helm), *args], check=True, capture_output=True, text=True).stdout


def _render(*sets: str) -> list[dict[str, Any]]:
    args = [arg for s in sets for arg in ("--set", s)]
    return [d for d in yaml.safe_load_all(_helm("template", "t", str(CHART), *args)) if d]


def test_chart_lints() -> None:
    assert "0 chart(s) failed" in _helm("lint", str(CHART))


def test_broker_runs_the_project_image_with_probes_and_a_claim() -> None:
    # The standalone broker is opt-in since the chart deploys the operator by default.
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in _render("image.tag=1.2.3", "broker.enabled=true")
    }
    sts = docs[("StatefulSet", "t-twinmq-broker")]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "twinmq/twinmq:1.2.3"
    assert container["command"] == ["twinmq-broker"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert ("Service", "t-twinmq-headless") in docs
    assert docs[("Service", "t-twinmq-headless")]["spec"]["clusterIP"] == "None"


def test_users_secret_holds_a_users_file_for_the_configured_user() -> None:
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for d in _render("auth.password=pw", "broker.enabled=true")
    }
    users = docs[("Secret", "t-twinmq-users")]["stringData"]
    assert yaml.safe_load(users["users.json"]) == {"users": [{"name": "twinmq", "password": "pw"}]}
