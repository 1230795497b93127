"""The host side of the local cluster's network, and the guard that keeps it on the host.

- a bridge (`twinmq0`, 10.244.0.1/24) that every pod's veth joins (CNI `bridge`);
- a **blackhole route** for the whole pod range 10.244.0.0/16: only the node's
  /24 on the bridge is more specific, so no pod address can be routed anywhere else;
- the service range 10.96.0.0/16 is routed onto the bridge, never via a gateway.
  (A blackhole route there would refuse host-originated connects *before*
  kube-proxy's OUTPUT DNAT runs: measured EINVAL on this machine.) Any packet
  still addressed to a service IP after kube-proxy's DNAT is rejected;
- an iptables chain `TWINMQ-GUARD` in FORWARD and OUTPUT that drops anything
  from a pod or service address that would leave through another interface;
- the same drops in the **mangle** table's FORWARD (`mangle_guard_rules`). The NetworkPolicy
  engine (kube-router) keeps its own jump first in the filter table's FORWARD and ACCEPTs
  there whatever complies with the policies, so a pod's packet would never reach the filter
  guard; the mangle table runs before the filter table and kube-router leaves it alone.

Everything is removed by `teardown`, which leaves `net.ipv4.ip_forward` as it found it.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from twinmq.localcluster.layout import (
    BRIDGE,
    GATEWAY_IP,
    GUARD_CHAIN,
    NODE_POD_CIDR,
    POD_CIDR,
    SERVICE_CIDR,
    Layout,
)

_IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def _ok(cmd: Sequence[str]) -> bool:
    return _run(cmd, check=False).returncode == 0


def guard_rules() -> list[tuple[str, list[str]]]:
    """Return (chain, rule) pairs of the guard, in order; pure, for tests and `teardown`."""
    return [
        # The host talking to its own addresses (the API server on the bridge IP) stays local.
        (GUARD_CHAIN, ["-o", "lo", "-j", "RETURN"]),
        # Post-DNAT, a service address means no endpoint: refuse it locally.
        (GUARD_CHAIN, ["-d", SERVICE_CIDR, "-j", "REJECT"]),
        # Pod and service traffic stays on the bridge (or the host's loopback).
        (GUARD_CHAIN, ["-s", POD_CIDR, "!", "-o", BRIDGE, "-j", "DROP"]),
        (GUARD_CHAIN, ["-d", POD_CIDR, "!", "-o", BRIDGE, "-j", "DROP"]),
        (GUARD_CHAIN, ["-i", BRIDGE, "!", "-o", BRIDGE, "-j", "DROP"]),
    ]


def mangle_guard_rules() -> list[tuple[str, list[str]]]:
    """The guard's drops for forwarded packets, in the mangle table (see the module).

    No REJECT (the mangle table cannot): a pod's packet to a service address without
    endpoints goes back onto the bridge, where nothing answers it."""
    return [(chain, rule) for chain, rule in guard_rules() if rule[-1] == "DROP"]


def setup(layout: Layout) -> None:
    """Create the bridge, the routes and the guard (idempotent)."""
    state = layout.root / "hostnet.json"
    if not state.exists():
        state.parent.mkdir(parents=True, exist_ok=True)
        state.write_text(json.dumps({"ip_forward": _IP_FORWARD.read_text().strip()}))
    if not _ok(["ip", "link", "show", BRIDGE]):
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    prefix = NODE_POD_CIDR.split("/")[1]
    if GATEWAY_IP not in _run(["ip", "-4", "addr", "show", "dev", BRIDGE]).stdout:
        _run(["ip", "addr", "add", f"{GATEWAY_IP}/{prefix}", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])
    _run(["ip", "route", "replace", "blackhole", POD_CIDR])
    _run(["ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE, "src", GATEWAY_IP])
    # Guard chain first, then forwarding on.
    if not _ok(["iptables", "-w", "-L", GUARD_CHAIN, "-n"]):
        _run(["iptables", "-w", "-N", GUARD_CHAIN])
    _run(["iptables", "-w", "-F", GUARD_CHAIN])
    for chain, rule in guard_rules():
        _run(["iptables", "-w", "-A", chain, *rule])
    for parent in ("FORWARD", "OUTPUT"):
        if not _ok(["iptables", "-w", "-C", parent, "-j", GUARD_CHAIN]):
            _run(["iptables", "-w", "-I", parent, "1", "-j", GUARD_CHAIN])
    mangle = ["iptables", "-w", "-t", "mangle"]
    if not _ok([*mangle, "-L", GUARD_CHAIN, "-n"]):
        _run([*mangle, "-N", GUARD_CHAIN])
    _run([*mangle, "-F", GUARD_CHAIN])
    for chain, rule in mangle_guard_rules():
        _run([*mangle, "-A", chain, *rule])
    if not _ok([*mangle, "-C", "FORWARD", "-j", GUARD_CHAIN]):
        _run([*mangle, "-I", "FORWARD", "1", "-j", GUARD_CHAIN])
    # Let pods and the host reach each other's service traffic through the bridge.
    _IP_FORWARD.write_text("1\n")
    nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
    if nf.exists():
        nf.write_text("1\n")


def kube_jumps(listing: list[str]) -> list[list[str]]:
    """The rules of an `iptables -S` listing that jump from a chain of someone else's to a
    `KUBE-*` chain, as the arguments of `-A` (and so of `-D`); pure, for tests."""
    jumps = []
    for line in listing:
        # shlex: a rule's quoted comment (kube-router's "kube-router netpol - ...") must
        # come back as one argument, or `-D` matches nothing and the chain stays referenced.
        words = shlex.split(line)
        if (
            words[:1] == ["-A"]
            and not words[1].startswith("KUBE-")
            and any(w.startswith("KUBE-") for w in words[2:])
        ):
            jumps.append(words[1:])
    return jumps


def remove_kube_chains() -> None:
    """Remove every `KUBE-*` chain (and the jumps to them) that kube-proxy and kube-router
    left behind.

    `kube-proxy --cleanup` leaves KUBE-FIREWALL and a few others in place; no
    other Kubernetes runs on a machine that runs this local cluster.
    """
    for tool in ("iptables", "ip6tables"):
        if shutil.which(tool) is None:
            continue
        for table in ("filter", "nat", "mangle"):
            listing = _run([tool, "-w", "-t", table, "-S"], check=False).stdout.splitlines()
            for rule in kube_jumps(listing):
                _run([tool, "-w", "-t", table, "-D", *rule], check=False)
            chains = [line.split()[1] for line in listing if line.startswith("-N KUBE-")]
            for chain in chains:
                _run([tool, "-w", "-t", table, "-F", chain], check=False)
            for chain in chains:
                _run([tool, "-w", "-t", table, "-X", chain], check=False)


POLICY_ENGINE_SET_PREFIXES = ("KUBE-", "kube-router")
"""Prefixes of the ipsets kube-router (the NetworkPolicy engine) creates."""


def remove_policy_engine_sets() -> None:
    """Destroy the ipsets kube-router left (after `remove_kube_chains`: a set still
    referenced by a rule cannot be destroyed). Nothing else here makes ipsets."""
    if shutil.which("ipset") is None:
        return
    names = _run(["ipset", "list", "-n"], check=False).stdout.split()
    for name in names:
        if name.startswith(POLICY_ENGINE_SET_PREFIXES):
            _run(["ipset", "destroy", name], check=False)


def teardown(layout: Layout) -> None:
    """Remove the guard, the routes and the bridge; restore ip_forward."""
    state = layout.root / "hostnet.json"
    for parent in ("FORWARD", "OUTPUT"):
        while _ok(["iptables", "-w", "-D", parent, "-j", GUARD_CHAIN]):
            pass
    if _ok(["iptables", "-w", "-L", GUARD_CHAIN, "-n"]):
        _run(["iptables", "-w", "-F", GUARD_CHAIN])
        _run(["iptables", "-w", "-X", GUARD_CHAIN])
    mangle = ["iptables", "-w", "-t", "mangle"]
    while _ok([*mangle, "-D", "FORWARD", "-j", GUARD_CHAIN]):
        pass
    if _ok([*mangle, "-L", GUARD_CHAIN, "-n"]):
        _run([*mangle, "-F", GUARD_CHAIN])
        _run([*mangle, "-X", GUARD_CHAIN])
    _run(["ip", "route", "del", SERVICE_CIDR, "dev", BRIDGE], check=False)
    _run(["ip", "link", "del", BRIDGE], check=False)
    _run(["ip", "route", "del", "blackhole", POD_CIDR], check=False)
    if state.exists():
        saved = json.loads(state.read_text())
        _IP_FORWARD.write_text(saved.get("ip_forward", "0") + "\n")
        state.unlink()
