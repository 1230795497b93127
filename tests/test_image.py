"""The broker image built by `make image` (image/build.py, docs/image.md), run for real.

The image's OCI archive is unpacked with umoci (root filesystem + the runtime config
derived from the image: user, entrypoint, environment, working directory), and the image
runs as a container would: PID 1 of a new PID namespace, chrooted into a read-only root,
as the image's user, with only the data volume and /tmp writable. Loopback networking.

Slow (a cold build takes minutes; a warm one seconds) and root-only; skipped when the
build tools are missing (`make image` installs them).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest

from twinmq.testing.launcher import free_port

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("buildah", "mmdebstrap", "umoci", "unshare", "chroot")
missing = [t for t in TOOLS if shutil.which(t) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.geteuid() != 0, reason="building and running the image needs root"),
    pytest.mark.skipif(bool(missing), reason=f"`make image` installs the missing {missing}"),
]


@dataclass(frozen=True)
class Image:
    """An unpacked image: its root filesystem and its runtime config (runtime-spec)."""

    rootfs: Path
    config: dict[str, Any]
    description: dict[str, Any]

    @property
    def process(self) -> dict[str, Any]:
        """What the image runs: user, args (entrypoint + cmd), env, cwd."""
        return dict(self.config["process"])


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """`make image`'s archive (built when missing or stale), unpacked."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "image" / "build.py"), "--target", "broker"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    description = json.loads(out.stdout.splitlines()[-1])
    work = tmp_path_factory.mktemp("image")
    layout, bundle = work / "layout", work / "bundle"
    layout.mkdir()
    subprocess.run(["tar", "-xf", description["archive"], "-C", str(layout)], check=True)
    (manifest,) = json.loads((layout / "index.json").read_text())["manifests"]
    tag = manifest["annotations"]["org.opencontainers.image.ref.name"]
    subprocess.run(
        ["umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle)],
        check=True, capture_output=True,
    )  # fmt: skip
    config = json.loads((bundle / "config.json").read_text())
    return Image(bundle / "rootfs", config, description)


def test_image_runs_as_a_non_root_user_under_tini(image: Image) -> None:
    process = image.process
    assert process["user"]["uid"] == 10001
    assert process["user"]["gid"] == 10001
    assert process["args"][:2] == ["/usr/bin/tini", "--"]
    assert (image.rootfs / "usr/bin/tini").is_file()
    assert (image.rootfs / "var/lib/twinmq").stat().st_uid == 10001


def test_image_holds_no_secrets_build_tools_or_test_only_code(image: Image) -> None:
    files = [p.relative_to(image.rootfs) for p in image.rootfs.rglob("*")]
    names = {p.name for p in files}
    parts = {part for p in files for part in p.parts}
    # The checkout's private and local state: virtualenv, cluster PKI, caches, history.
    assert not parts & {".venv", ".cluster", ".cache", ".git"}
    assert not (image.rootfs / "src").exists()  # the build stage's copy of the checkout
    assert not [p for p in files if p.suffix in {".key", ".pem"} and "cluster" in str(p)]
    assert "kubeconfig" not in names
    # No installer, compiler, JVM or Spark; no test-only dependency or test code.
    site = next(image.rootfs.glob("opt/twinmq/lib/python3*/site-packages"))
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert not installed & {"pip", "setuptools", "wheel", "pyspark", "py4j", "moto", "pytest"}
    programs = {
        p.name
        for folder in ("usr/bin", "usr/sbin", "usr/local/bin", "opt/twinmq/bin")
        for p in (image.rootfs / folder).iterdir()
    }
    assert not programs & {"pip", "pip3", "gcc", "cc", "c++", "make", "java"}
    # The dev distribution's packages (dev/pyproject.toml) are not the product's.
    assert not [n for n in ("localcluster", "testing", "demo") if (site / "twinmq" / n).exists()]
    # What it must hold: the broker, the operator and the audit shipper's dependencies.
    assert {"twinmq", "kopf", "kubernetes", "pyarrow", "s3fs", "uvloop"} <= installed
    for command in ("twinmq-broker", "twinmq-operator", "twinmq-audit-ship"):
        assert (image.rootfs / "opt/twinmq/bin" / command).is_file()


@dataclass
class Container:
    """An image's process run as a container on the host's network (see the module doc)."""

    proc: subprocess.Popen[bytes]
    stderr: Path

    def pid1(self) -> int:
        """The host pid of the container's PID 1 (the only child of `unshare --fork`)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return int(children.split()[0])

    def wait_ready(self, timeout: float = 120) -> str:
        """The broker's ready line (its stdout); the log if it exits first."""
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and b"\n" not in buf:
            if self.proc.poll() is not None:
                pytest.fail(f"the image's broker exited:\n{self.stderr.read_text()}")
            buf += self.proc.stdout.read() or b""
            time.sleep(0.1)
        assert b"twinmq-broker ready" in buf, self.stderr.read_text()
        return buf.decode()


@pytest.fixture
def run_image(image: Image, tmp_path: Path) -> Iterator[Any]:
    """Start the image's broker with a data volume; the container is killed at teardown."""
    started: list[Container] = []

    def start(args: list[str], data: Path) -> Container:
        process, rootfs = image.process, image.rootfs
        user = f"{process['user']['uid']}:{process['user']['gid']}"
        env = " ".join(shlex.quote(e) for e in process["env"])
        # A private mount namespace: the root bound read-only over itself, then the
        # writable volumes, /proc of the new PID namespace and the host's /dev.
        script = f"""
            set -e
            r={shlex.quote(str(rootfs))}
            mount --bind "$r" "$r" && mount -o remount,bind,ro "$r"
            mount -t proc proc "$r/proc"
            mount --rbind /dev "$r/dev"
            mount -t tmpfs -o mode=1777 tmpfs "$r/tmp"
            mount --bind {shlex.quote(str(data))} "$r/var/lib/twinmq"
            exec chroot --userspec={user} "$r" /usr/bin/env -i {env} \
                /usr/bin/env -C {shlex.quote(process["cwd"])} {shlex.join(args)}
        """
        stderr = tmp_path / f"container-{len(started)}.log"
        with stderr.open("wb") as log:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
                 "sh", "-c", script],
                stdout=subprocess.PIPE, stderr=log,
            )  # fmt: skip
        started.append(Container(proc, stderr))
        return started[-1]

    yield start
    for container in started:
        if container.proc.poll() is None:
            container.proc.kill()
            container.proc.wait()


