"""The chart's ValidatingAdmissionPolicy (operator/admission.py) on a real API server: a
BrokerCluster is admitted only if its author may create pods there and read every
Secret it names. Authors are impersonated users with Roles of their own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from apiserver import install_crd
from kubernetes.client.exceptions import ApiException

from twinmq.operator.admission import binding, chart_template, policy
from twinmq.operator.kube import Kube
from twinmq.operator.models import GROUP, KIND, PLURAL, VERSION
from twinmq.testing.waiting import wait_for

TEMPLATE = Path(__file__).resolve().parent.parent / "helm/twinmq/templates/admission-policy.yaml"
NAMESPACE = "admission"


def test_the_charts_template_is_the_generated_policy() -> None:
    assert TEMPLATE.read_text() == chart_template()


def role(kube: Kube, user: str, rules: list[dict[str, Any]]) -> None:
    """A Role with `rules` bound to `user` in the test namespace."""
    meta = {"name": user, "namespace": NAMESPACE}
    kube.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                "metadata": meta, "rules": rules})  # fmt: skip
    kube.apply({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    })  # fmt: skip


CREATE_CLUSTERS = {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["create", "get"]}
CREATE_PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}


def read_secret(name: str) -> dict[str, Any]:
    return {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [name], "verbs": ["get"]}


@pytest.fixture(scope="module")
def admin(kube_apiserver: Any) -> Iterator[Kube]:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)
    api.core.create_namespace({"metadata": {"name": NAMESPACE}})
    role(api, "builder", [CREATE_CLUSTERS, CREATE_PODS, read_secret("builder-creds")])
    role(api, "no-pods", [CREATE_CLUSTERS, read_secret("builder-creds")])
    api.apply(policy())
    api.apply(binding())
    yield api


def create_as(kube_apiserver: Any, user: str, name: str, spec: dict[str, Any]) -> None:
    """Create a BrokerCluster as `user` (impersonated; dry run: nothing is stored)."""
    api = Kube(str(kube_apiserver.kubeconfig))
    api.api.set_default_header("Impersonate-User", user)
    resource = api.dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=KIND)
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}  # fmt: skip
    resource.create(body=body, namespace=NAMESPACE, query_params=[("dryRun", "All")])


def refusal(kube_apiserver: Any, user: str, spec: dict[str, Any]) -> str:
    """The API server's refusal of `spec` by `user` (the policy is in force once it refuses)."""

    def refused() -> str | None:
        try:
            create_as(kube_apiserver, user, "refused", spec)
        except ApiException as exc:
            return str(exc.body)
        return None

    return wait_for(f"{user}'s BrokerCluster refused", refused, 30)


def test_an_author_who_may_create_pods_and_read_the_secret_gets_the_cluster(
    admin: Kube, kube_apiserver: Any
) -> None:
    refusal(kube_apiserver, "no-pods", {})  # the policy is in force
    create_as(kube_apiserver, "builder", "ok", {"auth": {"secretName": "builder-creds"}})


def test_an_author_who_may_not_create_pods_is_refused(admin: Kube, kube_apiserver: Any) -> None:
    text = refusal(kube_apiserver, "no-pods", {})
    assert "may not create pods in admission" in text and "no-pods" in text


@pytest.mark.parametrize(
    "spec",
    [
        {"auth": {"secretName": "someone-elses"}},
        {"audit": {"enabled": True, "storeUrl": "s3://a/b", "storeSecretName": "someone-elses"}},
        {"mirror": {"role": "replica", "secretName": "someone-elses"}},
        {"tls": {"secretName": "someone-elses"}},
        {"tls": {"clientCertificates": {"caSecretName": "someone-elses"}}},
        {"federation": {"upstreams": [{"name": "hq", "uri": "amqp://h/",
                                       "passwordSecret": {"name": "someone-elses"}}],
                        "exchanges": [{"exchange": "x", "upstream": "hq"}]}},
        {"federation": {"upstreams": [{"name": "hq", "clusterRef": {"name": "someone-elses"}}],
                        "exchanges": [{"exchange": "x", "upstream": "hq"}]}},
        {"federation": {"upstreams": [{"name": "hq", "uri": "amqps://u@h/",
                                       "passwordSecret": {"name": "builder-creds"},
                                       "tls": {"caConfigMap": "hq-ca",
                                               "clientSecret": "someone-elses"}}],
                        "exchanges": [{"exchange": "x", "upstream": "hq"}]}},
    ],
    ids=["auth", "audit-store", "mirror", "tls", "client-ca", "federation-password",
         "federation-cluster-ref", "federation-client-certificate"],
)  # fmt: skip
def test_naming_a_secret_the_author_may_not_read_is_refused(
    admin: Kube, kube_apiserver: Any, spec: dict[str, Any]
) -> None:
    text = refusal(kube_apiserver, "builder", spec)
    assert "someone-elses" in text.split("may not read one of: ")[1], text


