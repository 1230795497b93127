"""Mutual TLS between a cluster's brokers and HTTPS on their admin API, from the operator
(operator/peertls.py, operator/certs.py, issue 16): each broker's own certificate naming it
only (real API server), the pods at each step of the move from plaintext, the steps walked
one rolling update at a time with never two brokers more than a step apart, and real
brokers pairing over mutual TLS with the operator's files (one broker's certificate cannot
pass for the other) and answering the operator's admin client over verified HTTPS."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from apiserver import install_crd
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from test_operator_rollout import Pair as RolloutSim

import twinmq.operator.probe as probe_module
from twinmq.broker.admin_client import AdminUnreachable
from twinmq.broker.names import setting_env
from twinmq.operator import certs, peertls
from twinmq.operator.builders import (
    ADMIN_SCHEME,
    PEER_TLS_DIR,
    ClusterRef,
    build_pod,
    peer_secret_name,
)
from twinmq.operator.kube import Kube
from twinmq.operator.models import BrokerClusterSpec, BrokerClusterStatus, PeerTlsPhase
from twinmq.operator.probe import admin_of
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

CLUSTER = ClusterRef(namespace="shop", name="orders", uid="uid-1")
NOW = datetime(2026, 11, 27, 20, 0, tzinfo=UTC)
PHASES: tuple[PeerTlsPhase, ...] = ("Plaintext", "PlainListener", "TlsListener", "Required")


def container(phase: PeerTlsPhase, broker: str = "primary") -> dict[str, Any]:
    pod = build_pod(CLUSTER, BrokerClusterSpec(), broker, peer_tls=phase)  # type: ignore[arg-type]
    out: dict[str, Any] = pod["spec"]["containers"][0]
    return out


# -- the pods at each step ------------------------------------------------------------------


def test_plaintext_pods_have_no_peer_certificate_and_probe_over_http() -> None:
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "primary")  # the default: Plaintext
    args = pod["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--replication-tls", "--admin-tls"))]
    assert "scheme" not in pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]
    assert ADMIN_SCHEME not in pod["metadata"]["annotations"]
    assert all(v["name"] != "peer-tls" for v in pod["spec"]["volumes"])


@pytest.mark.parametrize(
    ("phase", "mode"),
    [
        ("PlainListener", "plain-listener"),
        ("TlsListener", "tls-listener"),
        ("Required", "required"),
    ],
)
def test_each_step_gives_the_broker_its_own_certificate_the_mode_and_https(
    phase: PeerTlsPhase, mode: str
) -> None:
    pod = build_pod(CLUSTER, BrokerClusterSpec(), "primary", peer_tls=phase)
    broker = pod["spec"]["containers"][0]
    assert f"--replication-tls-mode={mode}" in broker["args"]
    for flag, file in (("replication-tls-cert", "tls.crt"), ("replication-tls-key", "tls.key"),
                       ("replication-tls-ca", "ca.crt"), ("admin-tls-cert", "tls.crt"),
                       ("admin-tls-key", "tls.key")):  # fmt: skip
        assert f"--{flag}={PEER_TLS_DIR}/{file}" in broker["args"]
    # The passive dials the active's pod IP: it checks the other broker's pod name.
    assert "--replication-tls-server-name=orders-backup" in broker["args"]
    assert "--replication-tls-server-name=orders-primary" in container(phase, "backup")["args"]
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "peer-tls")
    assert volume["secret"]["secretName"] == "orders-primary-tls"
    assert "subPath" not in next(m for m in broker["volumeMounts"] if m["name"] == "peer-tls")
    for probe in ("readinessProbe", "livenessProbe"):
        assert broker[probe]["httpGet"]["scheme"] == "HTTPS"
    assert pod["metadata"]["annotations"][ADMIN_SCHEME] == "https"


def test_a_user_annotation_cannot_make_the_operator_dial_https() -> None:
    spec = BrokerClusterSpec.model_validate(
        {"podTemplate": {"metadata": {"annotations": {ADMIN_SCHEME: "https"}}}}
    )
    pod = build_pod(CLUSTER, spec, "primary")
    assert ADMIN_SCHEME not in pod["metadata"]["annotations"]


# -- the steps ------------------------------------------------------------------------------


def test_the_target_is_required_with_certificates_per_broker_else_plaintext() -> None:
    assert peertls.target(BrokerClusterSpec()) == "Required"
    issuer = {"tls": {"issuerRef": {"name": "corp", "kind": "ClusterIssuer"}}}
    assert peertls.target(BrokerClusterSpec.model_validate(issuer)) == "Required"
    own = BrokerClusterSpec.model_validate({"tls": {"secretName": "mine"}})
    assert peertls.target(own) == "Plaintext"  # one certificate cannot tell the brokers apart
    off = BrokerClusterSpec.model_validate({"tls": {"enabled": False}})
    assert peertls.target(off) == "Plaintext"


def test_a_new_cluster_starts_at_its_target_and_an_older_one_where_its_pods_are() -> None:
    spec = BrokerClusterSpec()
    assert peertls.current(None, spec, [None, None], started=False) == "Required"
    # Pods of an older operator (no mode flag): Plaintext; an operator that died before it
    # recorded the step: what its pods run, the earlier step mid-rollout.
    older = build_pod(CLUSTER, spec, "primary")
    assert peertls.current(None, spec, [older, None], started=True) == "Plaintext"
    assert peertls.current(None, spec, [None, None], started=True) == "Plaintext"
    listening = build_pod(CLUSTER, spec, "primary", peer_tls="TlsListener")
    required = build_pod(CLUSTER, spec, "backup", peer_tls="Required")
    assert peertls.current(None, spec, [required, None], started=True) == "Required"
    assert peertls.current(None, spec, [listening, required], started=True) == "TlsListener"
    assert peertls.current("TlsListener", spec, [older, older], started=True) == "TlsListener"


def test_a_step_is_taken_only_from_a_converged_pair_in_sync_one_at_a_time_either_way() -> None:
    assert peertls.advance("Plaintext", "Required", converged=False, in_sync=True) == "Plaintext"
    assert peertls.advance("Plaintext", "Required", converged=True, in_sync=False) == "Plaintext"
    assert peertls.advance("Plaintext", "Required", converged=True, in_sync=True) == (
        "PlainListener"
    )
    assert peertls.advance("Required", "Plaintext", converged=True, in_sync=True) == "TlsListener"
    assert peertls.advance("Required", "Required", converged=True, in_sync=True) == "Required"


@pytest.mark.parametrize(("start", "goal"), [("Plaintext", "Required"), ("Required", "Plaintext")])
def test_a_whole_move_never_runs_brokers_more_than_a_step_apart(
    start: PeerTlsPhase, goal: PeerTlsPhase
) -> None:
    """The rollout planner (operator/rollout.py) and the steps together, one reconcile at a
    time: the two running brokers are always at the same step or neighbours, which pair
    (tests/test_replication_tls.py), so the rollout's switchovers are always allowed."""
    sim = RolloutSim(revision=start, running={"primary": start, "backup": start})
    phase, walked = start, [start]
    for _ in range(60):
        decision = sim.step()
        running = [PHASES.index(p) for p in sim.running.values() if p]  # "" = recreating
        assert max(running) - min(running) <= 1, sim.running
        if decision.converged and phase == goal:
            break
        phase = peertls.advance(phase, goal, converged=decision.converged, in_sync=True)
        if phase != sim.revision:
            sim.revision = phase
            walked.append(phase)
    assert sim.running == {"primary": goal, "backup": goal}
    assert walked == list(PHASES if start == "Plaintext" else reversed(PHASES))