def publish_and_consume(port: int) -> bytes:
    """One confirmed message through a durable queue and back (pika, guest on loopback)."""
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=20, retry_delay=0.5)
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare("image-test", durable=True)
        channel.basic_publish(
            "", "image-test", b"from the image", pika.BasicProperties(delivery_mode=2)
        )
        method, _, body = channel.basic_get("image-test", auto_ack=True)
        assert method is not None
        return bytes(body)
    finally:
        connection.close()


@pytest.mark.parametrize(
    "entrypoint",
    [
        pytest.param(True, id="tini-as-pid1"),
        # Kubernetes replaces the entrypoint when a pod gives `command`, as the operator's
        # broker pods do: then the broker itself is PID 1.
        pytest.param(False, id="broker-as-pid1"),
    ],
)
def test_broker_serves_on_a_read_only_root_and_stops_cleanly_on_sigterm(
    image: Image, run_image: Any, tmp_path: Path, entrypoint: bool
) -> None:
    data = tmp_path / "volume"
    data.mkdir()
    os.chown(data, 10001, 10001)
    port = free_port()
    broker = [
        "twinmq-broker", "--data-dir=/var/lib/twinmq/data", "--host=127.0.0.1",
        f"--port={port}", f"--admin-port={free_port()}", f"--replication-port={free_port()}",
    ]  # fmt: skip
    prefix = image.process["args"][:2] if entrypoint else []
    container = run_image([*prefix, *broker], data)
    container.wait_ready()

    assert publish_and_consume(port) == b"from the image"
    # It wrote its journal as the image's user, into the volume only.
    journal = list((data / "data").rglob("*"))
    assert journal and {p.stat().st_uid for p in journal} == {10001}

    os.kill(container.pid1(), signal.SIGTERM)
    assert container.proc.wait(timeout=60) == 0
    assert "termination signal: shutting down" in container.stderr.read_text()


# The operator's entry point and the audit shipper's Parquet path (pyarrow's C++ libraries
# and their system dependencies), imported and run in the image as the image's user.
SHIPPER_AND_OPERATOR = """
import s3fs
import twinmq.operator.main
from twinmq.audit.store import SegmentName, segment_to_parquet

parquet = segment_to_parquet(SegmentName("broker", 1, 1), b"")
assert parquet[:4] == b"PAR1", parquet[:4]
print("shipper and operator ok")
"""


def test_operator_and_audit_shipper_load_in_the_image(
    image: Image, run_image: Any, tmp_path: Path
) -> None:
    data = tmp_path / "volume"
    data.mkdir()
    python = [*image.process["args"][:2], "python", "-c", SHIPPER_AND_OPERATOR]
    container = run_image(python, data)
    assert container.proc.wait(timeout=300) == 0, container.stderr.read_text()
    assert container.proc.stdout is not None
    assert b"shipper and operator ok" in container.proc.stdout.read()
