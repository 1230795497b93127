"""spec.federation upstreams over amqps (issue 16): the file the broker reads names the
upstream's CA (from a ConfigMap) and a client certificate (from a Secret), mounted as files;
the CRD's rules on a real API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_operator_federation import (
    REMOTE,
    container,
    crd_kube,  # noqa: F401 (the fixture)
    create,
    downstream,
    spec,
)

from twinmq.broker.federation.config import load
from twinmq.operator import federation
from twinmq.operator.builders import build_federation_config_map, build_pod
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION

TLS = {"caConfigMap": "central-ca", "clientSecret": "remote-federation-client"}


def with_tls(tls: dict[str, Any]) -> dict[str, Any]:
    fed = downstream()
    fed["upstreams"][0]["tls"] = tls
    return fed


def test_an_upstream_cluster_with_tls_is_dialled_on_amqps_and_verified_by_its_ca(
    tmp_path: Path,
) -> None:
    wanted = spec(with_tls(TLS))
    config_map = build_federation_config_map(REMOTE, wanted)
    assert config_map is not None
    path = tmp_path / "federation.yaml"
    path.write_text(config_map["data"]["federation.yaml"])
    central = load(path).upstreams["central"]  # what the broker reads at start-up
    assert central.uri == "amqps://twinmq-federation@central.site-a.svc:5671/"
    folder = Path(federation.TLS_DIR, "central")
    assert (central.tls_ca, central.tls_cert, central.tls_key) == (
        folder / "ca.crt", folder / "tls.crt", folder / "tls.key"
    )  # fmt: skip
    pod = build_pod(REMOTE, wanted, "primary")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    ca, client = volumes[federation.TLS_VOLUME]["projected"]["sources"]
    assert ca["configMap"] == {
        "name": "central-ca", "items": [{"key": "ca.crt", "path": "central/ca.crt"}]
    }  # fmt: skip
    assert client["secret"]["name"] == "remote-federation-client"
    assert {i["path"] for i in client["secret"]["items"]} == {"central/tls.crt", "central/tls.key"}
    mounts = {m["name"]: m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert mounts[federation.TLS_VOLUME] == federation.TLS_DIR


def test_an_upstream_without_tls_leaves_the_file_and_the_pods_as_they_were() -> None:
    plain = spec(downstream())
    config_map = build_federation_config_map(REMOTE, plain)
    assert config_map is not None and "tls" not in config_map["data"]["federation.yaml"]
    pod = build_pod(REMOTE, plain, "primary")
    assert federation.TLS_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}


def test_the_crd_refuses_tls_on_a_plain_amqp_uri(crd_kube: Kube) -> None:  # noqa: F811
    fed = {"upstreams": [{"name": "c", "uri": "amqp://u@h/", "passwordSecret": {"name": "s"},
                          "tls": {"caConfigMap": "c-ca"}}]}  # fmt: skip
    with pytest.raises(Refused) as refused:
        create(crd_kube, "bad-tls", fed)
    assert "needs an amqps:// uri" in str(refused.value)


def test_the_crd_takes_federation_and_mirror_tls(crd_kube: Kube) -> None:  # noqa: F811
    fed = {"upstreams": [{"name": "c", "uri": "amqps://u@h/", "passwordSecret": {"name": "s"},
                          "tls": {"caConfigMap": "c-ca", "serverName": "h.example"}}]}  # fmt: skip
    create(crd_kube, "fed-tls", fed)
    crd_kube.apply({
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": "mirror-tls", "namespace": "default"},
        "spec": {"mirror": {"role": "replica", "secretName": "dr", "tls": {
            "caConfigMap": "site-a-ca", "serverNames": ["dr.example.com"]}}},
    })  # fmt: skip
    found = crd_kube.get(f"{GROUP}/{VERSION}", KIND, "default", "mirror-tls")
    assert found is not None
    assert found["spec"]["mirror"]["tls"]["caConfigMap"] == "site-a-ca"
