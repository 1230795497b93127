"""Fault tools for tests on the local cluster: kill, pause, cut the network, stop components.

They act on the host (processes, cgroup freezers, veths, pid files), never through the
API, so they still work while the API server is down; what a pod is made of on the host
depends on the node kind (`podnodes.py`: the real kubelet + containerd, or the node
agent). Usable from Python (e2e tests) and from the shell:
``python -m twinmq.localcluster.faults kill NAMESPACE/POD``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

from twinmq.localcluster import cluster, daemons, podnodes
from twinmq.localcluster.layout import APISERVER_PORT, GATEWAY_IP, Layout
from twinmq.localcluster.pki import admin_token


def signal_pod(
    layout: Layout, namespace: str, name: str, sig: signal.Signals, container: str | None = None
) -> list[int]:
    """Send `sig` to the processes of a pod's containers; return the pids signalled.

    On the real node (TWINMQ_NODE=kubelet) these are every process of each container's
    task, found through containerd; on the node agent, each container's process group."""
    return podnodes.for_layout(layout).signal(namespace, name, sig, container)


def kill_pod(layout: Layout, namespace: str, name: str, container: str | None = None) -> list[int]:
    """`kill -9` a pod's container processes (the node then applies restartPolicy)."""
    return signal_pod(layout, namespace, name, signal.SIGKILL, container)


def pause_pod(layout: Layout, namespace: str, name: str) -> list[int]:
    """Pause a pod's containers: their cgroup freezer on the real node, SIGSTOP on the
    node agent. Return the pids held."""
    return podnodes.for_layout(layout).freeze(namespace, name, True)


def resume_pod(layout: Layout, namespace: str, name: str) -> list[int]:
    """Resume a pod paused by `pause_pod`."""
    return podnodes.for_layout(layout).freeze(namespace, name, False)


def container_pid(layout: Layout, namespace: str, name: str, container: str) -> int | None:
    """Return the main pid of a pod's running container (None when it is not running)."""
    return podnodes.for_layout(layout).container_pid(namespace, name, container)


def node_component(layout: Layout) -> str:
    """The daemon whose stop is a node restart: `kubelet` or `node-agent`."""
    return podnodes.for_layout(layout).component


def _pod_eth0(layout: Layout, namespace: str, name: str) -> tuple[str, str]:
    return podnodes.eth0(podnodes.for_layout(layout).netns(namespace, name))


def _set_link(layout: Layout, namespace: str, name: str, state: str) -> str:
    veth, _ip = _pod_eth0(layout, namespace, name)
    subprocess.run(["ip", "link", "set", veth, state], check=True, capture_output=True)
    return veth


def cut_network(layout: Layout, namespace: str, name: str) -> str:
    """Cut a pod off the network (its veth's host side down); loopback keeps working."""
    return _set_link(layout, namespace, name, "down")


def heal_network(layout: Layout, namespace: str, name: str) -> str:
    """Reconnect a pod cut by `cut_network`."""
    return _set_link(layout, namespace, name, "up")


_CUT = ["iptables", "-w", "-t", "mangle"]


def _api_server_rule(layout: Layout, namespace: str, name: str) -> list[str]:
    _veth, ip = _pod_eth0(layout, namespace, name)
    # After kube-proxy's DNAT of the `kubernetes` Service, the pod's requests reach the
    # host's INPUT addressed to the API server itself. DROP, not REJECT: a cut hangs. In
    # the mangle table's INPUT (`_CUT`), which runs before the filter table's: the
    # NetworkPolicy engine keeps its own jump first in the filter INPUT and ACCEPTs
    # there, so a rule inserted above it was bypassed from its next sync on (a cut that
    # silently healed itself: the e2e saw a cut-off primary renew its Lease).
    return ["INPUT", "-s", ip, "-d", GATEWAY_IP, "-p", "tcp",
            "--dport", str(APISERVER_PORT), "-j", "DROP"]  # fmt: skip


def cut_api_server(layout: Layout, namespace: str, name: str) -> str:
    """Drop a pod's traffic to the API server (its requests hang, established connections
    too); clients, the operator and the other broker still reach it. Returns the pod IP."""
    rule = _api_server_rule(layout, namespace, name)
    subprocess.run([*_CUT, "-I", *rule], check=True, capture_output=True)
    return rule[2]


def heal_api_server(layout: Layout, namespace: str, name: str) -> str:
    """Undo `cut_api_server`."""
    rule = _api_server_rule(layout, namespace, name)
    while subprocess.run([*_CUT, "-D", *rule], capture_output=True).returncode == 0:
        pass
    return rule[2]


def stop_component(layout: Layout, component: str) -> None:
    """Stop one daemon of the local cluster (e.g. `node-agent`, `kube-apiserver`)."""
    if not daemons.stop(layout, component):
        raise RuntimeError(f"{component} was not running")


def start_component(layout: Layout, component: str, timeout: float = 60) -> None:
    """Start one daemon again and wait until it is healthy."""
    daemons.start(layout, component, cluster._argv(layout, component))
    if component == "kube-apiserver":
        token, ca = admin_token(layout), layout.pki / "ca.crt"
        cluster.wait_for(
            "kube-apiserver",
            lambda: cluster._http_ok(f"{cluster.api_url()}/readyz", token, ca),
            timeout,
            layout,
            component,
        )


@contextlib.contextmanager
def api_server_down(layout: Layout) -> Iterator[None]:
    """Keep the API server stopped for the duration of the `with` block."""
    stop_component(layout, "kube-apiserver")
    try:
        yield
    finally:
        start_component(layout, "kube-apiserver")


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: kill|pause|resume|cut|heal|cut-api|heal-api NS/POD, stop|start COMPONENT,
    api-outage SECONDS."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    for verb in ("kill", "pause", "resume", "cut", "heal", "cut-api", "heal-api"):
        p = sub.add_parser(verb)
        p.add_argument("pod", help="NAMESPACE/NAME")
        p.add_argument("--container")
    for verb in ("stop", "start"):
        p = sub.add_parser(verb)
        p.add_argument("component", choices=cluster.ALL_COMPONENTS)
    p = sub.add_parser("api-outage")
    p.add_argument("seconds", type=float)
    args = parser.parse_args(argv)
    layout = Layout.default()
    if args.verb in ("stop", "start"):
        (stop_component if args.verb == "stop" else start_component)(layout, args.component)
        print(f"{args.component}: {args.verb}ped" if args.verb == "stop" else "started")
        return 0
    if args.verb == "api-outage":
        with api_server_down(layout):
            time.sleep(args.seconds)
        print("kube-apiserver back")
        return 0
    namespace, _, name = args.pod.rpartition("/")
    namespace = namespace or "default"
    if args.verb in ("cut-api", "heal-api"):
        ip = (cut_api_server if args.verb == "cut-api" else heal_api_server)(
            layout, namespace, name
        )
        print(f"{namespace}/{name}: {ip} -> API server {args.verb.split('-')[0]}")
        return 0
    if args.verb in ("cut", "heal"):
        veth = (cut_network if args.verb == "cut" else heal_network)(layout, namespace, name)
        print(f"{namespace}/{name}: {veth} {'down' if args.verb == 'cut' else 'up'}")
        return 0
    if args.verb == "kill":
        pids = kill_pod(layout, namespace, name, args.container)
    elif args.verb == "pause":
        pids = pause_pod(layout, namespace, name)
    else:
        pids = resume_pod(layout, namespace, name)
    print(f"{namespace}/{name}: {args.verb} {pids}")
    return 0 if pids else 1


if __name__ == "__main__":
    sys.exit(main())
