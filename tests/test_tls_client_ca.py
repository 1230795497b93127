"""Applications' client certificates on a real broker as the operator runs it
(`spec.tls.clientCertificates`: `--tls-ca` from a mounted ConfigMap or Secret,
`--tls-client-certs required`): pika gets in with a certificate of the bundle's CA only,
and a bundle the kubelet replaces is used for new handshakes without a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from test_tls import REFUSED, TlsBroker, client_context, tls_broker, tls_params

from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.waiting import wait_for


class BundleVolume:
    """The CA bundle's volume as the kubelet keeps a ConfigMap or Secret: `ca.crt` a link
    into a `..data` directory that an update swaps whole (never a half-written file)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        self.folder, self.version = folder, 0
        self.ca = folder / "ca.crt"

    def write(self, bundle: str) -> None:
        self.version += 1
        data = self.folder / f"..{self.version}"
        data.mkdir()
        (data / "ca.crt").write_text(bundle)
        link = self.folder / "..data.tmp"
        link.symlink_to(data.name)
        link.replace(self.folder / "..data")
        if not self.ca.is_symlink():
            self.ca.symlink_to("..data/ca.crt")


@pytest.fixture
def bundle(tmp_path: Path, apps: TestCA) -> BundleVolume:
    volume = BundleVolume(tmp_path / "client-ca")
    volume.write(apps.cert.read_text())
    return volume


@pytest.fixture
def broker(tmp_path: Path, ca: TestCA, bundle: BundleVolume) -> Iterator[TlsBroker]:
    started = tls_broker(tmp_path, ca.issue("server"), f"--tls-ca={bundle.ca}",
                         "--tls-client-certs=required")  # fmt: skip
    with started.process.start():
        yield started


def connects(broker: TlsBroker, ca: TestCA, leaf: Leaf | None) -> bool:
    """Whether a pika client presenting `leaf` (or nothing) opens a channel over AMQPS."""
    try:
        conn = pika.BlockingConnection(tls_params(broker, client_context(ca, leaf)))
    except REFUSED:
        return False
    conn.channel()
    conn.close()
    return True


def test_required_client_certificates_admit_only_a_certificate_of_the_bundles_ca(
    tmp_path: Path, broker: TlsBroker, ca: TestCA, apps: TestCA
) -> None:
    assert connects(broker, ca, apps.issue("billing", client=True))
    assert not connects(broker, ca, None)
    stranger = TestCA(tmp_path / "stranger-pki", name="someone else")
    assert not connects(broker, ca, stranger.issue("billing", client=True))
    # The server's own CA is not the applications': its certificates are strangers too.
    assert not connects(broker, ca, ca.issue("billing", client=True))


def test_a_replaced_bundle_admits_the_new_cas_certificates_without_a_restart(
    tmp_path: Path, broker: TlsBroker, ca: TestCA, apps: TestCA, bundle: BundleVolume
) -> None:
    before = apps.issue("billing", client=True)
    held = pika.BlockingConnection(tls_params(broker, client_context(ca, before)))
    channel = held.channel()
    channel.queue_declare("kept")
    successor = TestCA(tmp_path / "apps-pki-2", name="applications CA 2")
    newcomer = successor.issue("billing", client=True)
    assert not connects(broker, ca, newcomer)
    process = broker.process.proc

    bundle.write(successor.cert.read_text())  # the old CA taken out of the bundle

    wait_for("the new CA's certificate admitted", lambda: connects(broker, ca, newcomer))
    assert not connects(broker, ca, apps.issue("late", client=True))  # the old CA's: refused
    assert process is not None and process.poll() is None  # the same process, running
    assert broker.process.proc is process
    channel.queue_declare("kept", passive=True)  # the open connection was not dropped
    held.close()
