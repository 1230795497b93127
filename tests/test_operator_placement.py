"""Placement, pod template overrides and the PodDisruptionBudget: the pure builders.

Built objects are checked against the Kubernetes schemas of the local cluster's version
(kubernetes-validate, strict: an unknown or misspelled field fails), so an override
that the model accepts is one the API server takes.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from pydantic import ValidationError

from twinmq.operator import builders
from twinmq.operator.builders import (
    LABEL_BROKER,
    LABEL_CLUSTER,
    LABEL_ROLE,
    POD_TEMPLATE_HASH,
    ClusterRef,
    build_disruption_budget,
    build_pod,
    pod_revision,
)
from twinmq.operator.models import BrokerClusterSpec

CLUSTER = ClusterRef("orders", "ns", "uid-1")
KUBERNETES_VERSION = "1.36"  # the local cluster's (localcluster/versions.py)
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"

OVERRIDES: dict[str, Any] = {
    "metadata": {
        "labels": {"team": "payments"},
        "annotations": {"prometheus.io/scrape": "true"},
    },
    "affinity": {
        "nodeAffinity": {
            REQUIRED: {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["ssd"]}]}
                ]
            }
        },
        "podAntiAffinity": {
            PREFERRED: [
                {
                    "weight": 50,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": {"app": "noisy"}},
                        "topologyKey": "kubernetes.io/hostname",
                    },
                }
            ]
        },
    },
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "mq", "effect": "NoSchedule"}
    ],
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {LABEL_CLUSTER: "orders"}},
        }
    ],
    "imagePullSecrets": [{"name": "registry"}],
    "priorityClassName": "messaging",
}


def spec_with(**fields: Any) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate(fields)


def valid(obj: dict[str, Any]) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        pytest.fail(f"{obj['kind']}: {error.message} at {list(error.path)}")


def test_by_default_the_brokers_are_required_never_to_share_a_node() -> None:
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "primary")
    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == [REQUIRED]
    (term,) = anti[REQUIRED]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    # It selects both brokers of this cluster (their labels), and not its audit runs' pods.
    selector = term["labelSelector"]
    assert selector["matchLabels"] == {LABEL_CLUSTER: "orders"}
    assert selector["matchExpressions"] == [{"key": LABEL_BROKER, "operator": "Exists"}]
    for broker in ("primary", "backup"):
        labels = build_pod(CLUSTER, BrokerClusterSpec(), broker)["metadata"]["labels"]
        assert labels[LABEL_CLUSTER] == "orders" and LABEL_BROKER in labels
    valid(pod)


def test_preferred_anti_affinity_lets_the_scheduler_place_both_on_one_node() -> None:
    spec = spec_with(placement={"antiAffinity": "preferred", "topologyKey": "zone"})
    anti = build_pod(CLUSTER, spec, "backup")["spec"]["affinity"]["podAntiAffinity"]
    assert list(anti) == [PREFERRED]
    (weighted,) = anti[PREFERRED]
    assert weighted["weight"] == 100
    assert weighted["podAffinityTerm"]["topologyKey"] == "zone"


def test_overrides_reach_the_pod_and_the_brokers_anti_affinity_is_kept() -> None:
    pod = build_pod(CLUSTER, spec_with(podTemplate=OVERRIDES), "primary")
    pod_spec = pod["spec"]
    for name in ("nodeSelector", "tolerations", "topologySpreadConstraints",
                 "imagePullSecrets", "priorityClassName"):  # fmt: skip
        assert pod_spec[name] == OVERRIDES[name], name
    assert pod_spec["affinity"]["nodeAffinity"] == OVERRIDES["affinity"]["nodeAffinity"]
    anti = pod_spec["affinity"]["podAntiAffinity"]
    assert anti[REQUIRED][0]["labelSelector"]["matchLabels"] == {LABEL_CLUSTER: "orders"}
    assert anti[PREFERRED] == OVERRIDES["affinity"]["podAntiAffinity"][PREFERRED]
    assert pod["metadata"]["labels"]["team"] == "payments"
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert POD_TEMPLATE_HASH in pod["metadata"]["annotations"]
    valid(pod)


def test_a_users_preferred_term_is_added_after_the_brokers_own_when_preferred() -> None:
    spec = spec_with(placement={"antiAffinity": "preferred"}, podTemplate=OVERRIDES)
    anti = build_pod(CLUSTER, spec, "primary")["spec"]["affinity"]["podAntiAffinity"]
    assert [t["weight"] for t in anti[PREFERRED]] == [100, 50]
    assert REQUIRED not in anti


def test_without_overrides_the_pod_has_no_empty_override_fields() -> None:
    pod_spec = build_pod(CLUSTER, BrokerClusterSpec(), "primary")["spec"]
    for name in ("nodeSelector", "tolerations", "topologySpreadConstraints",
                 "imagePullSecrets", "priorityClassName"):  # fmt: skip
        assert name not in pod_spec
    assert list(pod_spec["affinity"]) == ["podAntiAffinity"]


@pytest.mark.parametrize(
    "change",
    [
        {"placement": {"antiAffinity": "preferred"}},
        {"podTemplate": {"nodeSelector": {"disk": "ssd"}}},
        {"podTemplate": {"tolerations": [{"operator": "Exists"}]}},
        {"podTemplate": {"priorityClassName": "messaging"}},
        {"podTemplate": {"metadata": {"labels": {"team": "payments"}}}},
        {"podTemplate": {"metadata": {"annotations": {"note": "x"}}}},
    ],
)
def test_every_override_changes_the_template_hash_so_it_rolls_out(change: dict[str, Any]) -> None:
    before = pod_revision(build_pod(CLUSTER, BrokerClusterSpec(), "primary"))
    assert pod_revision(build_pod(CLUSTER, spec_with(**change), "primary")) != before


def test_the_operators_own_labels_win_over_an_override() -> None:
    # The CRD refuses such a spec (CEL); the builder still never lets it move a selector.
    labels = {"team": "payments", LABEL_CLUSTER: "other", LABEL_ROLE: "active"}
    spec = spec_with(podTemplate={"metadata": {"labels": labels}})
    built = build_pod(CLUSTER, spec, "backup")["metadata"]["labels"]
    assert built[LABEL_CLUSTER] == "orders"
    assert built[LABEL_ROLE] == "passive"
    assert built["team"] == "payments"


def test_the_disruption_budget_keeps_one_broker_and_selects_only_the_brokers() -> None:
    pdb = build_disruption_budget(CLUSTER)
    assert pdb["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in pdb["spec"]
    assert pdb["spec"]["selector"] == builders.broker_selector(CLUSTER)
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    owner = pdb["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "BrokerCluster" and owner["uid"] == "uid-1" and owner["controller"]
    valid(pdb)


@pytest.mark.parametrize(
    "bad",
    [
        {"placement": {"antiAffinity": "sometimes"}},
        {"podTemplate": {"tolerations": [{"effect": "NoRun"}]}},
        {"podTemplate": {"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "zone",
                                                        "whenUnsatisfiable": "ScheduleAnyway"}]}},
        {"podTemplate": {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}}}},
        {"podTemplate": {"imagePullSecrets": [{"name": ""}]}},
        {"podTemplate": {"hostNetwork": True}},
    ],
)  # fmt: skip
def test_invalid_overrides_are_refused_by_the_model(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        BrokerClusterSpec.model_validate(bad)
