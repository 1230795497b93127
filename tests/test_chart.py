"""The Helm chart (helm/twinmq): lint, rendered manifests validated against the Kubernetes
schemas (kubernetes-validate), the operator's RBAC pinned to what the code calls, the
hardened Deployment, and the CRD in the chart's crds/ equal to the generated one.

Fast (helm renders locally, no cluster). The tests that run helm are skipped when no helm
binary is found: the local cluster's cached build (`make cluster-binaries`) or `helm` on
PATH.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from twinmq.broker.names import OPERATOR_NAMESPACES_ENV
from twinmq.operator import leader
from twinmq.operator.netpolicy import OPERATOR_NAMESPACE_ENV, OPERATOR_SELECTOR_ENV, OperatorPods

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "twinmq"
KUBERNETES_VERSION = "1.36"  # the local cluster's (localcluster/versions.py)

Obj = dict[str, Any]
Rule = tuple[str, str, tuple[str, ...]]

# What the operator calls, per (apiGroup, resource): operator/kube.py, operator/main.py
# and kopf itself. docs/helm-chart.md explains each line; change both together.
OPERATOR_RULES: set[Rule] = {
    ("twinmq.io", "brokerclusters", ("get", "list", "patch", "watch")),
    ("twinmq.io", "brokerclusters/status", ("patch",)),
    ("twinmq.io", "brokerclusters/finalizers", ("update",)),
    ("", "pods", ("create", "delete", "get", "list", "patch", "watch")),
    ("", "secrets", ("create", "get", "patch")),
    ("", "persistentvolumeclaims", ("create", "get", "patch")),
    ("", "services", ("create", "get", "patch")),
    ("", "serviceaccounts", ("create", "get", "patch")),
    ("", "configmaps", ("create", "delete", "get", "patch")),
    ("networking.k8s.io", "networkpolicies", ("create", "delete", "get", "patch")),
    ("", "events", ("create",)),
    ("coordination.k8s.io", "leases", ("create", "get", "patch", "update")),
    ("rbac.authorization.k8s.io", "roles", ("create", "get", "patch")),
    ("rbac.authorization.k8s.io", "rolebindings", ("create", "get", "patch")),
    ("policy", "poddisruptionbudgets", ("create", "get", "patch")),
    ("batch", "jobs", ("create", "delete", "get", "list")),
    ("sparkoperator.k8s.io", "sparkapplications", ("create", "delete", "get", "list")),
    ("cert-manager.io", "certificates", ("create", "get", "patch")),
}
# kopf's CRD watch: cluster-wide mode only (namespace mode disables kopf's scanning).
CLUSTER_ONLY_RULES: set[Rule] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
}


def _find_helm() -> str | None:
    try:
        from twinmq.localcluster.binaries import find

        return str(find("helm"))
    except (FileNotFoundError, KeyError, ImportError):
        return shutil.which("helm")


HELM = _find_helm()
NO_HELM = (
    "no helm binary: run `make cluster-binaries` (builds it into the TwinMQ cache) "
    "or put helm on PATH"
)


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Run helm with private cache/config folders; return stdout (fail with stderr)."""
    if HELM is None:
        pytest.skip(NO_HELM)
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(
        os.environ,
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
    )
    env.pop("KUBECONFIG", None)

    def run(*args: str, check: bool = True) -> str:
        assert HELM is not None
        proc = subprocess.run(
            [HELM, *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout + proc.stderr

    return run


def render(helm: Callable[..., str], *sets: str, namespace: str = "tmq") -> list[Obj]:
    """The chart's manifests (CRDs included) for the given `--set` values."""
    args = ["template", "rel", str(CHART), "--namespace", namespace, "--include-crds"]
    for value in sets:
        args += ["--set", value]
    return [doc for doc in yaml.safe_load_all(helm(*args)) if doc]


def kinds(docs: list[Obj]) -> list[str]:
    """The kinds of the rendered objects."""
    return sorted(doc["kind"] for doc in docs)


def one(docs: list[Obj], kind: str) -> Obj:
    """The only rendered object of `kind`."""
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}: {kinds(docs)}"
    return found[0]


def rules(role: Obj) -> set[Rule]:
    """A Role's rules as (apiGroup, resource, sorted verbs), one per resource."""
    out: set[Rule] = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.add((group, resource, tuple(sorted(rule["verbs"]))))
    return out


SCOPES = {
    "cluster-scope": ("operator.rbac.scope=cluster",),
    "namespace-scope": ("operator.rbac.scope=namespace",),
    "standalone-broker": ("broker.enabled=true", "operator.enabled=false"),
    "everything": ("broker.enabled=true", "operator.rbac.scope=namespace"),
    "two-operators": ("operator.replicas=2",),
    "helm-test": ("test.brokerCluster.name=orders", "test.brokerCluster.namespace=shop"),
}


def test_chart_crd_is_the_generated_one() -> None:
    chart_crd = CHART / "crds" / "brokercluster.yaml"
    generated = REPO / "crds" / "brokercluster.yaml"
    assert chart_crd.read_text() == generated.read_text(), (
        "helm/twinmq/crds/brokercluster.yaml differs from crds/brokercluster.yaml "
        "(generated by `python -m twinmq.operator.crd`): "
        "cp crds/brokercluster.yaml helm/twinmq/crds/"
    )


@pytest.mark.parametrize("values", SCOPES.values(), ids=SCOPES.keys())
def test_helm_lint(helm: Callable[..., str], values: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for value in values:
        args += ["--set", value]
    assert "0 chart(s) failed" in helm(*args)


@pytest.mark.parametrize("values", SCOPES.values(), ids=SCOPES.keys())
def test_rendered_manifests_are_valid(helm: Callable[..., str], values: tuple[str, ...]) -> None:
    import kubernetes_validate

    docs = render(helm, *values)
    assert docs
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            name = doc.get("metadata", {}).get("name")
            pytest.fail(f"{doc['kind']} {name}: {error.message} at {list(error.path)}")


def test_defaults_install_the_operator_cluster_wide_and_no_standalone_broker(
    helm: Callable[..., str],
) -> None:
    docs = render(helm)
    assert kinds(docs) == [
        "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Deployment",
        "ServiceAccount", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    ]  # fmt: skip
    role = one(docs, "ClusterRole")
    assert rules(role) == OPERATOR_RULES | CLUSTER_ONLY_RULES
    assert not any(resource == "namespaces" for _, resource, _ in rules(role))
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }  # fmt: skip
    account = one(docs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": "tmq"}
    ]
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"] for e in container["env"]}
    assert OPERATOR_NAMESPACES_ENV not in env  # all namespaces


def test_namespace_scope_grants_nothing_cluster_wide_and_watches_its_namespace(
    helm: Callable[..., str],
) -> None:
    docs = render(helm, "operator.rbac.scope=namespace", namespace="team-a")
    assert kinds(docs) == [
        "CustomResourceDefinition", "Deployment", "Role", "RoleBinding", "ServiceAccount",
    ]  # fmt: skip
    role = one(docs, "Role")
    assert role["metadata"]["namespace"] == "team-a"
    assert rules(role) == OPERATOR_RULES
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"]["kind"] == "Role"
    assert binding["metadata"]["namespace"] == "team-a"
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    watch = next(e for e in container["env"] if e["name"] == OPERATOR_NAMESPACES_ENV)
    assert watch["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_operator_deployment_is_hardened(helm: Callable[..., str]) -> None:
    deployment = one(render(helm, "image.tag=1.2.3"), "Deployment")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    (container,) = pod["containers"]
    assert container["image"] == "twinmq/twinmq:1.2.3"
    assert container["command"] == ["twinmq-operator"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] > 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["ports"] == [
        {"name": "health", "containerPort": 8080}, {"name": "metrics", "containerPort": 8081},
    ]  # fmt: skip
    assert {"name": "tmp", "mountPath": "/var/run/twinmq-tmp"} in container["volumeMounts"]
    assert {"name": "TMPDIR", "value": "/var/run/twinmq-tmp"} in container["env"]


def operator_env(docs: list[Obj]) -> dict[str, Any]:
    """The operator container's environment: name -> value, or its valueFrom."""
    container = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def field_ref(path: str) -> Obj:
    """An EnvVar's valueFrom of the pod's own `path` (downward API)."""
    return {"fieldRef": {"fieldPath": path}}


def test_two_operators_elect_a_leader_with_a_lease_in_the_release_namespace(
    helm: Callable[..., str],
) -> None:
    docs = render(helm, "operator.replicas=2")
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # A new pod stands by (Ready) before the old leader goes and releases the Lease.
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }  # fmt: skip
    env = operator_env(docs)
    assert env[leader.ELECTION_ENV] == "true"
    assert env[leader.LEASE_NAME_ENV] == "rel-twinmq-operator-leader"
    assert env[leader.LEASE_NAMESPACE_ENV] == field_ref("metadata.namespace")
    assert env[leader.IDENTITY_ENV] == field_ref("metadata.name")
    timings = {
        env[name] for name in
        (leader.LEASE_SECONDS_ENV, leader.RENEW_DEADLINE_ENV, leader.RETRY_SECONDS_ENV)
    }  # fmt: skip
    assert timings == {"15", "10", "2"}
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"] == {
        "minAvailable": 1, "selector": deployment["spec"]["selector"],
    }  # fmt: skip
    # The Lease's RBAC is the operator's rules (leases: get, create, update) in the
    # release namespace, in both scopes.
    assert ("coordination.k8s.io", "leases", ("create", "get", "patch", "update")) in rules(
        one(docs, "ClusterRole")
    )


