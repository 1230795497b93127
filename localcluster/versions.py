"""Pinned versions of every binary the local cluster builds from the Go module proxy."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

KUBERNETES_VERSION = "v1.36.3"
"""The `k8s.io/kubernetes` release; its staging modules are pinned to the matching v0.X.Y."""

ETCD_VERSION = "v3.6.16"
COREDNS_VERSION = "v1.14.7"
HELM_VERSION = "v3.22.0"
SPARK_OPERATOR_VERSION = "v2.3.0"
KUBE_ROUTER_VERSION = "v2.1.0"
"""kube-router, run only as the NetworkPolicy engine (its firewall controller); the only
version the Go module proxy serves here. Its vulnerable dependencies are bumped by the
build's wrapper module (`KUBE_ROUTER_UPGRADES`); docs/security.md says what is left."""
KUBE_ROUTER_UPGRADES = (
    # HTTP/2 (CONTINUATION flood, CVE-2023-45288, and later), html and idna parsing.
    "golang.org/x/net@v0.62.0",
    "golang.org/x/sys@v0.50.0",
    # gRPC and protobuf (protojson's infinite loop, CVE-2024-24786); linked, not served:
    # the gRPC server is GoBGP's, and the router does not run.
    "google.golang.org/grpc@v1.85.0",
    "google.golang.org/protobuf@v1.36.12",
)
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
    upgrades: tuple[str, ...] = ()
    """`module@version`s the build's wrapper module requires over the binary's own go.mod
    (dependency bumps for known vulnerabilities)."""

    @property
    def cache_key(self) -> str:
        """The folder (under the cache's `k8s/`) that holds this binary."""
        if self.kubernetes_staging:
            return self.version
        if self.upgrades:
            # Other bumps are another binary: rebuilt, not taken from the cache.
            digest = hashlib.sha256("\n".join(self.upgrades).encode()).hexdigest()[:8]
            return f"{self.name}-{self.version}-{digest}"
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
    # The NetworkPolicy engine: kube-router's firewall controller only (cluster.py runs it
    # with the router and the service proxy off). Built after the cluster's own binaries.
    Binary(
        name="kube-router",
        module="github.com/cloudnativelabs/kube-router/v2",
        version=KUBE_ROUTER_VERSION,
        package="github.com/cloudnativelabs/kube-router/v2/cmd/kube-router",
        ldflags=(
            "-X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version="
            + KUBE_ROUTER_VERSION,
        ),
        upgrades=KUBE_ROUTER_UPGRADES,
    ),
)
"""Build order: the small ones first so a cluster can start as early as possible."""
