"""The local cluster's volume provisioner: a hostPath PersistentVolume (a folder under
`.cluster/volumes/`) for each claim of the `twinmq-local` StorageClass, deleted with its
claim. The node agent runs it in a thread; the real node (`TWINMQ_NODE=kubelet`) runs it
as a daemon: ``python -m twinmq.localcluster.provisioner --kubeconfig K --state-dir D``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import sys
import threading
from pathlib import Path

from twinmq.localcluster.kubeapi import KubeApi
from twinmq.localcluster.layout import STORAGE_CLASS, VOLUME_PROVISIONER, Layout

log = logging.getLogger("twinmq.provisioner")


def provision_once(kube: KubeApi, layout: Layout) -> None:
    """Create a PersistentVolume for each unbound claim of our class; delete released ones."""
    pvs = {pv["metadata"]["name"]: pv for pv in kube.list("/api/v1/persistentvolumes")}
    for pvc in kube.list("/api/v1/persistentvolumeclaims"):
        meta, spec = pvc["metadata"], pvc["spec"]
        if spec.get("storageClassName") != STORAGE_CLASS or spec.get("volumeName"):
            continue
        name = f"pvc-{meta['uid']}"
        if name in pvs or meta.get("deletionTimestamp"):
            continue
        path = layout.volumes / name
        path.mkdir(parents=True, exist_ok=True)
        # Containers run as a non-root user, and nothing applies fsGroup to a hostPath.
        path.chmod(0o777)
        storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
        kube.create(
            "/api/v1/persistentvolumes",
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {
                    "name": name,
                    "annotations": {"pv.kubernetes.io/provisioned-by": VOLUME_PROVISIONER},
                },
                "spec": {
                    "capacity": {"storage": storage},
                    "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Delete",
                    "storageClassName": STORAGE_CLASS,
                    "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
                    "claimRef": {
                        "namespace": meta["namespace"],
                        "name": meta["name"],
                        "uid": meta["uid"],
                    },
                },
            },
        )
        log.info("provisioned %s for %s/%s", name, meta["namespace"], meta["name"])
    for name, pv in pvs.items():
        annotations = pv["metadata"].get("annotations") or {}
        if annotations.get("pv.kubernetes.io/provisioned-by") != VOLUME_PROVISIONER:
            continue
        released = (pv.get("status") or {}).get("phase") == "Released"
        if released and pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete":
            shutil.rmtree(layout.volumes / name, ignore_errors=True)
            kube.delete(f"/api/v1/persistentvolumes/{name}")
            log.info("deleted released volume %s", name)


def provision_loop(kube: KubeApi, layout: Layout, stop: threading.Event) -> None:
    """Run `provision_once` every second until `stop` is set."""
    while not stop.is_set():
        try:
            provision_once(kube, layout)
        except Exception as error:
            log.warning("provisioner failed: %s", error)
        stop.wait(1)


def main(argv: list[str] | None = None) -> int:
    """Command line: run the provisioner until SIGTERM."""
    parser = argparse.ArgumentParser(description="TwinMQ local volume provisioner")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    provision_loop(KubeApi(args.kubeconfig), Layout(args.state_dir.resolve()), stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
