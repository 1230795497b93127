"""The local cluster's NetworkPolicy engine (kube-router's firewall controller): what runs
of it, how it is built, and where it starts. Pure: no cluster, no build."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinmq.localcluster import binaries, cluster
from twinmq.localcluster.binaries import needed
from twinmq.localcluster.layout import NODE_NAME, SERVICE_CIDR, Layout
from twinmq.localcluster.versions import BINARIES, KUBE_ROUTER_UPGRADES, Binary

LAYOUT = Layout(Path("/srv/c"))


def kube_router() -> Binary:
    return next(b for b in BINARIES if b.name == cluster.POLICY_ENGINE)


def test_only_the_firewall_controller_runs_with_no_listener(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(binaries, "find", lambda name: Path("/cache") / name)
    argv = cluster._argv(LAYOUT, cluster.POLICY_ENGINE)
    assert argv[0] == "/cache/kube-router"
    # The router (GoBGP's unauthenticated gRPC server, GHSA-v5mh-h5hx-7v92) and the service
    # proxy (externalIPs trusted, GHSA-phqm-jgc3-qf8g) are where v2.1.0's flaws are.
    for flag in ("--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
                 "--run-loadbalancer=false", "--enable-cni=false"):  # fmt: skip
        assert flag in argv
    # Its health server would listen on every address; metrics are off unless a port is set.
    assert "--health-port=0" in argv
    assert not any(arg.startswith("--metrics-port") for arg in argv)
    assert f"--hostname-override={NODE_NAME}" in argv
    assert f"--service-cluster-ip-range={SERVICE_CIDR}" in argv


def test_it_starts_last_in_both_node_modes_and_is_built_by_default() -> None:
    for mode in ("agent", "kubelet"):
        assert cluster.components(mode)[-1] == cluster.POLICY_ENGINE
        assert cluster.POLICY_ENGINE in {b.name for b in needed(mode)}
    assert "ipset" in cluster.HOST_PACKAGES


def test_its_vulnerable_dependencies_are_bumped_and_name_the_cache_folder() -> None:
    binary = kube_router()
    assert binary.upgrades == KUBE_ROUTER_UPGRADES
    assert any(u.startswith("golang.org/x/net@") for u in binary.upgrades)
    assert binary.cache_key.startswith(f"kube-router-{binary.version}-")
    # Other bumps are another binary, never the cached one.
    other = Binary(**{**binary.__dict__, "upgrades": ("golang.org/x/net@v0.0.1",)})
    assert other.cache_key != binary.cache_key
