"""The host network guard: no pod or service packet may leave through another interface."""

from __future__ import annotations

from twinmq.localcluster.hostnet import guard_rules, kube_jumps, mangle_guard_rules
from twinmq.localcluster.layout import BRIDGE, POD_CIDR, SERVICE_CIDR


def test_guard_drops_pod_traffic_leaving_the_bridge() -> None:
    rules = [" ".join(rule) for _, rule in guard_rules()]
    assert f"-s {POD_CIDR} ! -o {BRIDGE} -j DROP" in rules
    assert f"-d {POD_CIDR} ! -o {BRIDGE} -j DROP" in rules
    assert f"-i {BRIDGE} ! -o {BRIDGE} -j DROP" in rules


def test_guard_rejects_service_addresses_left_untranslated() -> None:
    rules = [" ".join(rule) for _, rule in guard_rules()]
    assert f"-d {SERVICE_CIDR} -j REJECT" in rules
    # Loopback is exempt first, so the host reaches its own API server on the bridge IP.
    assert rules[0] == "-o lo -j RETURN"


def test_mangle_guard_drops_forwarded_pod_traffic_leaving_the_bridge() -> None:
    # The policy engine ACCEPTs compliant pod traffic in the filter table ahead of the
    # guard, so the drops must also hold where it does not reach: the mangle table.
    rules = [" ".join(rule) for _, rule in mangle_guard_rules()]
    assert rules == [
        f"-s {POD_CIDR} ! -o {BRIDGE} -j DROP",
        f"-d {POD_CIDR} ! -o {BRIDGE} -j DROP",
        f"-i {BRIDGE} ! -o {BRIDGE} -j DROP",
    ]


def test_jumps_to_kube_chains_keep_their_quoted_comment_as_one_argument() -> None:
    # kube-router's jumps carry a comment with spaces; split naively, `-D` matched nothing
    # and its chains outlived `make cluster-down`.
    listing = [
        "-P FORWARD ACCEPT",
        "-N KUBE-ROUTER-FORWARD",
        '-A FORWARD -m comment --comment "kube-router netpol - TEMCG2JMHZYE7H7T" '
        "-j KUBE-ROUTER-FORWARD",
        "-A FORWARD -j TWINMQ-GUARD",
        "-A KUBE-ROUTER-FORWARD -j KUBE-POD-FW-X",
    ]
    assert kube_jumps(listing) == [
        ["FORWARD", "-m", "comment", "--comment", "kube-router netpol - TEMCG2JMHZYE7H7T",
         "-j", "KUBE-ROUTER-FORWARD"],
    ]  # fmt: skip
