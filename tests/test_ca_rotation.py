"""Rotating the operator-managed CA (operator/carotation.py, issue 16): the three phases on
the real API server (a restarted operator resumes them), and a real pair over mutual TLS
and a pika client over AMQPS that keep trusting each other through every phase, with the
kubelet's lag between the two pods' volumes."""

from __future__ import annotations

import socket
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pika
import pytest
from apiserver import KubeApiServer, install_crd
from cryptography import x509

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.api import TlsFilesStatus, TlsListenerName
from twinmq.broker.names import setting_env
from twinmq.broker.tls import describe, fingerprint
from twinmq.operator import carotation, certs
from twinmq.operator.builders import ClusterRef
from twinmq.operator.kube import Kube, Refused
from twinmq.operator.models import GROUP, KIND, VERSION, BrokerClusterSpec, CaRotation
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
GRACE = 3600
CLUSTER = ClusterRef(namespace="default", name="rotating", uid="uid-rotating")


def requested(request_id: str | None) -> BrokerClusterSpec:
    requests = {} if request_id is None else {"rotateCa": {"id": request_id}}
    return BrokerClusterSpec.model_validate({"requests": requests})


def pems(bundle: str) -> list[str]:
    """The certificates of a PEM bundle, each as PEM."""
    return [c.public_bytes(certs.serialization.Encoding.PEM).decode() for c in
            x509.load_pem_x509_certificates(bundle.encode())]  # fmt: skip


def signed_by(leaf_pem: str, ca_pem: str) -> bool:
    try:
        x509.load_pem_x509_certificate(leaf_pem.encode()).verify_directly_issued_by(
            x509.load_pem_x509_certificate(ca_pem.encode())
        )
    except (ValueError, TypeError, certs.InvalidSignature):
        return False
    return True


# -- the phases (sans-I/O) ------------------------------------------------------------------


@dataclass
class Cas:
    ca: certs.KeyPair | None
    ca_next: certs.KeyPair | None = None
    ca_previous: str | None = None
    rotation: CaRotation | None = None
    made: list[certs.KeyPair] = field(default_factory=list)

    def make(self) -> certs.KeyPair:
        self.made.append(certs.new_ca(CLUSTER, NOW))
        return self.made[-1]


def test_a_rotation_stages_switches_and_completes_each_after_the_grace_period() -> None:
    old = certs.new_ca(CLUSTER, NOW)
    cas = Cas(old)
    assert carotation.advance(cas, None, False, NOW, GRACE, cas.make) is None
    assert carotation.bundle(cas) == old.cert
    step = carotation.advance(cas, "r1", False, NOW, GRACE, cas.make)
    assert step is not None and "requested (r1)" in step
    new = cas.made[0]
    assert cas.ca == old and cas.ca_next == new  # staged: trusted, not signing
    assert pems(carotation.bundle(cas)) == [old.cert, new.cert]
    assert cas.rotation is not None and cas.rotation.phase == "Staged"
    half = NOW + timedelta(seconds=GRACE / 2)
    assert carotation.advance(cas, "r1", False, half, GRACE, cas.make) is None
    switched = NOW + timedelta(seconds=GRACE)
    assert carotation.advance(cas, "r1", False, switched, GRACE, cas.make) is not None
    assert cas.ca == new and cas.ca_previous == old.cert  # the new one signs, both trusted
    assert pems(carotation.bundle(cas)) == [new.cert, old.cert]
    done = switched + timedelta(seconds=GRACE)
    assert carotation.advance(cas, "r1", False, done, GRACE, cas.make) is not None
    assert carotation.bundle(cas) == new.cert and cas.ca_previous is None
    assert cas.rotation is not None and cas.rotation.phase == "Complete"
    assert cas.rotation.request == "r1"
    # The same id is handled once; a new one rotates again; age alone does too.
    assert carotation.advance(cas, "r1", False, done, GRACE, cas.make) is None
    finished = cas.rotation
    assert carotation.advance(cas, "r2", False, done, GRACE, cas.make) is not None
    aged = Cas(old, rotation=finished)
    step = carotation.advance(aged, "r1", True, done, GRACE, aged.make)
    assert step is not None and "two thirds" in step
    assert aged.rotation is not None and aged.rotation.request == "r1"


