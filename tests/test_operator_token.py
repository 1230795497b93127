"""The broker pods' service-account token lifetime (operator setting
TWINMQ_OPERATOR_BROKER_TOKEN_SECONDS): unset leaves the API server's automatic volume."""

from __future__ import annotations

import pytest

from twinmq.operator.builders import (
    BROKER_TOKEN_SECONDS_ENV,
    SERVICE_ACCOUNT_DIR,
    ClusterRef,
    broker_token_seconds,
    build_pod,
    pod_revision,
)
from twinmq.operator.models import BrokerClusterSpec

CLUSTER = ClusterRef("orders", "ns", "uid-1")


def test_unset_keeps_the_automatic_token_and_the_pod_template() -> None:
    assert broker_token_seconds({}) is None
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "primary")
    assert "automountServiceAccountToken" not in pod["spec"]
    assert pod_revision(pod) == pod_revision(build_pod(CLUSTER, BrokerClusterSpec(), "primary"))


def test_a_lifetime_gives_the_broker_a_projected_token_of_that_lifetime() -> None:
    seconds = broker_token_seconds({BROKER_TOKEN_SECONDS_ENV: "900"})
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "primary", seconds)
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False
    [volume] = [v for v in spec["volumes"] if v["name"] == "kube-api-access"]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"] == {"path": "token", "expirationSeconds": 900}
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts[SERVICE_ACCOUNT_DIR]["readOnly"] is True


@pytest.mark.parametrize("value", ["599", "soon"])
def test_a_lifetime_the_api_would_refuse_is_refused_at_start(value: str) -> None:
    with pytest.raises(ValueError):
        broker_token_seconds({BROKER_TOKEN_SECONDS_ENV: value})
