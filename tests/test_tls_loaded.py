"""What a broker says it loaded of its TLS files (`GET /status` `tls`, the `twinmq_tls_*`
metrics): the certificate and trust bundle in use after each change of the files, and a
change that does not load reported as such while the previous files stay in use. The
operator's CA rotation reads it (operator/carotation.py, tests/test_ca_rotation.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from cryptography import x509
from test_ca_rotation import CLUSTER, Volume

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.api import TlsFilesStatus
from twinmq.broker.names import setting_env
from twinmq.broker.tls import fingerprint, key_id
from twinmq.operator import certs
from twinmq.operator.builders import ClusterRef
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.waiting import wait_for


def fp(pem: str) -> str:
    return fingerprint(x509.load_pem_x509_certificate(pem.encode()))


def kid(pem: str) -> str:
    return key_id(x509.load_pem_x509_certificate(pem.encode()))


@pytest.fixture
def volume(tmp_path: Path) -> Volume:
    return Volume(tmp_path / "tls", "primary")


@pytest.fixture
def site(tmp_path: Path) -> Volume:
    return Volume(tmp_path / "mirror", "primary")


@pytest.fixture
def broker(tmp_path: Path, volume: Volume, site: Volume) -> Iterator[BrokerProcess]:
    """A broker whose AMQPS and replication listeners use `volume`'s files (as a pod's
    own certificate Secret), first signed by a CA of their own; its mirror listener,
    `site`'s (a certificate of the same CA, the other site's CA as its bundle)."""
    first = certs.new_ca(CLUSTER, datetime.now(UTC))
    volume.write(first.cert, first)
    site.write(certs.new_ca(ClusterRef("far", "away", "uid-far"), datetime.now(UTC)).cert, first)
    process = BrokerProcess(tmp_path / "data", name="primary")
    for setting, path in (("cert", site.cert), ("key", site.key), ("ca", site.ca)):
        process.env[setting_env(f"mirror_tls_{setting}")] = str(path)
    for setting, path in (("cert", volume.cert), ("key", volume.key), ("ca", volume.ca)):
        process.env[setting_env(f"replication_tls_{setting}")] = str(path)
    process.env[setting_env("tls_cert")] = str(volume.cert)
    process.env[setting_env("tls_key")] = str(volume.key)
    process.env[setting_env("tls_port")] = str(free_port())
    with process.start():
        yield process


def loaded(broker: BrokerProcess) -> dict[str, TlsFilesStatus]:
    """The listeners' files as the broker reports them, but the mirror's (not changed)."""
    return {f.listener: f for f in reported(broker) if f.listener != "mirror"}


def reported(broker: BrokerProcess) -> list[TlsFilesStatus]:
    return broker.admin.status(timeout=5).tls


def test_status_reports_the_certificate_and_bundle_loaded_after_each_change(
    broker: BrokerProcess, volume: Volume, site: Volume
) -> None:
    assert [f.listener for f in reported(broker)] == ["amqps", "replication", "mirror"]
    mirror = reported(broker)[-1]
    assert mirror.ca_fingerprints == [fp(site.ca.read_text())]  # the other site's CA
    first = loaded(broker)
    assert volume.leaf is not None
    leaf, bundle = volume.leaf.cert, volume.ca.read_text()
    for files in first.values():
        assert files.certificate.fingerprint == fp(leaf)
        assert files.load_error is None and files.reloads == 0
    assert first["replication"].ca_fingerprints == [fp(bundle)]
    assert first["replication"].certificate.authority_key_id == kid(bundle)
    assert first["amqps"].ca_fingerprints == []  # no client certificates asked for
    # A second CA joins the bundle and signs a new certificate (a rotation's Switched).
    second = certs.new_ca(CLUSTER, datetime.now(UTC))
    volume.write(second.cert + bundle, second)
    wait_for("both listeners reloaded", lambda: all(
        f.reloads == 1 for f in loaded(broker).values()), 30)  # fmt: skip
    now = loaded(broker)
    assert now["replication"].ca_fingerprints == [fp(second.cert), fp(bundle)]
    for files in now.values():
        assert files.certificate.fingerprint == fp(volume.leaf.cert) != fp(leaf)
        assert files.certificate.authority_key_id == kid(second.cert) != kid(bundle)
        assert files.loaded_at > first[files.listener].loaded_at
    samples = metric_samples(broker.admin.metrics(timeout=5))
    assert samples['twinmq_tls_loaded_timestamp_seconds{listener="replication"}'] == (
        now["replication"].loaded_at
    )
    assert samples['twinmq_tls_reload_errors_total{listener="replication"}'] == 0


def test_files_that_do_not_load_are_reported_and_the_previous_ones_stay_in_use(
    broker: BrokerProcess, volume: Volume
) -> None:
    before = loaded(broker)
    assert volume.leaf is not None
    good, bundle = volume.leaf, volume.ca.read_text()
    other = certs.issue_server(certs.new_ca(CLUSTER, datetime.now(UTC)), ["primary"],
                               datetime.now(UTC), 3600)  # fmt: skip
    # A certificate whose key is another's: neither listener can use it.
    volume.write_files(good.cert, other.key, bundle)
    wait_for("the failed load reported", lambda: all(
        f.load_error is not None for f in loaded(broker).values()), 30)  # fmt: skip
    failed = loaded(broker)
    for name, files in failed.items():
        assert files.certificate == before[name].certificate  # still the one in use
        assert files.ca_fingerprints == before[name].ca_fingerprints
        assert files.loaded_at == before[name].loaded_at
        assert files.reloads == 0 and files.load_errors == 1
        assert files.load_error is not None and "SSLError" in files.load_error
    samples = metric_samples(broker.admin.metrics(timeout=5))
    for name in failed:
        assert samples[f'twinmq_tls_reload_errors_total{{listener="{name}"}}'] == 1
        assert samples[f'twinmq_tls_load_failing{{listener="{name}"}}'] == 1
    # The next good files load, and clear the error.
    volume.write_files(good.cert, good.key, bundle)
    wait_for("the good files loaded", lambda: all(
        f.reloads == 1 and f.load_error is None for f in loaded(broker).values()), 30)  # fmt: skip
