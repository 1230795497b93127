"""Unit tests of the real node's pure parts (TWINMQ_NODE=kubelet): containerd's config, the
pause image's OCI archive, the kubelet's config, cgroup and mount parsing, node modes."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from twinmq.localcluster import cluster, containerd, freezer, kubelet
from twinmq.localcluster.binaries import needed
from twinmq.localcluster.layout import CGROUP_PARENT, GATEWAY_IP, Layout, node_mode
from twinmq.localcluster.nodeagent.runtime import cni_config
from twinmq.localcluster.versions import BINARIES

LAYOUT = Layout(Path("/srv/c"))


def test_containerd_keeps_everything_under_the_cluster_folder_with_the_two_traps_set() -> None:
    text = containerd.config_text(LAYOUT)
    parsed = tomllib.loads(text)
    assert parsed["root"] == "/srv/c/containerd/root"
    assert parsed["state"] == "/srv/c/containerd/state"
    assert parsed["grpc"]["address"] == "/srv/c/containerd/containerd.sock"
    cri = parsed["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["netns_mounts_under_state_dir"] is True
    assert cri["sandbox_image"] == containerd.PAUSE_IMAGE
    assert cri["cni"]["conf_dir"] == "/srv/c/cni/net.d"
    assert "io.containerd.internal.v1.opt" in parsed["disabled_plugins"]


def test_the_cni_network_list_is_the_node_agents_bridge_network() -> None:
    plugin = cni_config(LAYOUT)
    conflist = containerd.cni_conflist(plugin)
    assert conflist["name"] == plugin["name"] and conflist["cniVersion"] == plugin["cniVersion"]
    plugins = conflist["plugins"]
    assert isinstance(plugins, list) and len(plugins) == 1
    inner = plugins[0]
    assert inner["type"] == "bridge" and inner["ipam"] == plugin["ipam"]
    assert "name" not in inner


def test_the_pause_archive_is_a_reproducible_oci_image_whose_digests_match(tmp_path: Path) -> None:
    first = containerd.oci_archive("pause", b"\x7fELF...", containerd.PAUSE_IMAGE, "amd64")
    assert first == containerd.oci_archive("pause", b"\x7fELF...", containerd.PAUSE_IMAGE, "amd64")
    path = tmp_path / "pause.tar"
    path.write_bytes(first)
    with tarfile.open(path) as tar:
        names = set(tar.getnames())
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        blobs = {n: tar.extractfile(n).read() for n in names if n.startswith("blobs/")}  # type: ignore[union-attr]
    assert "oci-layout" in names
    for name, data in blobs.items():
        assert name.rsplit("/", 1)[1] == hashlib.sha256(data).hexdigest()
    [manifest_desc] = index["manifests"]
    assert manifest_desc["annotations"]["io.containerd.image.name"] == containerd.PAUSE_IMAGE
    assert containerd.archive_digest(path) == manifest_desc["digest"]
    manifest = json.loads(blobs["blobs/sha256/" + manifest_desc["digest"].split(":")[1]])
    config = json.loads(blobs["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["config"]["Entrypoint"] == ["/pause"]
    layer = blobs["blobs/sha256/" + manifest["layers"][0]["digest"].split(":")[1]]
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as files:
        assert files.getnames() == ["pause"]
        assert files.getmember("pause").mode == 0o755


def test_kubelet_config_uses_our_socket_cgroups_and_dns_and_no_anonymous_access() -> None:
    config = kubelet.config(LAYOUT)
    assert config["containerRuntimeEndpoint"] == "unix:///srv/c/containerd/containerd.sock"
    assert config["cgroupRoot"] == f"/{CGROUP_PARENT}" and config["cgroupDriver"] == "cgroupfs"
    assert config["failCgroupV1"] is False
    assert config["address"] == GATEWAY_IP and config["readOnlyPort"] == 0
    assert config["authentication"]["anonymous"]["enabled"] is False
    assert config["resolvConf"] == "/srv/c/kubelet/resolv.conf"


def test_the_namespace_script_masks_every_sysctl_the_kubelet_writes() -> None:
    script = kubelet.namespace_script(LAYOUT)
    for name in kubelet.MASKED_SYSCTLS:
        copy = f"/srv/c/kubelet/sysctl/{name.replace('/', '.')}"
        assert f"mount --bind {copy} /proc/sys/{name}\n" in script
    # Masks first, then the ready marker, then the namespace is held.
    assert script.index("mount --bind") < script.index("ns.ready") < script.index("sleep")
    argv = kubelet.namespace_argv(LAYOUT)
    assert argv[:5] == ["unshare", "--mount", "--propagation", "slave", "--"]


MOUNTINFO = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw
27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid shared:11 - cgroup cgroup rw,cpu,cpuacct
28 25 0:25 / /sys/fs/cgroup/memory rw,nosuid shared:12 - cgroup cgroup rw,memory
40 30 0:40 / /srv/c/kubelet/root/pods/x/volumes/secret rw - tmpfs tmpfs rw
41 30 0:41 / /srv/cc rw - tmpfs tmpfs rw
"""


