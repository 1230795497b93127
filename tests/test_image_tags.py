"""The release's image tag is the project's version everywhere a default image is named."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from twinmq.operator.models import DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parent.parent


def project_version() -> str:
    """pyproject.toml's version: the release's image tag."""
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def test_chart_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((ROOT / "helm/twinmq/Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "helm/twinmq/values.yaml").read_text())
    assert chart["appVersion"] == project_version()
    assert values["image"]["repository"] == "twinmq/twinmq"
    assert values["image"]["tag"] == ""  # empty: the appVersion


def test_brokercluster_default_image_is_the_release_image() -> None:
    assert f"twinmq/twinmq:{project_version()}" == DEFAULT_IMAGE
    for crd in ("crds/brokercluster.yaml", "helm/twinmq/crds/brokercluster.yaml"):
        assert f"default: {DEFAULT_IMAGE}" in (ROOT / crd).read_text()
