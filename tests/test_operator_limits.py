"""`spec.limits`: the broker's exhaustion limits, rendered as its own flags only where set."""

from __future__ import annotations

import pytest

from twinmq.broker.names import REPLICATION_TOKEN_ENV
from twinmq.broker.settings import BrokerSettings, parse_args
from twinmq.operator.builders import ClusterRef, build_pod, limit_args, pod_revision
from twinmq.operator.models import BrokerClusterSpec, Limits

CLUSTER = ClusterRef(namespace="ns", name="orders", uid="uid-1")


def broker_args(spec: BrokerClusterSpec) -> list[str]:
    container = build_pod(CLUSTER, spec, "a")["spec"]["containers"][0]
    return [arg.replace("$(POD_NAME)", "orders-a") for arg in container["args"]]


def test_every_limit_is_a_broker_setting_of_the_same_name() -> None:
    assert set(Limits.model_fields) <= set(BrokerSettings.model_fields)


def test_limits_left_unset_add_no_flag_and_change_no_pod() -> None:
    plain = BrokerClusterSpec()
    with_empty = BrokerClusterSpec.model_validate({"limits": {}})
    assert limit_args(plain.limits) == []
    assert pod_revision(build_pod(CLUSTER, plain, "a")) == pod_revision(
        build_pod(CLUSTER, with_empty, "a")
    )


def test_the_broker_reads_the_limits_the_operator_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pod's own replication token (its Secret, in the environment): with `--peer` the
    # broker refuses to start without one.
    monkeypatch.setenv(REPLICATION_TOKEN_ENV, "replication")
    spec = BrokerClusterSpec.model_validate(
        {
            "limits": {
                "maxConnections": 500,
                "maxConnectionsPerUser": 50,
                "maxQueues": 1000,
                "maxQueueLength": 100000,
                "maxQueueLengthBytes": 1073741824,
                "channelMax": 64,
                "maxMessageSize": 1048576,
            }
        }
    )
    settings = parse_args(broker_args(spec))
    assert (
        settings.max_connections,
        settings.max_connections_per_user,
        settings.max_queues,
        settings.max_queue_length,
        settings.max_queue_length_bytes,
        settings.channel_max,
        settings.max_message_size,
    ) == (500, 50, 1000, 100000, 1073741824, 64, 1048576)
    assert pod_revision(build_pod(CLUSTER, spec, "a")) != pod_revision(
        build_pod(CLUSTER, BrokerClusterSpec(), "a")
    )
