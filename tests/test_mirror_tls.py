"""Mutual TLS on the DR mirror link (issues 14 and 16): two sites on loopback, each with a
CA of its own, as two BrokerClusters have.

Each site presents one certificate its own CA signed (`--mirror-tls-cert`) and trusts the
other site's CA (`--mirror-tls-ca`): the source checks that the mirror's certificate covers
the name it dials, the mirror that the source's certificate names the origin its handshake
claims. The token's proof still runs inside TLS. A site whose TLS does not match the
other's (another CA, another name, one side still plaintext) never links: the source keeps
its replication queue, and delivers it once the two agree.
"""

from __future__ import annotations

import shutil
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
from mirrorsites import ORIGIN, Sites, browse, demote, depth, metric, mirror_status, publish

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.names import setting_env
from twinmq.testing.certs import Leaf, TestCA
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

QUEUE = "tls-mirrored"


def refused(broker: BrokerProcess, reason: str) -> float:
    samples = metric_samples(broker.admin.metrics(timeout=5))
    return samples.get(f'twinmq_mirror_refused_total{{reason="{reason}"}}', 0.0)


def log_of(broker: BrokerProcess) -> str:
    assert broker.log_path is not None
    return broker.log_path.read_text()


def _link_error(broker: BrokerProcess) -> object:
    section = mirror_status(broker)
    return None if section is None else section["link_error"]


def use_tls(broker: BrokerProcess, leaf: Leaf, ca: Path, server_name: str | None = None) -> None:
    broker.env[setting_env("mirror_tls_cert")] = str(leaf.cert)
    broker.env[setting_env("mirror_tls_key")] = str(leaf.key)
    broker.env[setting_env("mirror_tls_ca")] = str(ca)
    if server_name is not None:
        broker.env[setting_env("mirror_tls_server_name")] = server_name


