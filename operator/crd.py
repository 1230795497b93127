"""The BrokerCluster CRD, generated from the pydantic models.

`python -m twinmq.operator.crd > crds/brokercluster.yaml` writes it; a test
keeps the committed file equal to what this module generates, so the API
server and the operator can never disagree about the shape of the resource.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from twinmq.operator.models import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    BrokerClusterSpec,
    BrokerClusterStatus,
)

_DROP = {"title", "discriminator"}


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Turn a pydantic JSON schema node into a Kubernetes structural schema node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].split("/")[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    node = {k: v for k, v in schema.items() if k not in _DROP}
    if "anyOf" in node:
        variants = [v for v in node.pop("anyOf") if v.get("type") != "null"]
        if len(variants) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {schema}")
        inner = structural(variants[0], defs)
        node = {**inner, **node, "nullable": True}
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "properties" in node:
        node["properties"] = {
            name: structural(sub, defs) for name, sub in node["properties"].items()
        }
        node.setdefault("type", "object")
        # Nested objects default to {} so the API server fills in their defaults too; not
        # required ones (a {} default lacks their required fields: the CRD is refused).
        required = set(node.get("required", []))
        for name, sub in node["properties"].items():
            optional = name not in required and not sub.get("nullable")
            if optional and sub.get("type") == "object" and "default" not in sub:
                sub["default"] = {}
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = structural(node["additionalProperties"], defs)
    elif node.get("additionalProperties") is False:
        del node["additionalProperties"]
    elif node.get("additionalProperties") is True:
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "items" in node:
        node["items"] = structural(node["items"], defs)
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        # JSON Schema 2020 writes the bound itself; OpenAPI v3.0 (Kubernetes) a flag.
        if not isinstance(node.get(bound, True), bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    if "type" in node and node["type"] == "integer" and "format" not in node:
        node["format"] = "int64"
    return node


def schema_of(model: type[Any]) -> dict[str, Any]:
    """The structural schema of a model (by alias, as on the wire)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return structural(raw, defs)


def crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    spec = schema_of(BrokerClusterSpec)
    spec["description"] = BrokerClusterSpec.__doc__
    # Defaults of nested objects are the model's, in full: the API server checks CEL
    # rules against a default as written, before filling in the defaults inside it.
    defaults = BrokerClusterSpec().model_dump(by_alias=True, exclude_none=True, mode="json")
    for name, sub in spec["properties"].items():
        if sub.get("type") == "object" and name in defaults:
            sub["default"] = defaults[name]
    status = schema_of(BrokerClusterStatus)
    status["description"] = BrokerClusterStatus.__doc__
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["tmq"],
                "categories": ["twinmq"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "Active", "type": "string", "jsonPath": ".status.activeBroker"},
                        {"name": "Epoch", "type": "integer", "jsonPath": ".status.epoch"},
                        {
                            "name": "Ready",
                            "type": "string",
                            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
                        },
                        {
                            "name": "Lag",
                            "type": "integer",
                            "description": "Messages the passive has not yet written "
                            "(an unreachable broker's role is unknown: it is shown too)",
                            "jsonPath": '.status.brokers[?(@.role!="active")].lagMessages',
                        },
                        {
                            "name": "Mirror",
                            "type": "string",
                            "priority": 1,
                            "description": "The DR mirror (a bidirectional site's outgoing "
                            "direction): Connected, Disconnected, Listening",
                            "jsonPath": ".status.mirror.state",
                        },
                        {
                            "name": "Mirror-In",
                            "type": "string",
                            "priority": 1,
                            "description": "A bidirectional site's incoming direction: "
                            "Connected, Listening",
                            "jsonPath": ".status.mirror.inbound",
                        },
                        {
                            "name": "Mirror-Lag",
                            "type": "number",
                            "priority": 1,
                            "description": "Seconds the oldest unmirrored event has waited",
                            "jsonPath": ".status.mirror.lagSeconds",
                        },
                        {
                            "name": "Federation",
                            "type": "string",
                            "priority": 1,
                            "description": "Federation links running / federated exchanges",
                            "jsonPath": ".status.federation.running",
                        },
                        {
                            "name": "Peer-Status",
                            "type": "string",
                            "priority": 1,
                            "description": "Downstream links' status messages on this "
                            "cluster's amq.peer: received/dropped",
                            "jsonPath": ".status.federation.peerStatus",
                        },
                        {
                            "name": "Last-Failover",
                            "type": "date",
                            "jsonPath": ".status.lastFailover.time",
                        },
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A highly available pair of TwinMQ AMQP brokers.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": {**spec, "default": defaults},
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    """The CRD as YAML, as committed in crds/."""
    header = "# Generated by `python -m twinmq.operator.crd` from twinmq/operator/models.py.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=100)


def main() -> None:
    """Print the CRD."""
    sys.stdout.write(render())


if __name__ == "__main__":
    main()
