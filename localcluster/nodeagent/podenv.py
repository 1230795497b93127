"""A container's environment as the kubelet builds it (pure: lookups are passed in)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from twinmq.localcluster.layout import KUBERNETES_SERVICE_IP

Lookup = Callable[[str, str], Mapping[str, str]]
"""(namespace, name) -> data of a Secret or ConfigMap (decoded)."""

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Expand `$(VAR)` references as Kubernetes does; `$$` escapes, unknown refs stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REF.sub(replace, value)


def field_ref(pod: Mapping[str, Any], path: str, host_ip: str) -> str:
    """Return a downward-API field of `pod` (metadata.name, status.podIP, labels['x'], ...)."""
    meta = pod.get("metadata", {})
    status = pod.get("status", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.podIPs": status.get("podIP", ""),
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str(meta.get(match.group(1), {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    raise ValueError(f"unsupported fieldRef {path!r}")


def container_env(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    host_ip: str,
    secrets: Lookup,
    config_maps: Lookup,
    base: Mapping[str, str],
) -> dict[str, str]:
    """Return the environment of `container`: base, service links, envFrom, then env."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = dict(base)
    env.update(
        {
            "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
            "KUBERNETES_SERVICE_HOST": KUBERNETES_SERVICE_IP,
            "KUBERNETES_SERVICE_PORT": "443",
            "KUBERNETES_SERVICE_PORT_HTTPS": "443",
            "KUBERNETES_PORT": f"tcp://{KUBERNETES_SERVICE_IP}:443",
        }
    )
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "secretRef" in source:
            ref = source["secretRef"]
            data = _optional(secrets, namespace, ref["name"], ref.get("optional", False))
        else:
            ref = source["configMapRef"]
            data = _optional(config_maps, namespace, ref["name"], ref.get("optional", False))
        env.update({prefix + k: v for k, v in data.items()})
    for item in container.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item:
            env[name] = expand(item.get("value", ""), env)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref(pod, source["fieldRef"]["fieldPath"], host_ip)
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            is_secret = "secretKeyRef" in source
            ref = source["secretKeyRef" if is_secret else "configMapKeyRef"]
            lookup = secrets if is_secret else config_maps
            data = _optional(lookup, namespace, ref["name"], ref.get("optional", False))
            if ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional", False):
                raise KeyError(f"key {ref['key']!r} not found in {ref['name']!r}")
        elif "resourceFieldRef" in source:
            env[name] = _resource(container, source["resourceFieldRef"])
    return env


def _optional(lookup: Lookup, namespace: str, name: str, optional: bool) -> Mapping[str, str]:
    try:
        return lookup(namespace, name)
    except KeyError:
        if optional:
            return {}
        raise


def _resource(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    value = (container.get("resources") or {}).get(kind, {}).get(resource)
    return str(value) if value is not None else "0"