def test_the_grace_setting_is_read_and_zero_is_refused() -> None:
    assert carotation.grace_seconds({}) == carotation.DEFAULT_CA_GRACE
    assert carotation.grace_seconds({carotation.CA_GRACE_ENV: "5"}) == 5
    with pytest.raises(ValueError, match="at least 1"):
        carotation.grace_seconds({carotation.CA_GRACE_ENV: "0"})


def test_the_crd_refuses_a_rotation_of_a_ca_the_operator_does_not_manage(
    kube_apiserver: KubeApiServer,
) -> None:
    api = Kube(str(kube_apiserver.kubeconfig))
    install_crd(api)

    def apply(name: str, spec: dict[str, object]) -> None:
        api.apply({
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": "default"},
            "spec": {**spec, "requests": {"rotateCa": {"id": "r1"}}},
        })  # fmt: skip

    for tls in ({"secretName": "mine"}, {"enabled": False},
                {"issuerRef": {"name": "ca-issuer", "kind": "Issuer"}}):  # fmt: skip
        with pytest.raises(Refused) as refused:
            apply("not-managed", {"tls": tls})
        assert "requests.rotateCa rotates the operator-managed CA" in str(refused.value)
    apply("managed", {})


# -- the real API server ----------------------------------------------------------------------


def secret(kube: Kube, name: str) -> dict[str, str]:
    found = kube.get_secret_data("default", name)
    assert found is not None, name
    return found


def published(kube: Kube) -> str:
    found = kube.get("v1", "ConfigMap", "default", "rotating-ca")
    assert found is not None
    return str(found["data"]["ca.crt"])


def test_the_operator_rotates_its_ca_on_request_and_a_restarted_one_resumes(kube: Kube) -> None:
    memory = certs.TlsMemory()

    def reconcile(at: datetime, request: str | None, into: certs.TlsMemory) -> None:
        certs.reconcile_tls(CLUSTER, requested(request), into, kube, kube.apply, now=at,
                            seconds=30 * 86400, grace=GRACE)  # fmt: skip

    reconcile(NOW, None, memory)
    old = secret(kube, "rotating-tls-ca")["tls.crt"]
    first = secret(kube, "rotating-primary-tls")["tls.crt"]
    assert published(kube) == old and memory.events == []
    reconcile(NOW, "r1", memory)  # staged
    ca = secret(kube, "rotating-tls-ca")
    assert ca["tls.crt"] == old and ca[carotation.NEXT_CERT] and ca[carotation.NEXT_KEY]
    staged = ca[carotation.NEXT_CERT]
    assert pems(published(kube)) == [old, staged]
    for name in ("rotating-tls", "rotating-primary-tls", "rotating-backup-tls"):
        held = secret(kube, name)
        assert pems(held["ca.crt"]) == [old, staged] and signed_by(held["tls.crt"], old)
    assert secret(kube, "rotating-primary-tls")["tls.crt"] == first  # nothing issued yet
    assert len(memory.events) == 1 and "r1" in memory.events[0]
    # A restarted operator (no memory) reads the rotation from the CA's Secret.
    again = certs.TlsMemory()
    switch = NOW + timedelta(seconds=GRACE)
    reconcile(switch - timedelta(seconds=1), "r1", again)
    assert again.rotation is not None and again.rotation.phase == "Staged"
    assert again.issued == 0 and secret(kube, "rotating-tls-ca")[carotation.NEXT_CERT] == staged
    reconcile(switch, "r1", again)  # switched: the new CA signs, every certificate anew
    ca = secret(kube, "rotating-tls-ca")
    assert ca["tls.crt"] == staged and ca[carotation.PREVIOUS_CERT] == old
    assert carotation.NEXT_CERT not in ca
    assert pems(published(kube)) == [staged, old]
    for name in ("rotating-tls", "rotating-primary-tls", "rotating-backup-tls"):
        held = secret(kube, name)
        assert signed_by(held["tls.crt"], staged) and pems(held["ca.crt"]) == [staged, old]
    assert again.issued == 3
    reconcile(switch + timedelta(seconds=GRACE), "r1", again)  # complete
    ca = secret(kube, "rotating-tls-ca")
    assert carotation.PREVIOUS_CERT not in ca and published(kube) == staged
    assert secret(kube, "rotating-primary-tls")["ca.crt"] == staged
    state = CaRotation.model_validate_json(ca[carotation.STATE])
    assert state.phase == "Complete" and state.request == "r1"
    assert [e.split(":")[0] for e in again.events] == ["CA rotation", "CA rotation complete"]


