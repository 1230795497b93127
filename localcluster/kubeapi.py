"""A small, dict-based Kubernetes REST client over the `kubernetes` package's ApiClient.

The node agent, the cluster bootstrap and the e2e suite speak plain JSON
objects (as `kubectl` manifests read), which keeps them typed without
wrestling the generated model classes.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator, Mapping
from typing import Any, cast

import urllib3
from kubernetes import client, config

JSON = dict[str, Any]


class ApiError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


class KubeApi:
    """GET/POST/PATCH/DELETE/watch on API paths, with dicts in and out."""

    def __init__(self, kubeconfig: str) -> None:
        cfg = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=cfg
        )
        self.host = str(cfg.host).rstrip("/")
        self.headers = {"Accept": "application/json"}
        settings = cast(dict[str, dict[str, Any]], cfg.auth_settings())
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                self.headers[str(setting["key"]).title()] = str(setting["value"])
        self.pool = urllib3.PoolManager(
            num_pools=4,
            maxsize=8,
            cert_reqs="CERT_REQUIRED" if cfg.verify_ssl else "CERT_NONE",
            ca_certs=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
        )

    def _url(self, path: str, query: Mapping[str, Any] | None) -> str:
        url = self.host + path
        if query:
            url += "?" + urllib.parse.urlencode({k: str(v) for k, v in query.items()})
        return url

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> JSON:
        """Send one request; return the decoded JSON answer; raise ApiError on failure."""
        headers = dict(self.headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        response = self.pool.request(
            method,
            self._url(path, query),
            body=data,
            headers=headers,
            timeout=timeout,
            retries=False,
        )
        if response.status >= 300:
            raise ApiError(response.status, response.data.decode(errors="replace"))
        return cast(JSON, json.loads(response.data)) if response.data else {}

    def text(self, path: str, **query: Any) -> str:
        """GET a plain-text resource (e.g. `.../pods/<name>/log`)."""
        response = self.pool.request(
            "GET", self._url(path, query), headers=self.headers, timeout=30, retries=False
        )
        body = response.data.decode(errors="replace")
        if response.status >= 300:
            raise ApiError(response.status, body)
        return str(body)

    def get(self, path: str, **query: Any) -> JSON | None:
        """Return the object at `path`, or None if it does not exist."""
        try:
            return self.request("GET", path, query=query)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def list(self, path: str, **query: Any) -> list[JSON]:
        """Return the items of a list at `path`."""
        return cast(list[JSON], self.request("GET", path, query=query).get("items") or [])

    def create(self, path: str, body: Mapping[str, Any]) -> JSON:
        """POST `body` to the collection at `path`."""
        return self.request("POST", path, body)

    def patch(self, path: str, body: Mapping[str, Any], *, kind: str = "merge") -> JSON:
        """PATCH with a merge (`merge`) or strategic merge (`strategic`) patch."""
        content_type = {
            "merge": "application/merge-patch+json",
            "strategic": "application/strategic-merge-patch+json",
        }[kind]
        return self.request("PATCH", path, body, content_type=content_type)

    def apply(self, path: str, body: Mapping[str, Any], manager: str) -> JSON:
        """Server-side apply `body` to the object at `path`."""
        return self.request(
            "PATCH",
            path,
            json.dumps(body),
            query={"fieldManager": manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def delete(self, path: str, body: Mapping[str, Any] | None = None) -> bool:
        """DELETE the object at `path`; return False if it was already gone."""
        try:
            self.request("DELETE", path, body)
        except ApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    def watch(
        self, path: str, resource_version: str, timeout: int = 60, **query: Any
    ) -> Iterator[JSON]:
        """Yield watch events ({type, object}) from `resource_version` for up to `timeout` s."""
        params = {
            "watch": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout),
            "allowWatchBookmarks": "true",
            **query,
        }
        response = self.pool.request(
            "GET",
            self._url(path, params),
            headers=self.headers,
            preload_content=False,
            timeout=urllib3.Timeout(connect=10, read=timeout + 10),
            retries=False,
        )
        try:
            if response.status >= 300:
                raise ApiError(response.status, response.read().decode(errors="replace"))
            buffer = b""
            for chunk in response.stream(4096):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield cast(JSON, json.loads(line))
        finally:
            response.release_conn()
