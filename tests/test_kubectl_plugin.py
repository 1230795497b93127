"""`kubectl twinmq` without a cluster: argument parsing, request ids and patches, outcomes,
the status table, API error messages, and the request/wait flow against a fake API."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime
from typing import Any

import pytest

from twinmq.cli import kubectl
from twinmq.cli.kubectl import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_TIMEOUT,
    PluginError,
    describe_api_error,
    new_request_id,
    outcome,
    parse_args,
    pending_request,
    render_table,
    request_patch,
    status_rows,
)
from twinmq.operator.models import BrokerClusterSpec

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
Obj = dict[str, Any]


def cluster_obj(name: str = "orders", namespace: str = "prod", **status: Any) -> Obj:
    """A BrokerCluster as the API returns it."""
    return {
        "apiVersion": "twinmq.io/v1alpha1",
        "kind": "BrokerCluster",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {},
        "status": status,
    }


def pair(active: str = "primary", epoch: int = 1, backup_ready: bool = True) -> list[Obj]:
    """Status entries of a healthy pair."""
    passive = "backup" if active == "primary" else "primary"
    return [
        {"name": active, "role": "active", "reachable": True, "ready": False, "epoch": epoch},
        {"name": passive, "role": "passive", "reachable": True, "ready": backup_ready,
         "epoch": epoch, "lagMessages": 3, "lagSeconds": 0.25},
    ]  # fmt: skip


# -- parsing ----------------------------------------------------------------------------


def test_parse_each_command() -> None:
    args = parse_args(["promote", "orders", "backup", "--force", "-n", "prod", "--wait"])
    assert (args.command, args.cluster, args.broker, args.force, args.namespace, args.wait) == (
        "promote", "orders", "backup", True, "prod", True,
    )  # fmt: skip
    assert parse_args(["recover", "orders", "--timeout", "5", "--wait"]).timeout == 5.0
    assert parse_args(["fence", "orders", "primary"]).broker == "primary"
    assert parse_args(["unfence", "orders", "primary"]).command == "unfence"
    assert parse_args(["audit", "orders"]).wait is False
    status = parse_args(["status"])
    assert (status.cluster, status.all_namespaces, status.output) == (None, False, "table")
    assert parse_args(["status", "orders", "-o", "json"]).output == "json"
    assert parse_args(["status", "-A"]).all_namespaces


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["promote", "orders", "tertiary"], "invalid choice: 'tertiary'"),
        (["promote", "orders"], "the following arguments are required: BROKER"),
        (["fence", "orders"], "the following arguments are required: BROKER"),
        (["recover"], "the following arguments are required: CLUSTER"),
        (["failover", "orders"], "invalid choice: 'failover'"),
        ([], "the following arguments are required: COMMAND"),
        (["status", "-A", "-n", "prod"], "either --namespace or --all-namespaces"),
        (["recover", "orders", "--timeout", "0"], "--timeout must be positive"),
        (["recover", "orders", "--force"], "unrecognized arguments: --force"),
    ],
)
def test_usage_errors_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["status", "mirror", "federation", *kubectl.OPERATIONS])
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([command, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: kubectl twinmq {command}" in capsys.readouterr().out


# -- requests ---------------------------------------------------------------------------


def test_request_ids_are_fresh_and_fit_the_api() -> None:
    assert new_request_id("promote", NOW, "ab12") == "promote-20261122T120000Z-ab12"
    assert new_request_id("unfence", NOW, "0000").startswith("fence-")
    ids = {new_request_id("recover", NOW) for _ in range(50)}
    assert len(ids) > 40  # 4 random hex digits
    for request_id in ids:
        assert re.fullmatch(r"recover-20261122T120000Z-[0-9a-f]{4}", request_id)
        assert len(request_id) <= 63


@pytest.mark.parametrize(
    ("command", "broker", "force", "expected"),
    [
        ("promote", "backup", True, {"promote": {"id": "x", "broker": "backup", "force": True}}),
        ("promote", "backup", False, {"promote": {"id": "x", "broker": "backup", "force": False}}),
        ("recover", None, False, {"recover": {"id": "x"}}),
        ("fence", "primary", False, {"fence": {"id": "x", "broker": "primary", "fenced": True}}),
        ("unfence", "primary", False, {"fence": {"id": "x", "broker": "primary", "fenced": False}}),
        ("audit", None, False, {"audit": {"id": "x", "sites": False}}),
        ("rotate-ca", None, False, {"rotateCa": {"id": "x"}}),
    ],
)
def test_request_patches_are_valid_spec_requests(
    command: str, broker: str | None, force: bool, expected: Obj
) -> None:
    patch = request_patch(command, "x", broker, force)
    assert patch == {"spec": {"requests": expected}}
    BrokerClusterSpec.model_validate(patch["spec"])  # the operator's model accepts it


def test_a_cross_site_audit_request_says_so_and_the_operator_accepts_it() -> None:
    assert parse_args(["audit", "orders", "--sites"]).sites is True
    patch = request_patch("audit", "x", sites=True)
    expected = {"audit": {"id": "x", "sites": True}}
    assert patch == {"spec": {"requests": expected}}
    BrokerClusterSpec.model_validate(patch["spec"])  # the operator's model accepts it


def test_pending_request_is_a_declared_id_not_yet_handled() -> None:
    obj = cluster_obj(handledRequests={"promote": "p-1"})
    obj["spec"] = {"requests": {"promote": {"id": "p-2", "broker": "backup"}}}
    assert pending_request(obj, "promote") == "p-2"
    obj["status"]["handledRequests"]["promote"] = "p-2"
    assert pending_request(obj, "promote") is None
    assert pending_request(obj, "recover") is None


def test_outcomes() -> None:
    done = cluster_obj(activeBroker="backup", epoch=2, handledRequests={"promote": "p-1"})
    assert outcome(done, "promote", "backup", "p-1") == (True, "backup is active in epoch 2")
    refused_event = {"message": "backup is not ready: use force to promote anyway (request p-2)"}
    still = cluster_obj(activeBroker="primary", epoch=1)
    ok, message = outcome(still, "promote", "backup", "p-2", [refused_event])
    assert not ok
    assert "backup was not activated: backup is not ready" in message
    assert outcome(cluster_obj(activeBroker="primary", epoch=3), "recover", None, "r")[0]
    fenced = cluster_obj(brokers=[{"name": "primary", "fenced": True}])
    assert outcome(fenced, "fence", "primary", "f") == (True, "primary is fenced")
    assert outcome(fenced, "unfence", "primary", "f")[0] is False
    audited = cluster_obj(lastAudit={"verdict": "FAIL", "run": "r1", "message": "2 lost"})
    assert outcome(audited, "audit", None, "a") == (False, "audit FAIL (run r1): 2 lost")
    passed = cluster_obj(lastAudit={"verdict": "PASS", "run": "r2"})
    assert outcome(passed, "audit", None, "a") == (True, "audit PASS (run r2)")
    refused = {"reason": "AuditNotEnabled", "message": "audit request a: spec.audit.enabled is "
               "false, nothing ran"}  # fmt: skip
    assert outcome(passed, "audit", None, "a", [refused])[0] is False


# -- the table ---------------------------------------------------------------------------


def test_status_rows_one_per_broker() -> None:
    obj = cluster_obj(
        phase="Ready", activeBroker="primary", epoch=4, brokers=list(reversed(pair(epoch=4))),
        lastFailover={"time": "2026-11-22T11:56:50Z", "from": "backup", "to": "primary",
                      "reason": "recover", "epoch": 4},
        lastAudit={"time": "2026-11-22T10:00:00Z", "verdict": "PASS"},
    )  # fmt: skip
    rows = status_rows([obj], NOW)
    tail = ("Ready", "backup->primary 3m10s ago", "PASS 2h0m ago")
    assert rows == [
        ("orders", "primary", "active", "4", "-", "yes", "0", *tail),
        ("orders", "backup", "passive", "4", "yes", "yes", "3 (0.2s)", *tail),
    ]


def test_status_rows_of_a_new_cluster_and_of_a_fenced_unreachable_broker() -> None:
    assert status_rows([cluster_obj()], NOW) == [
        ("orders", "-", "-", "-", "-", "-", "-", "Pending", "-", "-")
    ]
    gone = {"name": "primary", "role": "unknown", "reachable": False, "fenced": True}
    (row,) = status_rows([cluster_obj(phase="Degraded", brokers=[gone])], NOW, True)
    assert row[:8] == ("prod", "orders", "primary", "unknown (fenced)", "0", "no", "no", "0")


def test_status_rows_show_a_broker_whose_journal_is_damaged() -> None:
    damaged = {"name": "backup", "role": "passive", "reachable": True, "damaged": True,
               "damage": "journal damaged since 2026-11-23T10:00:00Z"}  # fmt: skip
    (row,) = status_rows([cluster_obj(phase="Degraded", brokers=[damaged])], NOW)
    assert row[:4] == ("orders", "backup", "passive (damaged)", "0")


def test_render_table_aligns_columns_like_kubectl() -> None:
    rows = status_rows([cluster_obj(phase="Ready", brokers=pair())], NOW)
    lines = render_table(rows).splitlines()
    assert lines[0].split() == list(kubectl.COLUMNS)
    assert len(lines) == 3
    starts = [m.start() for m in re.finditer(r"\S+", lines[0])]
    for line in lines[1:]:
        assert [m.start() for m in re.finditer(r"\S+", line)][:7] == starts[:7]
    wide = render_table(status_rows([cluster_obj(brokers=pair())], NOW, True), True)
    assert wide.splitlines()[0].split()[:2] == ["NAMESPACE", "CLUSTER"]
    assert wide.splitlines()[1].startswith("prod ")


# -- errors ------------------------------------------------------------------------------


class FakeApiError(Exception):
    """Shaped like kubernetes.client.exceptions.ApiException."""

    def __init__(self, status: int, body: Obj | str = "") -> None:
        super().__init__(f"({status})")
        self.status = status
        self.body = body if isinstance(body, str) else json.dumps(body)


def test_api_errors_say_what_is_wrong() -> None:
    forbidden = FakeApiError(403, {"message": 'User "alice" cannot patch resource'})
    message = describe_api_error(forbidden, "patch", "prod", "orders")
    assert "permission denied: you cannot patch brokerclusters.twinmq.io" in message
    assert "grant verb 'patch' on resource 'brokerclusters' in API group 'twinmq.io'" in message
    assert 'User "alice" cannot patch resource' in message
    missing = describe_api_error(FakeApiError(404, {"message": "x"}), "get", "prod", "orders")
    assert missing == 'brokerclusters.twinmq.io "orders" not found in namespace "prod"'
    no_crd = FakeApiError(404, "the server could not find the requested resource")
    assert "CRD is not installed" in describe_api_error(no_crd, "get", "prod", "orders")
    assert "unauthorized" in describe_api_error(FakeApiError(401), "list", None, None)


# -- the request flow against a fake API -------------------------------------------------


class FakeKube(kubectl.Kube):
    """The plugin's API calls, answered from memory; `operator` runs on every get."""

    def __init__(self, obj: Obj | None, operator: Any = None) -> None:
        super().__init__(None, None, None, "prod")
        self.obj = obj
        self.operator = operator
        self.patches: list[Obj] = []

    def get(self, namespace: str, name: str) -> Obj:
        if self.obj is None or self.obj["metadata"]["name"] != name:
            raise PluginError(f'brokerclusters.twinmq.io "{name}" not found', 404)
        if self.operator is not None:
            self.operator(self.obj)
        return json.loads(json.dumps(self.obj))

    def list_clusters(self, namespace: str | None) -> list[Obj]:
        return [] if self.obj is None else [self.obj]

    def patch(self, namespace: str, name: str, body: Obj) -> Obj:
        self.patches.append(body)
        assert self.obj is not None
        self.obj.setdefault("spec", {}).setdefault("requests", {}).update(body["spec"]["requests"])
        return self.obj

    def events(self, namespace: str, name: str) -> list[Obj]:
        return []