@pytest.fixture(scope="module")
def ca_a(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca-a"), name="site A CA")


@pytest.fixture(scope="module")
def ca_b(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca-b"), name="site B CA")


@pytest.fixture(scope="module")
def site_b_leaf(ca_b: TestCA) -> Leaf:
    """Site B's mirror certificate: its listener's, for 127.0.0.1 (the name dialled)."""
    return ca_b.issue("site-b", peer=True)


def tls_sites(tmp: Path, source_leaf: Leaf | None, source_ca: Path, mirror: Leaf, mirror_ca: Path,
              server_name: str | None = None) -> Sites:  # fmt: skip
    """Site A (source, `source_leaf`; plaintext if None) mirroring to site B (TLS)."""
    sites = Sites(tmp)
    if source_leaf is not None:
        use_tls(sites.source, source_leaf, source_ca, server_name)
    use_tls(sites.mirror, mirror, mirror_ca)
    return sites


def unlinked(sites: Sites) -> dict[str, object]:
    """Publish on the source: the events stay in its replication queue, none reaches the
    mirror. The source's mirror section."""
    publish(sites.source, QUEUE, [b"held-%d" % i for i in range(50)])
    section = mirror_status(sites.source)
    assert section is not None
    assert not section["connected"] and section["queue_events"] > 0, section
    assert depth(sites.mirror, QUEUE) in (None, 0)
    return section


@pytest.fixture
def matched(tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf) -> Iterator[Sites]:
    source_leaf = ca_a.issue(ORIGIN, peer=True)
    with tls_sites(tmp_path, source_leaf, ca_b.cert, site_b_leaf, ca_a.cert) as sites:
        yield sites


def test_a_source_mirrors_over_mutual_tls_with_a_ca_per_site(matched: Sites) -> None:
    bodies = [b"m-%d" % i for i in range(200)]
    publish(matched.source, QUEUE, bodies)
    matched.caught_up()
    assert browse(matched.mirror, QUEUE) == bodies
    source, mirror = mirror_status(matched.source), mirror_status(matched.mirror)
    assert source is not None and source["tls"] and source["link_error"] is None
    assert mirror is not None and mirror["tls"] and mirror["sources_connected"] == 1
    for broker in (matched.source, matched.mirror):
        for reason in ("certificate", "identity"):
            assert refused(broker, reason) == 0


def test_a_source_with_a_certificate_of_a_ca_the_mirror_does_not_trust_is_refused(
    tmp_path: Path, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    stranger = TestCA(tmp_path / "stranger", name="a stranger's CA")
    leaf = stranger.issue(ORIGIN, peer=True)
    with tls_sites(tmp_path / "sites", leaf, ca_b.cert, site_b_leaf, ca_b.cert) as sites:
        wait_for("the mirror's refusal", lambda: refused(sites.mirror, "certificate") >= 1, 30)
        assert "failed the TLS handshake" in log_of(sites.mirror)
        unlinked(sites)


def test_a_source_certificate_naming_another_origin_cannot_mirror(
    tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    """A certificate of the right CA is not enough: it must name the origin the source
    claims (a site's other certificates, e.g. a broker's own, are no mirror identity)."""
    leaf = ca_a.issue("site-a-broker-0", peer=True)
    with tls_sites(tmp_path, leaf, ca_b.cert, site_b_leaf, ca_a.cert) as sites:
        wait_for("the mirror's refusal", lambda: refused(sites.mirror, "identity") >= 1, 30)
        assert f"not the origin '{ORIGIN}'" in log_of(sites.mirror)
        section = unlinked(sites)
        assert "certificate names" in str(section["link_error"])


def test_a_source_refuses_a_mirror_whose_certificate_does_not_name_what_it_dials(
    tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    leaf = ca_a.issue(ORIGIN, peer=True)
    sites = tls_sites(tmp_path, leaf, ca_b.cert, site_b_leaf, ca_a.cert,
                      server_name="mirror.elsewhere.example")  # fmt: skip
    with sites:
        wait_for("the source's refusal", lambda: refused(sites.source, "certificate") >= 1, 30)
        section = unlinked(sites)
        assert "TLS handshake failed" in str(section["link_error"])
        assert "mirror.elsewhere.example" in str(section["link_error"])


def test_a_plaintext_source_is_refused_keeps_its_backlog_and_delivers_it_once_it_dials_tls(
    tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    """The migration of a running plaintext mirror: the mirror site requires TLS first;
    until the source dials TLS too, nothing is lost and nothing is applied."""
    with tls_sites(tmp_path, None, ca_b.cert, site_b_leaf, ca_a.cert) as sites:
        # The plaintext source waits for a CHALLENGE, the mirror for a TLS hello: the
        # mirror gives up at its handshake deadline and closes; the source says why.
        wait_for("the source's diagnosis",
                 lambda: "require mutual TLS" in str(_link_error(sites.source)), 40)  # fmt: skip
        held = unlinked(sites)
        assert metric(sites.source, "twinmq_mirror_connected") == 0
        sites.source.stop()
        use_tls(sites.source, ca_a.issue(ORIGIN, peer=True), ca_b.cert)
        sites.source.start()
        sites.caught_up()
        assert browse(sites.mirror, QUEUE) == [b"held-%d" % i for i in range(50)]
        assert int(str(held["queue_events"])) > 0


def served_certificate(port: int, ca: Path, client: Leaf) -> bytes:
    """The DER certificate the mirror listener serves a new handshake now."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(client.cert, client.key)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(leaf: Leaf) -> bytes:
    return ssl.PEM_cert_to_DER_cert(leaf.cert.read_text())


def test_a_renewed_certificate_serves_new_handshakes_and_the_link_is_not_dropped(
    tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(site_b_leaf.cert, live / "tls.crt")
    shutil.copy(site_b_leaf.key, live / "tls.key")
    source_leaf = ca_a.issue(ORIGIN, peer=True)
    sites = tls_sites(tmp_path / "sites", source_leaf, ca_b.cert,
                      Leaf(live / "tls.crt", live / "tls.key"), ca_a.cert)  # fmt: skip
    with sites:
        publish(sites.source, QUEUE, [b"before"])
        sites.caught_up()
        assert served_certificate(sites.mirror_port, ca_b.cert, source_leaf) == der_of(site_b_leaf)
        renewed = ca_b.issue("site-b-renewed", peer=True)
        # As cert-manager and the kubelet do: the new files replace the old ones in place.
        for new, name in ((renewed.key, "tls.key"), (renewed.cert, "tls.crt")):
            shutil.copy(new, live / (name + ".new"))
            (live / (name + ".new")).replace(live / name)
        wait_for("the renewed certificate served",
                 lambda: served_certificate(sites.mirror_port, ca_b.cert, source_leaf)
                 == der_of(renewed), 30)  # fmt: skip
        publish(sites.source, QUEUE, [b"after"])
        sites.caught_up()
        assert browse(sites.mirror, QUEUE) == [b"before", b"after"]
        text = log_of(sites.mirror)
        assert "TLS certificate reloaded" in text
        # One session from the source all along: the reload did not drop the link.
        assert text.count(f"source {ORIGIN} linked") == 1


def test_a_switchover_over_mutual_tls_reverses_the_link_with_the_same_identities(
    tmp_path: Path, ca_a: TestCA, ca_b: TestCA, site_b_leaf: Leaf
) -> None:
    """After a switchover site B dials site A with its one certificate (client use now)
    and A's listener verifies it against B's CA: the same files serve both directions."""
    sites = Sites(tmp_path, reversible=True)
    use_tls(sites.source, ca_a.issue(ORIGIN, peer=True), ca_b.cert)
    use_tls(sites.mirror, site_b_leaf, ca_a.cert)
    with sites:
        publish(sites.source, QUEUE, [b"from-a"])
        sites.caught_up()
        demoted = demote(sites.source)
        assert demoted.token is not None
        sites.promote_mirror(demoted.token)
        publish(sites.mirror, QUEUE, [b"from-b"])
        sites.caught_up(source=sites.mirror)
        assert browse(sites.source, QUEUE) == [b"from-a", b"from-b"]
        section = mirror_status(sites.mirror)
        assert section is not None and section["tls"] and section["connected"]