# -- real brokers through the phases ----------------------------------------------------------

REFUSED = 'twinmq_replication_refused_total{reason="certificate"}'


class Volume:
    """One broker's mounted Secret as the kubelet keeps it: the files are links into a
    `..data` directory swapped whole, so a reader never sees a new key with an old
    certificate."""

    def __init__(self, folder: Path, name: str) -> None:
        folder.mkdir(parents=True)
        self.folder, self.name, self.version = folder, name, 0
        self.cert, self.key, self.ca = folder / "tls.crt", folder / "tls.key", folder / "ca.crt"
        self.leaf: certs.KeyPair | None = None

    def write(self, bundle: str, signer: certs.KeyPair | None = None) -> None:
        """The bundle, and with `signer` a new certificate it issues for this broker (as
        the operator's peer certificates: client and server use, its name)."""
        if signer is not None:
            self.leaf = certs.issue_server(
                signer, [self.name, "localhost"], datetime.now(UTC), 3600, client=True,
                common_name=self.name, addresses=["127.0.0.1"],
            )  # fmt: skip
        assert self.leaf is not None
        self.write_files(self.leaf.cert, self.leaf.key, bundle)

    def write_files(self, cert: str, key: str, bundle: str) -> None:
        """The three files as given, swapped in at once (a bad one included)."""
        self.version += 1
        data = self.folder / f"..{self.version}"
        data.mkdir()
        (data / "tls.crt").write_text(cert)
        (data / "tls.key").write_text(key)
        (data / "ca.crt").write_text(bundle)
        link = self.folder / "..data.tmp"
        link.symlink_to(data.name)
        link.replace(self.folder / "..data")
        for path in (self.cert, self.key, self.ca):
            if not path.is_symlink():
                path.symlink_to(f"..data/{path.name}")


def amqps_round_trip(port: int, bundle: str) -> None:
    """A pika client that trusts `bundle` publishes and gets one message over AMQPS."""
    context = ssl.create_default_context(cadata=bundle)
    params = pika.ConnectionParameters(
        host="127.0.0.1", port=port, connection_attempts=1,
        ssl_options=pika.SSLOptions(context, "localhost"),
    )  # fmt: skip
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.queue_declare("rotation")
        channel.confirm_delivery()
        channel.basic_publish("", "rotation", b"x")
        method, _, _ = channel.basic_get("rotation", auto_ack=True)
        assert method is not None
    finally:
        connection.close()


def log_count(pair: Pair, name: str, text: str) -> int:
    path = pair.brokers[name].log_path
    assert path is not None
    return path.read_text().count(text)


def delivered(pair: Pair, volumes: list[Volume], bundle: str, signer: certs.KeyPair | None) -> None:
    """The kubelet updates these pods' volumes (the bundle, and with `signer` a new
    certificate); each broker loads its changed files (it looks every 5 s); then the
    replication link is cut so both ends meet in new TLS handshakes."""
    before = {v.name: log_count(pair, v.name, "TLS certificate reloaded") for v in volumes}
    for volume in volumes:
        volume.write(bundle, signer)
    for volume in volumes:
        wait_for(f"{volume.name} reloaded its TLS files", lambda v=volume: log_count(
            pair, v.name, "TLS certificate reloaded") > before[v.name], 30)  # fmt: skip
    relinked(pair)