def run(kube: FakeKube, argv: list[str]) -> tuple[int, str, str]:
    """Run a request command against `kube` (no sleeping, a fake clock)."""
    out, err = io.StringIO(), io.StringIO()
    ticks = iter(range(10_000))
    args = parse_args(argv)
    try:
        if args.command == "status":
            code = kubectl.cmd_status(kube, args, out)
        elif args.command == "mirror":
            code = kubectl.cmd_mirror_status(kube, args, out)
        elif args.command == "federation":
            code = kubectl.cmd_federation_status(kube, args, out)
        else:
            code = kubectl.cmd_request(
                kube, args, out, err, sleep=lambda _: None, clock=lambda: float(next(ticks))
            )
    except PluginError as exc:
        err.write(f"error: {exc}\n")
        code = EXIT_ERROR
    return code, out.getvalue(), err.getvalue()


def switch_over(obj: Obj) -> None:
    """A fake operator: handles a pending promote by switching the active."""
    request = obj.get("spec", {}).get("requests", {}).get("promote")
    status = obj["status"]
    if request and status.get("handledRequests", {}).get("promote") != request["id"]:
        status["activeBroker"], status["epoch"] = request["broker"], status["epoch"] + 1
        status.setdefault("handledRequests", {})["promote"] = request["id"]