def test_the_api_server_keeps_the_recorded_step(kube: Kube) -> None:
    """`status.peerTls` is in the CRD's schema (not pruned): a restarted operator resumes
    from the step recorded; a value that is no step is refused."""
    install_crd(kube)
    meta = {"name": "peer-steps", "namespace": "default"}
    kube.apply({"apiVersion": "twinmq.io/v1alpha1", "kind": "BrokerCluster", "metadata": meta,
                "spec": {}})  # fmt: skip
    clusters = kube.dynamic.resources.get(api_version="twinmq.io/v1alpha1", kind="BrokerCluster")

    def record(value: str) -> None:
        clusters.status.patch(
            body={"status": {"peerTls": value}}, name="peer-steps", namespace="default",
            content_type="application/merge-patch+json",
        )  # fmt: skip

    record("TlsListener")
    found = kube.get("twinmq.io/v1alpha1", "BrokerCluster", "default", "peer-steps")
    assert found is not None
    status = BrokerClusterStatus.model_validate(found["status"])
    assert status.peer_tls == "TlsListener"
    with pytest.raises(Exception, match="peerTls"):
        record("Sideways")


# -- each broker's own certificate ----------------------------------------------------------


def test_each_brokers_certificate_names_that_broker_only_for_server_and_client_use() -> None:
    primary, backup = certs.peer_names(CLUSTER, "primary"), certs.peer_names(CLUSTER, "backup")
    assert primary[0] == "orders-primary" and "orders-backup" not in primary
    assert "orders-primary.orders-brokers.shop.svc" in primary
    assert not set(primary) & set(backup)
    assert "orders" not in primary and "orders.shop.svc" not in primary  # not the VIP's
    ca = certs.new_ca(CLUSTER, NOW)
    own = certs.issue_server(ca, primary, NOW, 3600, client=True).certificate()
    usages = own.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def secret(kube: Kube, cluster: ClusterRef, name: str) -> dict[str, str]:
    data = kube.get_secret_data(cluster.namespace, name)
    assert data is not None, name
    return data


