"""The pod worker's decisions, driven one reconcile at a time with a fake runtime and API."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from twinmq.localcluster.layout import Layout
from twinmq.localcluster.nodeagent.images import CommandMap
from twinmq.localcluster.nodeagent.runtime import ContainerState, Exited, Running, Runtime
from twinmq.localcluster.nodeagent.volumes import IssuedToken, TokenSource
from twinmq.localcluster.nodeagent.worker import PodWorker


class FakeRuntime(Runtime):
    """Processes as data: `start` makes a container Running, tests make it exit."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self.states: dict[str, ContainerState] = {}
        self.started: list[tuple[str, list[str]]] = []
        self.killed: list[tuple[str, float]] = []
        self.removed: list[str] = []

    def ensure_sandbox(self, uid: str, namespace: str, name: str, hostname: str) -> str:
        self.pod_dir(uid).mkdir(parents=True, exist_ok=True)
        return "10.244.0.9"

    def start(self, uid: str, name: str, argv: Any, env: Any, **_: Any) -> None:
        self.container_dir(uid, name).mkdir(parents=True, exist_ok=True)
        self.started.append((name, list(argv)))
        self.states[name] = Running(pid=4242, started=time.time())

    def state(self, uid: str, name: str) -> ContainerState:
        return self.states.get(name)

    def kill(self, uid: str, name: str, grace: float) -> None:
        self.killed.append((name, grace))
        self.states[name] = Exited(143, "Error", "", time.time(), time.time())

    def remove_sandbox(self, uid: str) -> None:
        self.removed.append(uid)


class FakeApi:
    """The worker's view of the API: records status patches and final deletes."""

    def __init__(self) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    def secret(self, namespace: str, name: str) -> dict[str, bytes]:
        return {"token": b"s3cret"}

    def config_map(self, namespace: str, name: str) -> dict[str, bytes]:
        raise KeyError(name)

    def token(self, source: TokenSource) -> IssuedToken:
        return IssuedToken("token", time.time() + source.expiration_seconds,
                           source.expiration_seconds)  # fmt: skip

    def claim_path(self, namespace: str, claim: str) -> Path:
        raise KeyError(claim)

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.statuses.append(status)

    def finish_delete(self, namespace: str, name: str, uid: str) -> None:
        self.deleted.append(uid)

    @property
    def last(self) -> dict[str, Any]:
        return self.statuses[-1]


def _pod(image: str = "twinmq/twinmq:dev", policy: str = "Always") -> dict[str, Any]:
    return {
        "metadata": {"name": "b-0", "namespace": "ns", "uid": "uid-1"},
        "spec": {
            "restartPolicy": policy,
            "terminationGracePeriodSeconds": 7,
            "containers": [
                {
                    "name": "broker",
                    "image": image,
                    "command": ["twinmq-broker"],
                    "args": ["--name=$(NAME)"],
                    "env": [
                        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
                    ],
                }
            ],
        },
        "status": {},
    }


@pytest.fixture
def parts(tmp_path: Path) -> tuple[FakeRuntime, FakeApi]:
    return FakeRuntime(Layout(tmp_path)), FakeApi()


def _worker(parts: tuple[FakeRuntime, FakeApi], pod: dict[str, Any]) -> PodWorker:
    runtime, api = parts
    commands = CommandMap(Path("/venv/bin"), exists=lambda p: True)
    return PodWorker(pod, runtime, api, commands, runtime.layout.logs, "/venv/bin")


def _state(status: dict[str, Any]) -> dict[str, Any]:
    return dict(status["containerStatuses"][0]["state"])


def test_runs_the_console_script_with_expanded_args_and_reports_running(
    parts: tuple[FakeRuntime, FakeApi],
) -> None:
    runtime, api = parts
    worker = _worker(parts, _pod())
    assert not worker.reconcile_once()
    assert runtime.started == [("broker", ["/venv/bin/twinmq-broker", "--name=b-0"])]
    assert api.last["phase"] == "Running"
    assert api.last["podIP"] == "10.244.0.9"
    assert "running" in _state(api.last)
    assert api.last["containerStatuses"][0]["ready"] is True  # no readiness probe


def test_foreign_image_waits_with_a_pull_error_and_never_starts(
    parts: tuple[FakeRuntime, FakeApi],
) -> None:
    runtime, api = parts
    worker = _worker(parts, _pod(image="nginx:1.25"))
    worker.reconcile_once()
    assert _state(api.last)["waiting"]["reason"] == "ErrImagePull"
    worker.reconcile_once()
    assert _state(api.last)["waiting"]["reason"] == "ImagePullBackOff"
    assert api.last["phase"] == "Pending"
    assert runtime.started == []


def test_a_crash_restarts_at_once_then_backs_off(parts: tuple[FakeRuntime, FakeApi]) -> None:
    runtime, api = parts
    worker = _worker(parts, _pod())
    worker.reconcile_once()
    runtime.states["broker"] = Exited(137, "Error", "", time.time(), time.time() - 1)
    worker.reconcile_once()
    assert len(runtime.started) == 2  # first restart: immediate
    assert api.last["containerStatuses"][0]["restartCount"] == 1
    assert api.last["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 137
    runtime.states["broker"] = Exited(137, "Error", "", time.time(), time.time() - 1)
    worker.reconcile_once()
    assert len(runtime.started) == 2  # second: 10 s back-off
    assert _state(api.last)["waiting"]["reason"] == "CrashLoopBackOff"


def test_never_policy_ends_in_succeeded_or_failed(parts: tuple[FakeRuntime, FakeApi]) -> None:
    runtime, api = parts
    worker = _worker(parts, _pod(policy="Never"))
    worker.reconcile_once()
    runtime.states["broker"] = Exited(0, "Completed", "", time.time(), time.time() - 1)
    worker.reconcile_once()
    assert api.last["phase"] == "Succeeded"
    assert len(runtime.started) == 1


def test_deletion_kills_with_the_grace_period_then_deletes_the_pod(
    parts: tuple[FakeRuntime, FakeApi],
) -> None:
    runtime, api = parts
    pod = _pod()
    worker = _worker(parts, pod)
    worker.reconcile_once()
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "now",
                                    "deletionGracePeriodSeconds": 3}}  # fmt: skip
    worker.update(deleting)
    assert worker.reconcile_once()  # finished with
    assert runtime.killed == [("broker", 3.0)]
    assert runtime.removed == ["uid-1"]
    assert api.deleted == ["uid-1"]