def test_promote_and_wait_reports_the_new_active() -> None:
    kube = FakeKube(cluster_obj(activeBroker="primary", epoch=1, brokers=pair()), switch_over)
    code, out, err = run(kube, ["promote", "orders", "backup", "--wait"])
    assert (code, err) == (EXIT_OK, "")
    (patch,) = kube.patches
    request = patch["spec"]["requests"]["promote"]
    assert request["broker"] == "backup" and request["force"] is False
    assert f"promote request {request['id']} declared" in out
    assert "done: backup is active in epoch 2" in out


def test_rotate_ca_and_wait_reports_where_the_rotation_stands() -> None:
    def rotate(obj: Obj) -> None:
        request = obj.get("spec", {}).get("requests", {}).get("rotateCa")
        if request:
            obj["status"].setdefault("handledRequests", {})["rotateCa"] = request["id"]
            obj["status"]["caRotation"] = {"phase": "Staged", "since": "2026-11-28T12:00:00Z",
                                           "nextStepAt": "2026-11-29T12:00:00Z",
                                           "waiting": "backup: no report"}  # fmt: skip

    kube = FakeKube(cluster_obj(activeBroker="primary", epoch=1, brokers=pair()), rotate)
    code, out, err = run(kube, ["rotate-ca", "orders", "--wait"])
    assert (code, err) == (EXIT_OK, "")
    assert kube.patches[0]["spec"]["requests"]["rotateCa"]["id"].startswith("rotateCa-")
    assert "done: CA rotation Staged since 2026-11-28T12:00:00Z; next step at" in out
    assert "; waiting: backup: no report" in out  # why time alone does not move it