def relinked(pair: Pair) -> None:
    """Cut the replication link, so both ends meet in new TLS handshakes, and wait until
    the pair is in sync again (a refused certificate never lets it)."""
    lost = f"replication link to {pair.passive_name} lost"
    dropped = log_count(pair, pair.active_name, lost)
    pair.link.cut()
    wait_for("the active saw the link go", lambda: log_count(
        pair, pair.active_name, lost) > dropped, 30)  # fmt: skip
    pair.link.heal()
    pair.wait_healthy(60)


@pytest.mark.slow
def test_a_pair_and_its_clients_keep_trusting_each_other_through_a_rotation(
    tmp_path: Path,
) -> None:
    """Each phase as the kubelet delivers it, the two pods' volumes updated one after the
    other: the pair re-forms over mutual TLS after every step, and an application holding
    the bundle published before the step still verifies the broker."""
    cas = Cas(certs.new_ca(CLUSTER, datetime.now(UTC)))
    assert cas.ca is not None
    first = cas.ca
    volumes = {name: Volume(tmp_path / "tls" / name, name) for name in ("a", "b")}
    for volume in volumes.values():
        volume.write(carotation.bundle(cas), cas.ca)
    pair = Pair(tmp_path / "pair", replication_timeout=1.0)
    ports = {name: free_port() for name in volumes}
    for name, broker in pair.brokers.items():
        volume = volumes[name]
        for setting, path in (("cert", volume.cert), ("key", volume.key), ("ca", volume.ca)):
            broker.env[setting_env(f"replication_tls_{setting}")] = str(path)
        broker.env[setting_env("tls_cert")] = str(volume.cert)
        broker.env[setting_env("tls_key")] = str(volume.key)
        broker.env[setting_env("tls_port")] = str(ports[name])
    active, passive = pair.active_name, pair.passive_name
    with pair:
        client = carotation.bundle(cas)  # what an application mounted at the start
        amqps_round_trip(ports[active], client)
        now = datetime.now(UTC)
        both = list(volumes.values())
        # Staged: both pods get the bundle with the new CA; their certificates unchanged.
        carotation.advance(cas, "r1", False, now, 1, cas.make)
        delivered(pair, both, carotation.bundle(cas), None)
        amqps_round_trip(ports[active], client)
        client = carotation.bundle(cas)  # applications refresh their copy meanwhile
        # Switched: the new CA signs. The active's volume is updated first: a new-signed
        # active meets an old-signed passive.
        carotation.advance(cas, "r1", False, now + timedelta(seconds=1), 1, cas.make)
        assert cas.ca is not None
        delivered(pair, [volumes[active]], carotation.bundle(cas), cas.ca)
        amqps_round_trip(ports[active], client)
        delivered(pair, [volumes[passive]], carotation.bundle(cas), cas.ca)
        # Complete: the old CA leaves the bundle.
        carotation.advance(cas, "r1", False, now + timedelta(seconds=2), 1, cas.make)
        delivered(pair, both, carotation.bundle(cas), None)
        amqps_round_trip(ports[active], client)
        amqps_round_trip(ports[active], carotation.bundle(cas))
        for name, broker in pair.brokers.items():
            samples = metric_samples(broker.admin.metrics(timeout=5))
            assert samples.get(REFUSED, 0.0) == 0, name
        # And the brokers no longer trust it, without a restart: a certificate the old CA
        # signs (its key leaked, say) is refused on the replication port.
        forged = certs.issue_server(first, ["b"], datetime.now(UTC), 3600, client=True,
                                    common_name="b", addresses=["127.0.0.1"])  # fmt: skip
        present(pair.brokers[active].replication_address, forged, carotation.bundle(cas),
                tmp_path / "forged")  # fmt: skip
        wait_for("the old CA's certificate refused", lambda: metric_samples(
            pair.brokers[active].admin.metrics(timeout=5)).get(REFUSED, 0.0) == 1, 30)  # fmt: skip


