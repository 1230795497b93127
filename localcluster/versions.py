"""Pinned versions of every binary the local cluster builds from the Go module proxy."""

from __future__ import annotations

from dataclasses import dataclass

KUBERNETES_VERSION = "v1.36.3"
"""The `k8s.io/kubernetes` release; its staging modules are pinned to the matching v0.X.Y."""

ETCD_VERSION = "v3.6.16"
COREDNS_VERSION = "v1.14.7"
HELM_VERSION = "v3.22.0"
SPARK_OPERATOR_VERSION = "v2.3.0"
"""The Kubeflow Spark Operator (the controller of `spec.audit.launcher: sparkApplication`)."""


def staging_version(kubernetes_version: str = KUBERNETES_VERSION) -> str:
    """Return the staging-module version matching a Kubernetes release (v1.36.3 -> v0.36.3)."""
    major, minor, patch = kubernetes_version.lstrip("v").split(".", 2)
    if major != "1":
        raise ValueError(f"unexpected Kubernetes version {kubernetes_version!r}")
    return f"v0.{minor}.{patch}"


@dataclass(frozen=True)
class Binary:
    """One executable to build: which Go module and package, and how to stamp its version."""

    name: str
    module: str
    version: str
    package: str
    ldflags: tuple[str, ...] = ()
    kubernetes_staging: bool = False
    node_mode: str | None = None
    """Built by default only for a cluster with this node mode (`$TWINMQ_NODE`)."""
    on_demand: bool = False
    """Never built by default: only when named (`python -m twinmq.localcluster.binaries NAME`)."""

    @property
    def cache_key(self) -> str:
        """The folder (under the cache's `k8s/`) that holds this binary."""
        if self.kubernetes_staging:
            return self.version
        return f"{self.name}-{self.version}"


def _kube(name: str, node_mode: str | None = None) -> Binary:
    version = KUBERNETES_VERSION
    stamp = "k8s.io/component-base/version"
    return Binary(
        name=name,
        module="k8s.io/kubernetes",
        version=version,
        package=f"k8s.io/kubernetes/cmd/{name}",
        ldflags=(
            f"-X {stamp}.gitVersion={version}",
            f"-X {stamp}.gitMajor=1",
            f"-X {stamp}.gitMinor={version.split('.')[1]}",
            f"-X {stamp}.gitTreeState=clean",
            "-X k8s.io/client-go/pkg/version.gitVersion=" + version,
        ),
        kubernetes_staging=True,
        node_mode=node_mode,
    )


BINARIES: tuple[Binary, ...] = (
    Binary(
        name="etcd",
        module="go.etcd.io/etcd/server/v3",
        version=ETCD_VERSION,
        package="go.etcd.io/etcd/server/v3",
    ),
    _kube("kube-apiserver"),
    _kube("kube-controller-manager"),
    _kube("kube-scheduler"),
    _kube("kube-proxy"),
    _kube("kubectl"),
    # Only `TWINMQ_NODE=kubelet` runs it (localcluster/kubelet.py); stays on 1.36: 1.37
    # drops the cgroup-driver fallback that Debian 12's containerd 1.6 needs.
    _kube("kubelet", node_mode="kubelet"),
    Binary(
        name="coredns",
        module="github.com/coredns/coredns",
        version=COREDNS_VERSION,
        package="github.com/coredns/coredns",
    ),
    Binary(
        name="helm",
        module="helm.sh/helm/v3",
        version=HELM_VERSION,
        package="helm.sh/helm/v3/cmd/helm",
        ldflags=(f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",),
    ),
    # The Kubeflow Spark Operator's controller, for the SparkApplication audit on the real
    # node (`make spark-operator`, e2e/test_audit_spark_operator.py); a few minutes to
    # build, so only on demand.
    Binary(
        name="spark-operator",
        module="github.com/kubeflow/spark-operator/v2",
        version=SPARK_OPERATOR_VERSION,
        package="github.com/kubeflow/spark-operator/v2/cmd/operator",
        ldflags=(
            "-X github.com/kubeflow/spark-operator/v2.version=" + SPARK_OPERATOR_VERSION,
            "-X github.com/kubeflow/spark-operator/v2.gitTreeState=clean",
        ),
        on_demand=True,
    ),
)
"""Build order: the small ones first so a cluster can start as early as possible."""
