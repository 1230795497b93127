"""A pod's volumes as files and directories on the host, bind-mounted by each container's shim.

Secret, ConfigMap, downwardAPI and projected volumes (including the service
account token) are written as files; emptyDir is a folder of the pod;
a PersistentVolumeClaim is the folder of its bound PersistentVolume, which
outlives the pod.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from twinmq.localcluster.nodeagent.podenv import field_ref

Fetch = Callable[[str, str], Mapping[str, bytes]]
"""(namespace, name) -> data of a Secret or ConfigMap, raw bytes; KeyError if missing."""
TokenFetch = Callable[[str, str, int, str | None], str]
"""(namespace, service account, expiry seconds, audience) -> token."""
ClaimPath = Callable[[str, str], Path]
"""(namespace, claim name) -> folder of the bound PersistentVolume."""


def decode_secret(data: Mapping[str, str] | None) -> dict[str, bytes]:
    """Return a Secret's `data` decoded from base64."""
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def _write_items(
    folder: Path, data: Mapping[str, bytes], items: list[dict[str, Any]] | None
) -> None:
    if items:
        for item in items:
            if item["key"] in data:
                target = folder / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[item["key"]])
    else:
        for key, value in data.items():
            (folder / key).write_bytes(value)


class VolumeBuilder:
    """Materializes the volumes of one pod under its folder."""

    def __init__(
        self,
        pod_dir: Path,
        *,
        secrets: Fetch,
        config_maps: Fetch,
        token: TokenFetch,
        claim_path: ClaimPath,
        host_ip: str,
    ) -> None:
        self.pod_dir = pod_dir
        self.secrets = secrets
        self.config_maps = config_maps
        self.token = token
        self.claim_path = claim_path
        self.host_ip = host_ip

    def build(self, pod: Mapping[str, Any]) -> dict[str, Path]:
        """Write every volume of `pod`; return volume name -> host path."""
        namespace = pod["metadata"]["namespace"]
        paths: dict[str, Path] = {}
        for volume in pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                paths[name] = self.claim_path(
                    namespace, volume["persistentVolumeClaim"]["claimName"]
                )
                continue
            folder = self.pod_dir / "volumes" / name
            if "emptyDir" in volume or "hostPath" in volume:
                if "hostPath" in volume:
                    raise ValueError("hostPath volumes are not supported by the process node")
                folder.mkdir(parents=True, exist_ok=True)
                paths[name] = folder
                continue
            fresh = folder.with_name(name + ".new")
            shutil.rmtree(fresh, ignore_errors=True)
            fresh.mkdir(parents=True)
            self._fill(fresh, volume, pod)
            shutil.rmtree(folder, ignore_errors=True)
            fresh.rename(folder)
            paths[name] = folder
        return paths

    def _fill(self, folder: Path, volume: Mapping[str, Any], pod: Mapping[str, Any]) -> None:
        namespace = pod["metadata"]["namespace"]
        if "secret" in volume:
            src = volume["secret"]
            data = self._get(self.secrets, namespace, src["secretName"], src.get("optional"))
            _write_items(folder, data, src.get("items"))
        elif "configMap" in volume:
            src = volume["configMap"]
            data = self._get(self.config_maps, namespace, src["name"], src.get("optional"))
            _write_items(folder, data, src.get("items"))
        elif "downwardAPI" in volume:
            self._downward(folder, volume["downwardAPI"].get("items") or [], pod)
        elif "projected" in volume:
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    sat = source["serviceAccountToken"]
                    account = pod["spec"].get("serviceAccountName") or "default"
                    token = self.token(
                        namespace,
                        account,
                        int(sat.get("expirationSeconds", 3600)),
                        sat.get("audience"),
                    )
                    (folder / sat["path"]).write_text(token)
                elif "configMap" in source:
                    src = source["configMap"]
                    data = self._get(self.config_maps, namespace, src["name"], src.get("optional"))
                    _write_items(folder, data, src.get("items"))
                elif "secret" in source:
                    src = source["secret"]
                    data = self._get(self.secrets, namespace, src["name"], src.get("optional"))
                    _write_items(folder, data, src.get("items"))
                elif "downwardAPI" in source:
                    self._downward(folder, source["downwardAPI"].get("items") or [], pod)
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise ValueError(f"volume type {kinds} is not supported by the process node")

    def _downward(self, folder: Path, items: list[dict[str, Any]], pod: Mapping[str, Any]) -> None:
        for item in items:
            if "fieldRef" not in item:
                continue
            target = folder / item["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(field_ref(pod, item["fieldRef"]["fieldPath"], self.host_ip))

    @staticmethod
    def _get(fetch: Fetch, namespace: str, name: str, optional: bool | None) -> Mapping[str, bytes]:
        try:
            return fetch(namespace, name)
        except KeyError:
            if optional:
                return {}
            raise
