"""The operator's cross-site audit of a ring or a mesh: it names every site's store, and its
own mirror id so the run can tell the others' ids apart (docs/audit.md, "Three sites or
more"); the CRD takes the further stores only beside `mirrorStoreUrl`, on S3."""

from __future__ import annotations

from typing import Any

import pytest
from apiserver import install_crd

from twinmq.audit.cross_sites import parse_site_ids, site_names
from twinmq.operator.audit_builders import build_audit_job, build_spark_application
from twinmq.operator.builders import ClusterRef
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec

CLUSTER = ClusterRef("orders", "site-a", "uid-1")
STORE, STORE_B, STORE_C = "s3://audits/a", "s3://audits/b", "s3://audits/c"


def _spec(**audit: Any) -> BrokerClusterSpec:
    return BrokerClusterSpec.model_validate(
        {"audit": {"enabled": True, "storeUrl": STORE, "storeSecretName": "s3", **audit}}
    )


def _args(obj: dict[str, Any]) -> list[str]:
    if obj["kind"] == "Job":
        return list(obj["spec"]["template"]["spec"]["containers"][0]["args"])
    return list(obj["spec"]["arguments"])


def test_a_mesh_sites_cross_site_run_names_every_store_and_its_own_mirror_id() -> None:
    spec = _spec(mirrorStoreUrl=STORE_B, moreMirrorStoreUrls=[STORE_C])
    for build in (build_audit_job, build_spark_application):
        args = _args(build(CLUSTER, spec, "orders-audit-1", "requested", "sites"))
        assert args[:10] == [
            "--store", STORE, "--run-id", "orders-audit-1", "--mirror-store", STORE_B,
            "--mirror-store", STORE_C, "--site-ids", "site-a/orders,,",
        ]  # fmt: skip
        # What the program makes of it: this site is `a`, the two others left to the logs.
        ids = parse_site_ids(args[9], site_names(3))
        assert ids == {"a": "site-a/orders"}


def test_two_sites_runs_are_unchanged() -> None:
    args = _args(build_audit_job(CLUSTER, _spec(mirrorStoreUrl=STORE_B), "r", "x", "sites"))
    assert "--site-ids" not in args and args.count("--mirror-store") == 1


@pytest.fixture(scope="module")
def crd_kube(kube_apiserver: Any) -> Kube:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    return api


def test_the_crd_takes_further_stores_only_beside_mirror_store_url_and_on_s3(
    crd_kube: Kube,
) -> None:
    def apply(name: str, audit: dict[str, Any]) -> None:
        mirror = {"role": "bidirectional", "secretName": "dr",
                  "targets": [{"host": "b.svc"}, {"host": "c.svc"}]}  # fmt: skip
        crd_kube.apply({
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"mirror": mirror, "audit": {"enabled": True, "storeUrl": STORE, **audit}},
        })  # fmt: skip

    message = "moreMirrorStoreUrls are a ring's or a mesh's further sites' audit stores"
    with pytest.raises(Refused) as refused:
        apply("alone", {"moreMirrorStoreUrls": [STORE_C]})
    assert message in str(refused.value)
    with pytest.raises(Refused) as refused:
        apply("not-s3", {"mirrorStoreUrl": STORE_B, "moreMirrorStoreUrls": ["/data/c"]})
    assert message in str(refused.value)
    apply("mesh-site", {"mirrorStoreUrl": STORE_B, "moreMirrorStoreUrls": [STORE_C]})
