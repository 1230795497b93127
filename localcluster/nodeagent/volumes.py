"""A pod's volumes as files and directories on the host, bind-mounted by each container's shim.

Secret, ConfigMap, downwardAPI and projected volumes (including the service
account token) are written as files; emptyDir is a folder of the pod;
a PersistentVolumeClaim is the folder of its bound PersistentVolume, which
outlives the pod.

Projected service-account tokens are refreshed as the kubelet's token manager does it
(`pkg/kubelet/token`): a new token once 80 % of the granted lifetime has passed, or 24 h
after issue, whichever comes first, written atomically (a temporary file in the same
folder, then a rename: a reader sees the old token or the new one, never half of one).
Without it, every in-cluster client dies with its token (the broker's Lease renewal gets
401 and the broker fences itself, the operator runs out of credentials).
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinmq.localcluster.nodeagent.podenv import field_ref

log = logging.getLogger("twinmq.nodeagent")

DEFAULT_TOKEN_SECONDS = 3600
"""A projected token's `expirationSeconds` when the pod does not say (the API's default)."""
MAX_TOKEN_AGE = 24 * 3600.0
"""The kubelet refreshes a token at the latest this long after it was issued."""
REFRESH_FRACTION = 0.8
"""... and at the latest once this fraction of its lifetime has passed."""
RETRY_SECONDS = 10.0
"""After a failed refresh (API down, refused), the old token stays; retry this much later."""


@dataclass(frozen=True)
class TokenSource:
    """What a projected `serviceAccountToken` asks for, bound to its pod (as the kubelet's
    requests are: the token stops working when the pod is deleted)."""

    namespace: str
    account: str
    expiration_seconds: int
    audience: str | None
    pod_name: str
    pod_uid: str


@dataclass(frozen=True)
class IssuedToken:
    """A token the TokenRequest API granted: its text, when it expires (epoch seconds), and
    the lifetime the API server granted (`spec.expirationSeconds` of its answer, which it
    may have capped or extended)."""

    token: str
    expires_at: float
    lifetime: float

    def refresh_at(self) -> float:
        """When the kubelet would replace it: after 80 % of its lifetime, or 24 h after issue."""
        issued = self.expires_at - self.lifetime
        return min(issued + REFRESH_FRACTION * self.lifetime, issued + MAX_TOKEN_AGE)


@dataclass
class ProjectedToken:
    """One token file of a pod's projected volume and the token it holds now."""

    file: Path
    source: TokenSource
    issued: IssuedToken
    retry_at: float = 0.0


Fetch = Callable[[str, str], Mapping[str, bytes]]
"""(namespace, name) -> data of a Secret or ConfigMap, raw bytes; KeyError if missing."""
TokenFetch = Callable[[TokenSource], IssuedToken]
"""A TokenRequest: the token for a projected volume's source; KeyError if the account is missing."""
ClaimPath = Callable[[str, str], Path]
"""(namespace, claim name) -> folder of the bound PersistentVolume."""


def decode_secret(data: Mapping[str, str] | None) -> dict[str, bytes]:
    """Return a Secret's `data` decoded from base64."""
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def atomic_write(path: Path, data: str) -> None:
    """Replace `path` with `data` in one rename (the kubelet's AtomicWriter swaps a `..data`
    symlink; one file needs only a temporary file in the same folder, hence the same
    filesystem). The folder itself is never replaced: containers bind-mount it."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        temporary.write_text(data)
        temporary.chmod(0o644)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _replace_contents(fresh: Path, folder: Path) -> None:
    """Make `folder` hold exactly `fresh`'s files, file by file, keeping `folder` itself:
    a running container (a node agent adopting its pods after a restart) has it bind-mounted
    and would never see a new folder put in its place."""
    wanted = {p.relative_to(fresh) for p in fresh.rglob("*") if not p.is_dir()}
    for relative in sorted(wanted):
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(fresh / relative, target)
    for stale in [p for p in folder.rglob("*") if not p.is_dir()]:
        if stale.relative_to(folder) not in wanted:
            stale.unlink()
    shutil.rmtree(fresh, ignore_errors=True)


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
        self.tokens: list[ProjectedToken] = []
        """The pod's projected token files, refreshed by `refresh_tokens`."""
        self._pending: list[tuple[str, TokenSource, IssuedToken]] = []

    def build(self, pod: Mapping[str, Any]) -> dict[str, Path]:
        """Write every volume of `pod`; return volume name -> host path."""
        namespace = pod["metadata"]["namespace"]
        paths: dict[str, Path] = {}
        self.tokens = []
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
            self._pending = []
            self._fill(fresh, volume, pod)
            if folder.is_dir():
                _replace_contents(fresh, folder)
            else:
                fresh.rename(folder)
            self.tokens += [ProjectedToken(folder / path, source, issued)
                            for path, source, issued in self._pending]  # fmt: skip
            paths[name] = folder
        return paths

    def refresh_tokens(self, now: float) -> None:
        """Replace every token that is due (`IssuedToken.refresh_at`); a failure keeps the
        old token (it may still be valid) and retries `RETRY_SECONDS` later."""
        for projected in self.tokens:
            if now < max(projected.issued.refresh_at(), projected.retry_at):
                continue
            source = projected.source
            try:
                issued = self.token(source)
            except Exception as error:  # API down, 401, account gone: keep trying, loudly
                projected.retry_at = now + RETRY_SECONDS
                log.warning("pod %s/%s: refreshing token %s failed (retrying in %.0f s): %s",
                            source.namespace, source.pod_name, projected.file, RETRY_SECONDS,
                            error)  # fmt: skip
                continue
            atomic_write(projected.file, issued.token)
            projected.issued, projected.retry_at = issued, 0.0
            log.debug("pod %s/%s: refreshed token %s (expires in %.0f s, next refresh in %.0f s)",
                      source.namespace, source.pod_name, projected.file, issued.expires_at - now,
                      issued.refresh_at() - now)  # fmt: skip

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
                    token_source = TokenSource(
                        namespace=namespace,
                        account=pod["spec"].get("serviceAccountName") or "default",
                        expiration_seconds=int(sat.get("expirationSeconds", DEFAULT_TOKEN_SECONDS)),
                        audience=sat.get("audience"),
                        pod_name=pod["metadata"]["name"],
                        pod_uid=pod["metadata"]["uid"],
                    )
                    issued = self.token(token_source)
                    (folder / sat["path"]).parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(folder / sat["path"], issued.token)
                    self._pending.append((sat["path"], token_source, issued))
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
