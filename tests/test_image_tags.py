"""The release's image tag is the project's version everywhere a default image is named."""

from __future__ import annotations

import re
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


def _requirement_name(spec: str) -> str:
    """The normalised distribution name of a requirement (`name[extra]>=1; marker`)."""
    name = re.split(r"[\s\[<>=!~;]", spec.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_broker_image_lock_pins_every_runtime_dependency() -> None:
    # The image installs only what image/requirements.lock names (hash-checked, no resolver):
    # a dependency added to pyproject.toml but not locked breaks the image at import time.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["ship"]]
    locked = {
        _requirement_name(line)
        for line in (ROOT / "image/requirements.lock").read_text().splitlines()
        if line and not line[0].isspace() and not line.startswith("#")
    }
    missing = sorted({_requirement_name(spec) for spec in wanted} - locked)
    assert not missing, f"not in image/requirements.lock (run `make image-lock`): {missing}"
