"""The BrokerCluster CRD is generated from the models and agrees with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from twinmq.operator.crd import crd, render
from twinmq.operator.models import BrokerClusterSpec

CRD_FILE = Path(__file__).resolve().parent.parent / "crds" / "brokercluster.yaml"


def _spec_schema() -> dict[str, Any]:
    version = crd()["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def test_committed_crd_is_the_generated_one() -> None:
    assert CRD_FILE.read_text() == render(), (
        "crds/brokercluster.yaml is stale: run `python -m twinmq.operator.crd > "
        "crds/brokercluster.yaml`"
    )


def test_schema_is_structural_without_refs_or_unions() -> None:
    text = yaml.safe_dump(crd())
    for forbidden in ("$ref", "anyOf", "oneOf", "$defs", "title:"):
        assert forbidden not in text, forbidden


def test_every_model_field_appears_in_the_schema_under_its_wire_name() -> None:
    schema = _spec_schema()
    for name, field in BrokerClusterSpec.model_fields.items():
        assert field.alias in schema["properties"], name


def test_schema_defaults_equal_the_model_defaults() -> None:
    schema = _spec_schema()
    failover = schema["properties"]["failover"]["properties"]
    defaults = BrokerClusterSpec().failover
    assert failover["probeIntervalSeconds"]["default"] == defaults.probe_interval_seconds
    assert failover["leaseDurationSeconds"]["default"] == defaults.lease_duration_seconds
    assert schema["properties"]["image"]["default"] == BrokerClusterSpec().image


def test_cross_field_rules_are_cel_in_the_schema() -> None:
    failover = _spec_schema()["properties"]["failover"]
    rules = [v["rule"] for v in failover["x-kubernetes-validations"]]
    assert rules == ["self.leaseDurationSeconds > self.probeIntervalSeconds"]


def test_pod_template_labels_and_annotations_refuse_the_operators_prefixes_by_cel() -> None:
    template = _spec_schema()["properties"]["podTemplate"]["properties"]["metadata"]
    rules = [v["rule"] for v in template["x-kubernetes-validations"]]
    assert len(rules) == 2
    for field, rule in zip(("labels", "annotations"), rules, strict=True):
        assert rule.startswith(f"!has(self.{field}) || self.{field}.all(k, ")
        assert "!k.startsWith('twinmq.io/')" in rule
        assert "!k.startsWith('app.kubernetes.io/')" in rule


@pytest.mark.parametrize(
    "bad",
    [
        {"failover": {"probeIntervalSeconds": 0}},
        {"storage": {"size": "lots"}},
        {"requests": {"promote": {"id": "x", "broker": "tertiary"}}},
        {"unknownField": 1},
        {"audit": {"launcher": "cron"}},
    ],
)
def test_invalid_specs_are_refused_by_the_model(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        BrokerClusterSpec.model_validate(bad)


def test_wire_names_round_trip() -> None:
    spec = BrokerClusterSpec.model_validate(
        {"requests": {"promote": {"id": "sw-1", "broker": "backup", "force": True}}}
    )
    assert spec.requests.promote is not None and spec.requests.promote.force
    dumped = spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["requests"]["promote"] == {"id": "sw-1", "broker": "backup", "force": True}


def test_no_required_property_has_a_default() -> None:
    """The API server refuses a CRD whose default lacks a required field (a `{}` default of a
    required nested object: a pod affinity term without its topologyKey)."""

    def walk(node: dict[str, Any], where: str) -> list[str]:
        found = []
        for name, sub in (node.get("properties") or {}).items():
            if name in node.get("required", []) and "default" in sub:
                found.append(f"{where}.{name}")
            found += walk(sub, f"{where}.{name}")
        if isinstance(node.get("items"), dict):
            found += walk(node["items"], f"{where}[]")
        return found

    assert walk(_spec_schema(), "spec") == []