def test_cgroup_hierarchies_are_read_from_mountinfo_by_version() -> None:
    v1 = [Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/memory")]
    assert kubelet.cgroup_mounts(MOUNTINFO) == v1
    both = kubelet.cgroup_mounts(MOUNTINFO, ("cgroup", "cgroup2"))
    assert both == [Path("/sys/fs/cgroup/unified"), *v1]


def test_mounts_under_a_folder_are_found_and_a_sibling_prefix_is_not() -> None:
    assert kubelet.mounts_under(Path("/srv/c"), MOUNTINFO) == [
        "/srv/c/kubelet/root/pods/x/volumes/secret"
    ]


def test_the_node_mode_defaults_to_the_kubelet_and_rejects_unknown_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TWINMQ_NODE", raising=False)
    assert node_mode() == "kubelet"
    monkeypatch.setenv("TWINMQ_NODE", "")
    assert node_mode() == "kubelet"
    monkeypatch.setenv("TWINMQ_NODE", "agent")
    assert node_mode() == "agent"
    monkeypatch.setenv("TWINMQ_NODE", "docker")
    with pytest.raises(ValueError, match="TWINMQ_NODE"):
        node_mode()


def test_each_mode_runs_its_own_node_daemons_between_control_plane_and_proxy() -> None:
    agent, real = cluster.components("agent"), cluster.components("kubelet")
    assert "node-agent" in agent and "kubelet" not in agent
    assert "node-agent" not in real
    assert real.index("node-ns") < real.index("containerd") < real.index("kubelet")
    assert real.index("kube-scheduler") < real.index("node-ns")
    assert set(cluster.ALL_COMPONENTS) == set(agent) | set(real)


def test_the_kubelet_is_built_by_default_only_for_the_kubelet_mode() -> None:
    assert "kubelet" not in {b.name for b in needed("agent")}
    on_demand = {b.name for b in BINARIES if b.on_demand}
    assert {b.name for b in needed("kubelet")} == {b.name for b in BINARIES} - on_demand
    assert {b.name for b in needed("agent")} >= {"kube-apiserver", "kube-proxy", "kubectl"}


def test_the_spark_operator_is_built_only_when_asked_for() -> None:
    assert "spark-operator" not in {b.name for b in needed("kubelet") + needed("agent")}
    assert any(b.name == "spark-operator" and b.on_demand for b in BINARIES)


HYBRID_MOUNTINFO = """\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw
31 30 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer
33 30 0:29 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw
"""


def test_a_container_with_a_v2_cgroup_of_its_own_is_frozen_through_cgroup_freeze() -> None:
    proc_cgroup = (
        "7:freezer:/twinmq/kubepods/besteffort/pod1/abc\n"
        "3:cpu:/twinmq/kubepods/besteffort/pod1/abc\n"
        "0::/twinmq/kubepods/besteffort/pod1/abc\n"
    )
    found = freezer.freezer_of(proc_cgroup, HYBRID_MOUNTINFO)
    assert found == freezer.Freezer(
        Path("/sys/fs/cgroup/unified/twinmq/kubepods/besteffort/pod1/abc/cgroup.freeze"), "1", "0"
    )


def test_a_container_only_in_a_v1_freezer_hierarchy_is_frozen_through_its_freezer_state() -> None:
    proc_cgroup = "7:freezer:/twinmq/pod1/abc\n3:cpu:/twinmq/pod1/abc\n0::/\n"
    found = freezer.freezer_of(proc_cgroup, HYBRID_MOUNTINFO)
    assert found == freezer.Freezer(
        Path("/sys/fs/cgroup/freezer/twinmq/pod1/abc/freezer.state"), "FROZEN", "THAWED"
    )


def test_a_container_in_cgroup_v2_only_is_frozen_through_cgroup_freeze() -> None:
    mountinfo = "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    found = freezer.freezer_of("0::/twinmq/pod1/abc\n", mountinfo)
    assert found == freezer.Freezer(Path("/sys/fs/cgroup/twinmq/pod1/abc/cgroup.freeze"), "1", "0")


def test_thawing_a_tree_thaws_parents_before_children_and_skips_thawed_ones(
    tmp_path: Path,
) -> None:
    child = tmp_path / "pod" / "c1"
    child.mkdir(parents=True)
    (tmp_path / "pod" / "freezer.state").write_text("FROZEN\n")
    (child / "freezer.state").write_text("FROZEN\n")
    (tmp_path / "freezer.state").write_text("THAWED\n")
    thawed = freezer.thaw_all(tmp_path)
    assert thawed == [tmp_path / "pod" / "freezer.state", child / "freezer.state"]
    assert (child / "freezer.state").read_text() == "THAWED"