def test_wait_times_out_when_no_operator_handles_the_request() -> None:
    kube = FakeKube(cluster_obj(activeBroker="primary", epoch=1, brokers=pair()))
    code, _, err = run(kube, ["recover", "orders", "--wait", "--timeout", "5"])
    assert code == EXIT_TIMEOUT
    assert "timed out after 5s waiting for the operator" in err


class AuditingOperator:
    """A fake operator: starts a requested run, and ends it (PASS) three reads later."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, obj: Obj) -> None:
        request = obj.get("spec", {}).get("requests", {}).get("audit")
        status = obj["status"]
        if request and status.get("handledRequests", {}).get("audit") != request["id"]:
            status.setdefault("handledRequests", {})["audit"] = request["id"]
            status["lastAudit"] = {"verdict": "RUNNING", "run": "orders-audit-1"}
        elif status.get("lastAudit", {}).get("verdict") == "RUNNING":
            self.reads += 1
            if self.reads == 3:
                status["lastAudit"] = {"verdict": "PASS", "run": "orders-audit-1",
                                       "message": "300 messages audited"}  # fmt: skip


def test_audit_and_wait_waits_for_the_run_to_end_and_prints_the_verdict() -> None:
    operator = AuditingOperator()
    code, out, err = run(FakeKube(cluster_obj(), operator), ["audit", "orders", "--wait"])
    assert (code, err) == (EXIT_OK, "")
    assert operator.reads == 3
    assert "done: audit PASS (run orders-audit-1): 300 messages audited" in out


def test_promote_warns_about_an_unready_target_and_a_replaced_request() -> None:
    obj = cluster_obj(activeBroker="primary", epoch=1, brokers=pair(backup_ready=False))
    obj["spec"] = {"requests": {"promote": {"id": "old", "broker": "backup"}}}
    code, _, err = run(FakeKube(obj), ["promote", "orders", "backup"])
    assert code == EXIT_OK
    assert "backup is not ready" in err
    assert "replacing the promote request old" in err


def test_promote_warns_about_a_damaged_target_unless_forced() -> None:
    brokers = pair(backup_ready=False)
    brokers[1] |= {"damaged": True, "damage": "journal damaged since 2026-11-23T10:00:00Z"}
    obj = cluster_obj(activeBroker="primary", epoch=1, brokers=brokers)
    code, _, err = run(FakeKube(obj), ["promote", "orders", "backup"])
    assert code == EXIT_OK
    assert "backup's journal is damaged (journal damaged since 2026-11-23T10:00:00Z)" in err
    assert "--force" in err
    _, _, forced = run(FakeKube(obj), ["promote", "orders", "backup", "--force"])
    assert "damaged" not in forced


def test_promote_of_the_active_broker_changes_nothing() -> None:
    kube = FakeKube(cluster_obj(activeBroker="backup", epoch=2, brokers=pair("backup", 2)))
    code, out, _ = run(kube, ["promote", "orders", "backup"])
    assert code == EXIT_OK and "already active" in out and kube.patches == []


def test_an_unknown_cluster_is_named_with_those_that_exist() -> None:
    code, _, err = run(FakeKube(cluster_obj()), ["fence", "nope", "primary"])
    assert code == EXIT_ERROR
    assert 'error: brokerclusters.twinmq.io "nope" not found' in err
    assert "clusters there: orders" in err


def test_status_prints_the_table_or_json() -> None:
    kube = FakeKube(cluster_obj(phase="Ready", activeBroker="primary", brokers=pair()))
    code, out, _ = run(kube, ["status"])
    assert code == EXIT_OK and out.splitlines()[0].startswith("CLUSTER")
    code, out, _ = run(kube, ["status", "orders", "-o", "json"])
    assert json.loads(out)[0]["status"]["activeBroker"] == "primary"
    code, out, _ = run(FakeKube(None), ["status"])
    assert out == 'No BrokerClusters in namespace "prod".\n'


# -- mirror status ------------------------------------------------------------------------


def mirrored(**state: Any) -> Obj:
    """A source BrokerCluster whose active reported `state` (status.mirror)."""
    obj = cluster_obj(mirror=state) if state else cluster_obj()
    obj["spec"]["mirror"] = {"role": "source", "secretName": "dr",
                             "target": {"host": "orders.site-b.svc", "port": 5674}}  # fmt: skip
    return obj


def test_mirror_status_shows_role_link_backlog_and_lag() -> None:
    kube = FakeKube(mirrored(role="source", state="Connected", epoch=2, queueEvents=12,
                             lagSeconds=0.25, sourcesConnected=0))  # fmt: skip
    code, out, _ = run(kube, ["mirror", "status"])
    assert code == EXIT_OK
    header, row = out.splitlines()
    assert header.split() == list(kubectl.MIRROR_COLUMNS)
    assert row.split() == ["orders", "source", "Connected", "-", "2", "orders.site-b.svc:5674",
                           "12", "0.2s", "0", "-"]  # fmt: skip


def test_mirror_status_says_whether_the_link_runs_tls_and_why_not() -> None:
    over_tls = mirrored(role="source", state="Connected", tls=True)
    assert kubectl.mirror_rows([over_tls])[0][9] == "yes"
    plain = mirrored(role="source", state="Connected")
    plain["status"]["conditions"] = [{"type": "MirrorTls", "status": "False",
                                      "reason": "PeerCAUnknown", "message": "..."}]  # fmt: skip
    assert kubectl.mirror_rows([plain])[0][9] == "PeerCAUnknown"
    plain["status"]["conditions"][0].update(status="True", reason="PeerCACopied")
    assert kubectl.mirror_rows([plain])[0][9] == "pending"


def test_mirror_status_shows_both_directions_of_a_bidirectional_site() -> None:
    site = mirrored(role="bidirectional", state="Connected", inbound="Listening", epoch=0,
                    queueEvents=3, lagSeconds=0.1, sourcesConnected=0)  # fmt: skip
    site["spec"]["mirror"]["role"] = "bidirectional"
    (row,) = kubectl.mirror_rows([site])
    assert row[:4] == ("orders", "bidirectional", "Connected", "Listening")
    unseen = mirrored()
    unseen["spec"]["mirror"]["role"] = "bidirectional"
    (row,) = kubectl.mirror_rows([unseen])
    assert row[:4] == ("orders", "bidirectional", "Unknown", "Unknown")


def test_mirror_status_of_a_cluster_not_yet_seen_and_without_a_mirror() -> None:
    (row,) = kubectl.mirror_rows([mirrored()])
    assert row[:3] == ("orders", "source", "Unknown")
    assert kubectl.mirror_rows([cluster_obj()]) == []
    code, out, _ = run(FakeKube(cluster_obj()), ["mirror", "status"])
    assert code == EXIT_OK and out == 'No BrokerClusters with spec.mirror in namespace "prod".\n'


def test_mirror_status_as_json_carries_spec_and_status() -> None:
    dropped = mirrored(role="source", state="NeedsResync", message="past 10 events")
    code, out, _ = run(FakeKube(dropped), ["mirror", "status", "-o", "json"])
    assert code == EXIT_OK
    (doc,) = json.loads(out)
    assert doc["mirror"]["role"] == "source" and doc["status"]["state"] == "NeedsResync"


# -- federation status --------------------------------------------------------------------


def federated(**state: Any) -> Obj:
    """A downstream BrokerCluster federating `market` from `central`, whose active reported
    `state` (status.federation)."""
    obj = cluster_obj(federation=state) if state else cluster_obj()
    obj["spec"]["federation"] = {
        "upstreams": [{"name": "central", "clusterRef": {"name": "central"}}],
        "exchanges": [{"exchange": "market", "upstream": "central"}],
    }
    return obj


def test_federation_status_shows_each_link_with_bindings_and_counts() -> None:
    link = {"exchange": "market", "upstream": "central", "state": "Running", "bindings": 2,
            "localBindings": 10, "messagesReceived": 500, "forwarded": 42,
            "duplicatesDropped": 1, "loopsDropped": 0}  # fmt: skip
    upstream = cluster_obj("central", federation={"serverId": "eu", "links": []})
    upstream["spec"]["federation"] = {"serverId": "eu"}
    upstream["status"]["federation"].update(peerStatusReceived=7, peerStatusDropped=2)
    downstream = federated(serverId="prod.orders", links=[link])
    code, out, _ = run(FakeKube(downstream), ["federation", "status"])
    assert code == EXIT_OK, out
    header, row = out.splitlines()
    assert header.split() == list(kubectl.FEDERATION_COLUMNS)
    assert row.split() == ["orders", "prod.orders", "market", "central", "Running", "2/10",
                           "500", "42", "1", "0", "0/0"]  # fmt: skip
    (_, only) = kubectl.federation_rows([downstream, upstream])
    assert only == ("central", "eu", "-", "-", "-", "-", "-", "-", "-", "-", "7/2",
                    "upstream only")  # fmt: skip


def test_federation_status_of_a_cluster_not_yet_seen_a_refusal_and_json() -> None:
    (row,) = kubectl.federation_rows([federated()])
    assert row[:5] == ("orders", "prod.orders", "market", "central", "Unknown")
    assert kubectl.federation_rows([cluster_obj()]) == []
    refused = cluster_obj("central", federation={"refusedPeers": ["1.2.3.4:5: duplicate"]})
    refused["spec"]["federation"] = {}
    (row,) = kubectl.federation_rows([refused])
    assert row[-1] == "refused: 1.2.3.4:5: duplicate"
    clash = federated(serverId="prod.orders", duplicateOf="other/orders",
                      links=[{"exchange": "market", "upstream": "central", "state": "Refused",
                              "message": "duplicate server id"}])  # fmt: skip
    (row,) = kubectl.federation_rows([clash])
    assert row[-1] == "duplicate server id: also other/orders"
    code, out, _ = run(FakeKube(cluster_obj()), ["federation", "status"])
    assert out == 'No BrokerClusters with spec.federation in namespace "prod".\n'
    code, out, _ = run(FakeKube(federated(serverId="x")), ["federation", "status", "-o", "json"])
    assert code == EXIT_OK
    (doc,) = json.loads(out)
    assert doc["federation"]["exchanges"][0]["exchange"] == "market"
    assert doc["status"]["serverId"] == "x"


class Site(FakeKube):
    """One site's API for the switch commands: an operator that answers mirror requests
    (as operator/mirroring.py does: the handled id, the token, an Event)."""

    def __init__(self, obj: Obj, answer: tuple[str, str]) -> None:
        super().__init__(obj, self.handle)
        self.answer = answer
        self.posted: list[Obj] = []

    def handle(self, obj: Obj) -> None:
        requests = obj.get("spec", {}).get("requests", {})
        status = obj.setdefault("status", {})
        handled = status.setdefault("handledRequests", {})
        for field in ("mirrorDemote", "mirrorPromote", "mirrorReseed"):
            request = requests.get(field)
            if request and handled.get(field) != request["id"]:
                handled[field] = request["id"]
                if field == "mirrorDemote":
                    status.setdefault("mirror", {})["demotionToken"] = '{"seq": 7}'
                self.posted.append({"reason": self.answer[0], "message": self.answer[1]})

    def events(self, namespace: str, name: str) -> list[Obj]:
        return self.posted


def switch(source: Site, replica: Site, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    ticks = iter(range(10_000))
    code = kubectl.cmd_mirror_switch(
        source, replica, parse_args(argv), out, err,
        sleep=lambda _: None, clock=lambda: float(next(ticks)),
    )  # fmt: skip
    return code, out.getvalue(), err.getvalue()


def test_mirror_switchover_demotes_then_promotes_with_the_sources_token() -> None:
    source = Site(mirrored(), ("MirrorDemoted", "demoted to replica at DR epoch 1"))
    replica_obj = cluster_obj(name="orders-dr", namespace="site-b")
    replica = Site(replica_obj, ("MirrorPromoted", "promoted to source at DR epoch 1"))
    code, out, err = switch(source, replica, ["mirror", "switchover", "orders", "site-b/orders-dr"])
    assert (code, err) == (EXIT_OK, "")
    assert "demoted prod/orders" in out and "promoted site-b/orders-dr" in out
    (patch,) = replica.patches
    promote = patch["spec"]["requests"]["mirrorPromote"]
    assert promote["token"] == '{"seq": 7}' and promote["force"] is False


def test_mirror_switchover_stops_when_the_demotion_is_refused() -> None:
    source = Site(mirrored(), ("MirrorDemoteRefused", "this BrokerCluster has no spec.mirror"))
    replica = Site(cluster_obj(name="orders-dr"), ("MirrorPromoted", ""))
    code, _, err = switch(source, replica, ["mirror", "switchover", "orders", "orders-dr",
                                            "--timeout", "5"])  # fmt: skip
    assert code == EXIT_ERROR and not replica.patches
    assert "refused: demoting prod/orders: this BrokerCluster has no spec.mirror" in err


def test_mirror_failover_promotes_by_force_and_reports_the_rpo() -> None:
    rpo = "promoted to source at DR epoch 2, forced: 40 unacknowledged (may be lost)"
    replica = Site(cluster_obj(), ("MirrorPromoted", rpo))
    code, out, _ = switch(replica, replica, ["mirror", "failover", "orders"])
    assert code == EXIT_OK and "40 unacknowledged" in out
    (patch,) = replica.patches
    assert patch["spec"]["requests"]["mirrorPromote"]["force"] is True


def test_mirror_reseed_declares_the_request_on_the_source_and_reports_its_event() -> None:
    source = Site(mirrored(), ("MirrorReseeded", "a seed of 26 messages queued for the mirror"))
    code, out, _ = switch(source, source, ["mirror", "reseed", "orders"])
    assert code == EXIT_OK and "reseeded: a seed of 26 messages" in out
    (patch,) = source.patches
    assert patch["spec"]["requests"]["mirrorReseed"]["id"].startswith("mirror-reseed")


class FailbackSource(Site):
    """The source's API for `mirror failback`: an operator that walks a mirrorFailback
    request through its phases (one per get, as operator/mirroring.py does pass by pass)
    and finishes once the other site was promoted with its token."""

    PHASES = ("Reattaching", "Syncing", "Promoting")

    def __init__(self, obj: Obj, site: Site) -> None:
        super().__init__(obj, ("", ""))
        self.site = site
        self.step = 0

    def handle(self, obj: Obj) -> None:
        request = obj.get("spec", {}).get("requests", {}).get("mirrorFailback")
        if not request:
            return
        mirror = obj.setdefault("status", {}).setdefault("mirror", {})
        fb = {"id": request["id"], "message": "", "token": ""}
        promoted = self.site.obj and self.site.obj.get("status", {}).get(
            "handledRequests", {}).get("mirrorPromote")  # fmt: skip
        if promoted:
            fb["phase"], fb["token"] = "Done", '{"seq": 9}'
        else:
            fb["phase"] = self.PHASES[min(self.step, len(self.PHASES) - 1)]
            if fb["phase"] == "Promoting":
                fb["token"] = '{"seq": 9}'
            self.step += 1
        mirror["failback"] = fb


def test_mirror_failback_shows_each_phase_and_promotes_the_site_with_the_token() -> None:
    site = Site(cluster_obj(name="orders"), ("MirrorPromoted", "promoted to source at epoch 3"))
    target = {"host": "orders-dr.site-b.svc", "port": 5674}
    site.obj["spec"]["mirror"] = {"role": "source", "secretName": "dr", "target": target}
    source = FailbackSource(cluster_obj(name="orders-dr", namespace="site-b"), site)
    code, out, err = switch(site, source, ["mirror", "failback", "orders"])
    assert (code, err) == (EXIT_OK, "")
    (declared,) = source.patches  # found from the site's target: site-b/orders-dr
    assert declared["spec"]["requests"]["mirrorFailback"]["id"].startswith("mirror-failback")
    phases = [line.split(": ")[1] for line in out.splitlines() if line.startswith("site-b/")]
    assert phases == ["Reattaching", "Syncing", "Promoting", "Done"]
    (promote,) = site.patches
    assert promote["spec"]["requests"]["mirrorPromote"] == {
        "id": promote["spec"]["requests"]["mirrorPromote"]["id"], "token": '{"seq": 9}',
        "force": False,
    }  # fmt: skip
    assert "failed back to prod/orders in" in out


def test_mirror_failback_stops_when_the_source_refuses_and_promotes_nothing() -> None:
    site = Site(cluster_obj(name="orders"), ("MirrorPromoted", ""))

    class Refusing(Site):
        def handle(self, obj: Obj) -> None:
            request = obj.get("spec", {}).get("requests", {}).get("mirrorFailback")
            if request:
                obj.setdefault("status", {})["mirror"] = {"failback": {
                    "id": request["id"], "phase": "Refused",
                    "message": "this site is a DR replica: a failback is asked of the site "
                    "that is the source now"}}  # fmt: skip

    source = Refusing(cluster_obj(name="orders-dr"), ("", ""))
    code, _, err = switch(site, source, ["mirror", "failback", "orders", "orders-dr"])
    assert code == EXIT_ERROR and not site.patches
    assert "refused: failback from prod/orders-dr: this site is a DR replica" in err


def test_mirror_failback_needs_a_source_it_can_name() -> None:
    site = Site(cluster_obj(name="orders"), ("", ""))
    site.obj["spec"]["mirror"] = {"role": "source", "secretName": "dr",
                                  "target": {"host": "10.0.0.7"}}  # fmt: skip
    with pytest.raises(PluginError, match="name the source cluster"):
        switch(site, site, ["mirror", "failback", "orders"])
    assert not site.patches


def test_mirror_status_shows_a_failback_in_progress() -> None:
    kube = FakeKube(mirrored(role="source", state="Connected", epoch=2, queueEvents=40,
                             lagSeconds=3.0, sourcesConnected=0,
                             failback={"id": "f1", "phase": "Syncing",
                                       "message": "40 events to mirror"}))  # fmt: skip
    code, out, _ = run(kube, ["mirror", "status"])
    assert code == EXIT_OK
    assert out.splitlines()[1].endswith("failback Syncing: 40 events to mirror")


def test_mirror_status_shows_the_orphans_a_forced_failover_left_on_the_old_source() -> None:
    kube = FakeKube(mirrored(role="replica", state="Connected", epoch=2, queueEvents=0,
                             lagSeconds=0.0, sourcesConnected=1, orphans=5))  # fmt: skip
    code, out, _ = run(kube, ["mirror", "status"])
    assert code == EXIT_OK
    # Under the table (not in MESSAGE, which keeps the link's and a failback's words).
    assert out.splitlines()[1].endswith("-")
    assert out.splitlines()[2:] == [
        "",
        "orders: 5 orphaned messages kept in amq.twinmq.mirror-orphans",
    ]