def test_the_operator_issues_each_broker_its_own_certificate_and_keeps_it(kube: Kube) -> None:
    cluster = ClusterRef(namespace="default", name="peer-made", uid="uid-peer")
    spec = BrokerClusterSpec()
    memory = certs.TlsMemory()
    certs.reconcile_tls(cluster, spec, memory, kube, kube.apply, now=NOW, seconds=3600)
    ca_pem = secret(kube, cluster, "peer-made-tls-ca")["tls.crt"]
    ca = x509.load_pem_x509_certificate(ca_pem.encode())
    owned: dict[str, dict[str, str]] = {}
    for broker in ("primary", "backup"):
        data = owned[broker] = secret(kube, cluster, peer_secret_name(cluster, broker))  # type: ignore[arg-type]
        cert = x509.load_pem_x509_certificate(data["tls.crt"].encode())
        cert.verify_directly_issued_by(ca)
        assert certs.sans(cert) == certs.peer_names(cluster, broker)  # type: ignore[arg-type]
        assert data["ca.crt"] == ca_pem
    # A restarted operator takes what it finds (nothing issued), and trusts the CA at once
    # for its admin HTTPS calls, before it reconciles the certificates.
    again = certs.TlsMemory()
    assert (
        certs.brokers_ca(cluster, spec.tls, again, kube)
        == ca.public_bytes(certs.serialization.Encoding.PEM).decode()
    )
    certs.reconcile_tls(cluster, spec, again, kube, kube.apply, now=NOW, seconds=3600)
    assert again.issued == 0
    assert secret(kube, cluster, "peer-made-primary-tls") == owned["primary"]
    # Renewed like the AMQPS one: at two thirds of its life, under the same CA.
    kept = again.peers["primary"].pair
    assert kept is not None
    later = certs.renew_at(kept.certificate())
    certs.reconcile_tls(cluster, spec, again, kube, kube.apply, now=later, seconds=3600)
    renewed = secret(kube, cluster, "peer-made-primary-tls")
    assert renewed["tls.crt"] != owned["primary"]["tls.crt"]
    assert renewed["ca.crt"] == owned["primary"]["ca.crt"]


def test_with_an_issuer_each_broker_gets_a_certificate_for_server_and_client_use() -> None:
    spec = BrokerClusterSpec.model_validate(
        {"tls": {"issuerRef": {"name": "corp", "kind": "ClusterIssuer"}}}
    )
    made: list[dict[str, Any]] = []
    certs.reconcile_tls(CLUSTER, spec, certs.TlsMemory(), Nothing(), made.append, clock=0.0)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in made}
    assert ("Certificate", "orders-primary-tls") in kinds
    assert ("Certificate", "orders-backup-tls") in kinds
    own = next(o for o in made if o["metadata"]["name"] == "orders-backup-tls")
    assert own["spec"]["secretName"] == "orders-backup-tls"
    assert own["spec"]["dnsNames"] == certs.peer_names(CLUSTER, "backup")
    assert {"server auth", "client auth"} <= set(own["spec"]["usages"])


class Nothing:
    """No Secrets at all (cert-manager has not written any yet)."""

    def get_secret_data(
        self, namespace: str, name: str, owner: object = None
    ) -> dict[str, str] | None:
        return None


# -- real brokers with the operator's files -------------------------------------------------


def write_files(folder: Path, own: certs.KeyPair, ca: certs.KeyPair) -> dict[str, Path]:
    folder.mkdir(parents=True)
    files = {"tls.crt": own.cert, "tls.key": own.key, "ca.crt": ca.cert}
    for name, text in files.items():
        (folder / name).write_text(text)
    return {name: folder / name for name in files}


def peer_pair(root: Path, ca: certs.KeyPair, owns: dict[str, certs.KeyPair]) -> Pair:
    """The cluster `orders`'s two brokers as its pods run them at `Required`: named as
    the pods, each with the certificate given, the passive checking the other pod's name
    (it dials loopback, as in Kubernetes a pod IP, which no certificate names)."""
    pair = Pair(root, link=False, names=("orders-primary", "orders-backup"))
    for name, broker in pair.brokers.items():
        files = write_files(root / f"{name}-files", owns[name], ca)
        other = "orders-backup" if name == "orders-primary" else "orders-primary"
        broker.env.update({
            setting_env("replication_tls_cert"): str(files["tls.crt"]),
            setting_env("replication_tls_key"): str(files["tls.key"]),
            setting_env("replication_tls_ca"): str(files["ca.crt"]),
            setting_env("replication_tls_mode"): "required",
            setting_env("replication_tls_server_name"): other,
        })  # fmt: skip
    return pair