def many_secrets(upstreams: int) -> dict[str, Any]:
    """A spec naming auth, mirror and, per federation upstream, a password and a client
    certificate Secret (each `builder-<n>`)."""
    ups = [{"name": f"u{i}", "uri": f"amqps://u@h{i}/",
            "passwordSecret": {"name": f"builder-pw-{i}"},
            "tls": {"caConfigMap": "ca", "clientSecret": f"builder-cert-{i}"}}
           for i in range(upstreams)]  # fmt: skip
    return {
        "auth": {"secretName": "builder-creds"},
        "mirror": {"role": "replica", "secretName": "builder-dr"},
        "federation": {"upstreams": ups, "exchanges": [{"exchange": "x", "upstream": "u0"}]},
    }


def test_a_spec_naming_many_secrets_stays_within_the_policys_cel_budget(
    admin: Kube, kube_apiserver: Any
) -> None:
    """Each Secret is checked in an expression of its own (an authorizer check costs about
    a third of one expression's budget): a spec naming eight Secrets (two upstreams over
    TLS) is admitted for an author who may read exactly those, and refused when one is
    not among them; a namespace-wide reader's sixteen upstreams cost one check."""
    spec = many_secrets(2)
    names = ["builder-creds", "builder-dr", *(f"builder-{k}-{i}" for i in range(2)
                                              for k in ("pw", "cert"))]  # fmt: skip
    role(admin, "exact", [CREATE_CLUSTERS, CREATE_PODS, *map(read_secret, names)])
    refusal(kube_apiserver, "no-pods", {})  # the policy is in force
    wait_for("admitted", lambda: _admitted(kube_apiserver, "exact", spec), 30)
    role(admin, "one-short", [CREATE_CLUSTERS, CREATE_PODS, *map(read_secret, names[:-1])])
    text = refusal(kube_apiserver, "one-short", spec)
    assert "builder-cert-1" in text and "cost" not in text, text
    reader = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}
    role(admin, "reader", [CREATE_CLUSTERS, CREATE_PODS, reader])
    wait_for("admitted", lambda: _admitted(kube_apiserver, "reader", many_secrets(16)), 30)


def _admitted(kube_apiserver: Any, user: str, spec: dict[str, Any]) -> bool:
    try:
        create_as(kube_apiserver, user, "many", spec)
    except ApiException as exc:
        print(exc.body)
        return False
    return True


def test_with_an_image_allow_list_an_image_from_elsewhere_is_refused(
    admin: Kube, kube_apiserver: Any
) -> None:
    allowed = policy('["docker.io/twinmq/", "registry.example/"]')
    allowed["metadata"]["name"] = "allow-list"
    bound = binding()
    bound["metadata"]["name"] = bound["spec"]["policyName"] = "allow-list"
    admin.apply(allowed)
    admin.apply(bound)
    try:
        text = refusal(kube_apiserver, "builder", {"image": "evil.example/twinmq:1"})
        assert "images must come from an allowed registry" in text, text
        assert "not evil.example/twinmq:1" in text, text
        audit = {"enabled": True, "storeUrl": "s3://a/b", "image": "evil.example/spark:1"}
        text = refusal(kube_apiserver, "builder", {"audit": audit})
        assert "not evil.example/spark:1" in text, text
        create_as(kube_apiserver, "builder", "ok", {"image": "registry.example/twinmq:2"})
        create_as(kube_apiserver, "builder", "default", {})  # twinmq/...: docker.io/twinmq/
        text = refusal(kube_apiserver, "builder", {"image": "evil/twinmq:1"})
        assert "not docker.io/evil/twinmq:1" in text, text  # no registry: Docker Hub's
    finally:
        admin.delete("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding",
                     None, "allow-list")  # fmt: skip
        admin.delete("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy", None,
                     "allow-list")  # fmt: skip