def present(address: str, leaf: certs.KeyPair, trust: str, folder: Path) -> None:
    """Open a TLS connection to `address` presenting `leaf` (its files written in
    `folder`; the server verified against `trust`); read until the server ends it."""
    folder.mkdir()
    (folder / "c.pem").write_text(leaf.cert)
    (folder / "k.pem").write_text(leaf.key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(cadata=trust)
    context.load_cert_chain(folder / "c.pem", folder / "k.pem")
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                tls.recv(1)  # TLS 1.3: the refusal comes as an alert after the handshake
        except (ssl.SSLError, OSError):
            pass


# -- every pod loaded the phase's files before the next ---------------------------------------


def reported(bundle: str | None, leaf: str, listener: TlsListenerName = "replication",
             error: str | None = None) -> TlsFilesStatus:  # fmt: skip
    """What a broker's `/status` says of one listener's files, described as it does."""
    cas = [] if bundle is None else [fingerprint(c) for c in
                                     x509.load_pem_x509_certificates(bundle.encode())]  # fmt: skip
    return TlsFilesStatus(
        listener=listener, cert_file="/tls/tls.crt", ca_file=None if bundle is None else "ca",
        certificate=describe(x509.load_pem_x509_certificate(leaf.encode())),
        ca_fingerprints=cas, loaded_at=0.0, load_error=error,
    )  # fmt: skip


def leaf_of(signer: certs.KeyPair) -> str:
    return certs.issue_server(signer, ["primary"], NOW, 3600, client=True).cert


def test_a_phase_waits_past_its_time_for_the_pod_still_holding_the_previous_files() -> None:
    old = certs.new_ca(CLUSTER, NOW)
    cas = Cas(old)
    carotation.advance(cas, "r1", False, NOW, GRACE, cas.make, {})
    new, first_bundle, leaf = cas.made[0], old.cert, leaf_of(old)
    staged = carotation.bundle(cas)
    due = NOW + timedelta(seconds=GRACE)
    # The staged bundle reached the primary; the backup's kubelet has not delivered it yet.
    loaded: carotation.Loaded = {
        "primary": [reported(staged, leaf)],
        "backup": [reported(first_bundle, leaf)],
    }
    assert carotation.advance(cas, "r1", False, due, GRACE, cas.make, loaded) is None
    assert cas.rotation is not None and cas.rotation.phase == "Staged"
    waiting = cas.rotation.waiting
    assert waiting is not None and "backup: its replication trust bundle lacks the staged CA" in (
        waiting
    ) and "primary" not in waiting  # fmt: skip
    # No answer from a pod is no proof it loaded them either.
    assert carotation.advance(cas, "r1", False, due, GRACE, cas.make, {**loaded, "backup": None}
                              ) is None  # fmt: skip
    assert "backup: no report" in (cas.rotation.waiting or "")
    loaded["backup"] = [reported(staged, leaf)]
    step = carotation.advance(cas, "r1", False, due, GRACE, cas.make, loaded)
    assert step is not None and cas.ca == new and cas.rotation.phase == "Switched"
    assert cas.rotation.waiting is None
    # Switched: every certificate is issued again by the new CA. The backup's broker could
    # not load its new files (a bad key): it still presents the old CA's certificate.
    switched, renewed = carotation.bundle(cas), leaf_of(new)
    later = due + timedelta(seconds=GRACE)
    loaded = {
        "primary": [reported(switched, renewed), reported(None, renewed, "amqps")],
        "backup": [reported(switched, leaf, error="SSLError: key values mismatch"),
                   reported(None, renewed, "amqps")],
    }  # fmt: skip
    assert carotation.advance(cas, "r1", False, later, GRACE, cas.make, loaded) is None
    waiting = cas.rotation.waiting
    assert waiting is not None and waiting.startswith("the Switched phase's files")
    assert "backup: its replication certificate" in waiting and "previous CA" in waiting
    assert "key values mismatch" in waiting and "primary" not in waiting
    assert carotation.load_errors(loaded)[0][0] == "backup"
    # A bundle of another's (the mirror's: the other site's CA) is not this CA's business.
    other_site = certs.new_ca(ClusterRef("far", "away", "uid-far"), NOW).cert
    loaded["backup"] = [reported(switched, renewed), reported(other_site, renewed, "mirror")]
    assert carotation.advance(cas, "r1", False, later, GRACE, cas.make, loaded) is not None
    assert cas.rotation.phase == "Complete" and cas.rotation.waiting is None
    assert carotation.bundle(cas) == new.cert


LOADING = ClusterRef(namespace="default", name="loading", uid="uid-loading")


def test_the_operator_holds_each_phase_until_both_brokers_loaded_its_files(
    kube: Kube, tmp_path: Path
) -> None:
    """The managed CA's Secrets on the real API server, copied into two real brokers'
    volumes one pod at a time (the kubelet's lag): the rotation advances only once the
    brokers' `/status` shows both loaded the phase's files."""
    memory, start = certs.TlsMemory(), datetime.now(UTC)

    def reconcile(at: datetime, request: str | None, loaded: carotation.Loaded | None) -> None:
        certs.reconcile_tls(LOADING, requested(request), memory, kube, kube.apply, now=at,
                            seconds=30 * 86400, grace=GRACE, loaded=loaded)  # fmt: skip

    reconcile(start, None, None)
    names = ("primary", "backup")
    own = {n: Volume(tmp_path / n / "own", n) for n in names}
    server = {n: Volume(tmp_path / n / "server", n) for n in names}

    def deliver(name: str) -> None:
        """The kubelet writes this pod's two Secrets' current content into its volumes."""
        mine, shared = secret(kube, f"loading-{name}-tls"), secret(kube, "loading-tls")
        own[name].write_files(mine["tls.crt"], mine["tls.key"], mine["ca.crt"])
        server[name].write_files(shared["tls.crt"], shared["tls.key"], shared["ca.crt"])

    brokers = {n: BrokerProcess(tmp_path / n / "data", name=n) for n in names}
    for name, broker in brokers.items():
        deliver(name)
        for setting in ("cert", "key", "ca"):
            path = getattr(own[name], setting)
            broker.env[setting_env(f"replication_tls_{setting}")] = str(path)
        broker.env[setting_env("tls_cert")] = str(server[name].cert)
        broker.env[setting_env("tls_key")] = str(server[name].key)
        broker.env[setting_env("tls_port")] = str(free_port())

    def loaded() -> carotation.Loaded:
        return {n: b.admin.status(timeout=5).tls for n, b in brokers.items()}

    def reloads(name: str) -> int:
        return sum(f.reloads for f in brokers[name].admin.status(timeout=5).tls)

    def delivered(name: str) -> None:
        before = reloads(name)
        deliver(name)
        wait_for(f"{name} reloaded both listeners' files", lambda: reloads(name) >= before + 2, 30)

    def phase() -> str:
        assert memory.rotation is not None
        return memory.rotation.phase

    with brokers["primary"].start(), brokers["backup"].start():
        reconcile(start, "r1", loaded())
        assert phase() == "Staged"
        delivered("primary")
        due = start + timedelta(seconds=GRACE)
        reconcile(due, "r1", loaded())
        assert phase() == "Staged"  # the time has come, the backup still has the old bundle
        assert memory.rotation is not None and memory.rotation.waiting is not None
        assert memory.rotation.waiting.startswith("the Staged phase's files are not loaded")
        assert "backup: its replication trust bundle lacks the staged CA" in (
            memory.rotation.waiting
        )
        state = CaRotation.model_validate_json(secret(kube, "loading-tls-ca")[carotation.STATE])
        assert state.waiting == memory.rotation.waiting  # a restarted operator knows why
        delivered("backup")
        reconcile(due, "r1", loaded())
        assert phase() == "Switched"  # every certificate issued again by the new CA
        delivered("primary")
        later = due + timedelta(seconds=GRACE)
        reconcile(later, "r1", loaded())
        assert phase() == "Switched"
        waiting = memory.rotation.waiting or ""
        assert "backup: its amqps certificate" in waiting and "previous CA" in waiting
        assert "its replication certificate" in waiting and "primary" not in waiting
        delivered("backup")
        reconcile(later, "r1", loaded())
        assert phase() == "Complete" and memory.rotation.waiting is None