def test_one_operator_elects_itself_and_has_no_disruption_budget(
    helm: Callable[..., str],
) -> None:
    docs = render(helm)
    assert operator_env(docs)[leader.ELECTION_ENV] == "true"
    assert one(docs, "Deployment")["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "PodDisruptionBudget" not in kinds(docs)


def test_without_leader_election_one_operator_runs_alone_and_is_recreated(
    helm: Callable[..., str],
) -> None:
    docs = render(helm, "operator.leaderElection.enabled=false")
    assert one(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert leader.ELECTION_ENV not in operator_env(docs)


REFUSED_VALUES = {
    "two-without-election": (
        ("operator.replicas=2", "operator.leaderElection.enabled=false"),
        "at '/operator/leaderElection/enabled': value must be true",
    ),
    "four-replicas": (("operator.replicas=4",), "at '/operator/replicas': maximum"),
    "negative-replicas": (("operator.replicas=-1",), "at '/operator/replicas': minimum"),
    "renew-deadline-past-the-lease": (
        ("operator.leaderElection.renewDeadlineSeconds=15",),
        "retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds",
    ),
    "retry-past-the-renew-deadline": (
        ("operator.leaderElection.retryPeriodSeconds=10",),
        "retryPeriodSeconds < renewDeadlineSeconds < leaseDurationSeconds",
    ),
    "misspelt-timing": (
        ("operator.leaderElection.retrySeconds=1",),
        "additional properties 'retrySeconds' not allowed",
    ),
}


@pytest.mark.parametrize("sets,message", REFUSED_VALUES.values(), ids=REFUSED_VALUES.keys())
def test_values_the_operator_cannot_run_safely_are_refused(
    helm: Callable[..., str], sets: tuple[str, ...], message: str
) -> None:
    args = ["template", "rel", str(CHART)]
    for value in sets:
        args += ["--set", value]
    out = helm(*args, check=False)
    assert "Error:" in out and message in out


def test_image_tag_defaults_to_the_app_version(helm: Callable[..., str]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    deployment = one(render(helm), "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"twinmq/twinmq:{chart['appVersion']}"


def test_standalone_broker_is_opt_in(helm: Callable[..., str]) -> None:
    assert "StatefulSet" not in kinds(render(helm))
    docs = render(helm, "broker.enabled=true", "operator.enabled=false")
    assert kinds(docs) == [
        "CustomResourceDefinition", "Secret", "Secret", "Service", "Service", "StatefulSet",
    ]  # fmt: skip


def test_an_unknown_rbac_scope_is_refused(helm: Callable[..., str]) -> None:
    out = helm(
        "template", "rel", str(CHART), "--set", "operator.rbac.scope=everywhere", check=False
    )
    assert 'operator.rbac.scope must be "cluster" or "namespace"' in out


def test_operator_watches_the_namespaces_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from twinmq.operator.main import watched_namespaces

    monkeypatch.delenv(OPERATOR_NAMESPACES_ENV, raising=False)
    assert watched_namespaces([]) == []
    assert watched_namespaces(["--namespace", "a", "-n", "b"]) == ["a", "b"]
    monkeypatch.setenv(OPERATOR_NAMESPACES_ENV, "team-a, team-b,")
    assert watched_namespaces([]) == ["team-a", "team-b"]
    assert watched_namespaces(["-n", "c"]) == ["c"]  # the option wins


def test_helm_test_publishes_and_consumes_through_the_brokerclusters_virtual_ip(
    helm: Callable[..., str],
) -> None:
    from twinmq.broker.names import AMQP_PORT
    from twinmq.client import roundtrip
    from twinmq.operator.builders import ClusterRef, build_vip_service, generate_credentials

    assert "Pod" not in kinds(render(helm))  # no BrokerCluster named: no test
    docs = render(helm, *SCOPES["helm-test"])
    pod = one(docs, "Pod")
    assert pod["metadata"]["namespace"] == "shop"  # where the cluster's Secret is
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert (
        container["image"]
        == one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    assert container["command"] == ["python3", "-m", roundtrip.__name__]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    prefix = roundtrip.ENV_PREFIX
    vip = build_vip_service(ClusterRef(name="orders", namespace="shop", uid="u"))
    assert env[prefix + "HOST"] == f"{vip['metadata']['name']}.shop.svc"
    assert env[prefix + "PORT"] == str(AMQP_PORT)
    assert {p["port"] for p in vip["spec"]["ports"]} == {AMQP_PORT}
    # The generated Secret's keys (operator/builders.py).
    credentials = generate_credentials()
    for variable, key in (("USERNAME", "username"), ("PASSWORD", "password")):
        assert env[prefix + variable] == {"secretKeyRef": {"name": "orders-auth", "key": key}}
        assert key in credentials
    # What the environment names is what the check reads.
    assert (
        roundtrip.amqp_url(
            {prefix + "HOST": "h", prefix + "USERNAME": "u", prefix + "PASSWORD": "p/w"}
        )
        == "amqp://u:p%2Fw@h:5672/%2F"
    )


def test_chart_package_makes_a_chart_repository_that_renders_like_the_folder(
    helm: Callable[..., str], tmp_path: Path
) -> None:
    import hashlib

    assert HELM is not None
    dist = tmp_path / "charts"
    subprocess.run(
        ["make", "-s", "chart-package", f"CHART_DIST={dist}", f"HELM={HELM}",
         "CHART_REPO_URL=https://charts.example.org/twinmq"],
        cwd=REPO, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    package = dist / f"twinmq-{chart['version']}.tgz"
    index = yaml.safe_load((dist / "index.yaml").read_text())
    (entry,) = index["entries"]["twinmq"]
    assert (entry["version"], entry["appVersion"]) == (chart["version"], chart["appVersion"])
    assert entry["digest"] == hashlib.sha256(package.read_bytes()).hexdigest()
    assert entry["urls"] == [f"https://charts.example.org/twinmq/{package.name}"]
    sets = ("monitoring.prometheusRule.enabled=true", "monitoring.grafanaDashboard.enabled=true")
    args = [arg for value in sets for arg in ("--set", value)]
    packaged = helm("template", "rel", str(package), "--namespace", "tmq", *args)
    assert packaged == helm("template", "rel", str(CHART), "--namespace", "tmq", *args)
    assert "kind: PrometheusRule" in packaged  # the files under monitoring/ were packaged


def test_the_operator_knows_its_own_pods_for_the_brokers_network_policy(
    helm: Callable[..., str],
) -> None:
    """The chart tells the operator its namespace and pod labels; the NetworkPolicy's admin
    rule (operator/netpolicy.py) selects exactly the chart's operator pods with them."""
    deployment = one(render(helm, namespace="ops"), "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env[OPERATOR_NAMESPACE_ENV]["valueFrom"] == {
        "fieldRef": {"fieldPath": "metadata.namespace"}
    }
    pods = OperatorPods.from_env(
        {OPERATOR_NAMESPACE_ENV: "ops", OPERATOR_SELECTOR_ENV: env[OPERATOR_SELECTOR_ENV]["value"]}
    )
    assert pods is not None
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pods.labels == deployment["spec"]["selector"]["matchLabels"]
    assert pods.labels.items() <= template_labels.items()


def test_the_admission_policy_carries_the_charts_image_allow_list(
    helm: Callable[..., str],
) -> None:
    def allowed(*sets: str) -> str:
        docs = render(helm, *sets)
        (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
        return next(v["expression"] for v in vap["spec"]["variables"]
                    if v["name"] == "allowedImages")  # fmt: skip

    assert allowed() == "[]"
    prefixes = "admissionPolicy.allowedImagePrefixes={docker.io/twinmq/,registry.example/}"
    assert allowed(prefixes) == '["docker.io/twinmq/","registry.example/"]'