def test_a_pair_with_the_operators_certificates_replicates_over_mutual_tls(
    tmp_path: Path,
) -> None:
    ca = certs.new_ca(CLUSTER, datetime.now(UTC))
    owns = {
        f"orders-{b}": certs.issue_server(
            ca,
            certs.peer_names(CLUSTER, b),
            datetime.now(UTC),
            3600,
            client=True,  # type: ignore[arg-type]
        )
        for b in ("primary", "backup")
    }
    with peer_pair(tmp_path / "pair", ca, owns) as pair:
        passive = status(pair.passive)
        assert passive is not None and passive["replication"]["ready"]
        assert passive["replication"]["link_tls"]


def test_one_brokers_certificate_cannot_pass_for_the_other(tmp_path: Path) -> None:
    """The backup given the primary's own certificate (a valid one of the same CA): the
    active refuses it, since it does not name the broker the backup says it is."""
    ca = certs.new_ca(CLUSTER, datetime.now(UTC))
    primary = certs.issue_server(
        ca, certs.peer_names(CLUSTER, "primary"), datetime.now(UTC), 3600, client=True
    )
    pair = peer_pair(tmp_path / "pair", ca, {"orders-primary": primary, "orders-backup": primary})
    try:
        for broker, role in ((pair.active, "active"), (pair.passive, "passive")):
            broker.extra_args = pair.args(role)
            broker.start()
        assert pair.active.log_path is not None
        wait_for(
            "the active's refusal",
            lambda: "claims to be 'orders-backup'" in pair.active.log_path.read_text(),  # type: ignore[union-attr]
            30,
        )
        passive = status(pair.passive)
        assert passive is not None and not passive["replication"]["ready"]
    finally:
        pair.stop()


def test_the_operators_admin_client_verifies_the_brokers_https_by_its_pod_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = certs.new_ca(CLUSTER, datetime.now(UTC))
    own = certs.issue_server(
        ca, certs.peer_names(CLUSTER, "primary"), datetime.now(UTC), 3600, client=True
    )
    files = write_files(tmp_path / "files", own, ca)
    broker = BrokerProcess(tmp_path / "data", name="orders-primary")
    broker.extra_args = [f"--admin-tls-cert={files['tls.crt']}",
                         f"--admin-tls-key={files['tls.key']}"]  # fmt: skip
    broker.env[setting_env("admin_token")] = "admin-secret"

    def pod(name: str, https: bool = True) -> dict[str, Any]:
        annotations = {ADMIN_SCHEME: "https"} if https else {}
        return {"metadata": {"name": name, "annotations": annotations},
                "status": {"podIP": "127.0.0.1"}}  # fmt: skip

    monkeypatch.setattr(probe_module, "ADMIN_PORT", broker.admin_port)  # the pod's port
    with broker.start():
        client = admin_of(pod("orders-primary"), "admin-secret", ca.cert)
        assert client is not None and client.url.startswith("https://")
        assert client.status(timeout=5).role == "active"  # a lone broker
        # Another name (the other broker's pod) is refused: the certificate names this one.
        wrong = admin_of(pod("orders-backup"), "admin-secret", ca.cert)
        assert wrong is not None
        with pytest.raises(AdminUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            wrong.status(timeout=5)
        # A CA of another cluster is refused too.
        other = certs.new_ca(ClusterRef("x", "y", "z"), datetime.now(UTC))
        stranger = admin_of(pod("orders-primary"), "admin-secret", other.cert)
        assert stranger is not None
        with pytest.raises(AdminUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            stranger.status(timeout=5)


def test_the_amqps_certificate_naming_both_pods_is_no_replication_identity(
    tmp_path: Path,
) -> None:
    """Both pods mount the AMQPS server certificate, which names both pods: an active
    presenting it (server use only) is refused by the passive, though the CA signed it and
    it names the broker claimed."""
    ca = certs.new_ca(CLUSTER, datetime.now(UTC))
    amqps = certs.issue_server(ca, certs.dns_names(CLUSTER), datetime.now(UTC), 3600)
    backup = certs.issue_server(
        ca, certs.peer_names(CLUSTER, "backup"), datetime.now(UTC), 3600, client=True
    )
    pair = peer_pair(tmp_path / "pair", ca, {"orders-primary": amqps, "orders-backup": backup})
    try:
        for broker, role in ((pair.active, "active"), (pair.passive, "passive")):
            broker.extra_args = pair.args(role)
            broker.start()
        log = pair.passive.log_path
        assert log is not None
        wait_for(
            "the passive's refusal",
            lambda: "not for client and server use" in log.read_text(),
            30,
        )
        passive = status(pair.passive)
        assert passive is not None and not passive["replication"]["ready"]
    finally:
        pair.stop()
