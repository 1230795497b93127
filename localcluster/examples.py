"""The project's example BrokerCluster as the local cluster (and kind) can run it.

`examples/brokercluster.yaml` is written for a real cluster: its brokers never share a
node (`placement.antiAffinity: required`, the default). The local cluster, like the e2e
kind cluster, has one node: there the backup could never be scheduled, so the demo, the
e2e tests and the benchmarks run the example with `preferred` anti-affinity.
"""

from __future__ import annotations

from typing import Any

import yaml

from twinmq.localcluster.layout import repo_root

ONE_NODE_PLACEMENT = {"antiAffinity": "preferred"}
"""`spec.placement` of a BrokerCluster on a one-node cluster."""


def example_brokercluster() -> dict[str, Any]:
    """`examples/brokercluster.yaml`, placed for a one-node cluster."""
    example: dict[str, Any] = yaml.safe_load(
        (repo_root() / "examples" / "brokercluster.yaml").read_text()
    )
    example["spec"]["placement"] = dict(ONE_NODE_PLACEMENT)
    return example
