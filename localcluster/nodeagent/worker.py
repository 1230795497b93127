"""One pod on the process-backed node: sandbox, volumes, containers, probes, status, deletion."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from twinmq.localcluster.layout import GATEWAY_IP
from twinmq.localcluster.nodeagent import podstatus
from twinmq.localcluster.nodeagent.images import CommandError, CommandMap, ImageError, check_image
from twinmq.localcluster.nodeagent.podenv import container_env, expand
from twinmq.localcluster.nodeagent.probes import run_probe
from twinmq.localcluster.nodeagent.runtime import Exited, Running, Runtime, netns_name
from twinmq.localcluster.nodeagent.volumes import IssuedToken, TokenSource, VolumeBuilder

log = logging.getLogger("twinmq.nodeagent")

BASE_ENV = {
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "PYTHONUNBUFFERED": "1",
}


class Cluster(Protocol):
    """The API calls a pod worker needs (implemented by the agent on the kubernetes client)."""

    def secret(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a Secret's data; KeyError if it does not exist."""

    def config_map(self, namespace: str, name: str) -> dict[str, bytes]:
        """Return a ConfigMap's data; KeyError if it does not exist."""

    def token(self, source: TokenSource) -> IssuedToken:
        """Return a service account token for a projected volume (TokenRequest)."""

    def claim_path(self, namespace: str, claim: str) -> Path:
        """Return the folder of the PersistentVolume bound to a claim."""

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Patch the pod's status."""

    def finish_delete(self, namespace: str, name: str, uid: str) -> None:
        """Delete the pod object for good (grace 0, uid precondition)."""


@dataclass
class ProbeState:
    """Progress of one probe of one container."""

    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    passed: bool = False


@dataclass
class ContainerRecord:
    """What the worker remembers about one container between ticks."""

    name: str
    restarts: int = 0
    backoff_until: float = 0.0
    last: Exited | None = None
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    probes: dict[str, ProbeState] = field(default_factory=dict)
    run_started: float = 0.0


class PodWorker:
    """Runs one pod until it is deleted; one thread per pod."""

    def __init__(
        self,
        pod: dict[str, Any],
        runtime: Runtime,
        cluster: Cluster,
        commands: CommandMap,
        logs: Path,
        bin_path: str,
    ) -> None:
        self.pod = pod
        self.uid: str = pod["metadata"]["uid"]
        self.namespace: str = pod["metadata"]["namespace"]
        self.name: str = pod["metadata"]["name"]
        self.runtime = runtime
        self.cluster = cluster
        self.commands = commands
        self.logs = logs
        self.bin_path = bin_path
        self.gone = False
        self.records: dict[str, ContainerRecord] = {}
        self.init_done = False
        self.pod_ip = ""
        self.volumes: dict[str, Path] | None = None
        self.builder = self._builder()
        self.error: tuple[str, str] | None = None
        self.last_status: dict[str, Any] | None = None
        self.transitions: dict[str, tuple[str, float]] = {}
        self.started_at = time.time()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"pod-{self.name}", daemon=True)
        self._restore()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker's thread."""
        self.thread.start()

    def update(self, pod: dict[str, Any]) -> None:
        """Give the worker the pod's latest version."""
        with self.lock:
            self.pod = pod

    def deleted(self) -> None:
        """The pod object is gone from the API (force delete): kill everything now."""
        self.gone = True

    def _restore(self) -> None:
        pod_dir = self.runtime.pod_dir(self.uid)
        for c in self._all_containers():
            record = ContainerRecord(c["name"])
            path = self.runtime.container_dir(self.uid, c["name"]) / "restarts"
            if path.exists():
                record.restarts = int(path.read_text() or 0)
            self.records[c["name"]] = record
        marker = pod_dir / "initialized"
        self.init_done = marker.exists() or not self.pod["spec"].get("initContainers")
        if (pod_dir / "started-at").exists():
            self.started_at = float((pod_dir / "started-at").read_text())

    def _all_containers(self) -> list[dict[str, Any]]:
        spec = self.pod["spec"]
        return [*(spec.get("initContainers") or []), *spec["containers"]]

    def _loop(self) -> None:
        quiet_until = 0.0
        while not self.stop.is_set():
            try:
                if self.reconcile_once():
                    return
            except Exception as error:
                # e.g. the API server is down: keep the pod running, retry, log sparingly.
                self.last_status = None
                if time.monotonic() >= quiet_until:
                    log.warning("pod %s/%s: %s (retrying)", self.namespace, self.name, error)
                    quiet_until = time.monotonic() + 10
            self.stop.wait(0.25)

    # -- one pass ----------------------------------------------------------------------------

    def reconcile_once(self) -> bool:
        """Reconcile once; return True when the pod is finished with (deleted)."""
        with self.lock:
            pod = self.pod
        if self.gone:
            self.runtime.remove_sandbox(self.uid)
            return True
        if pod["metadata"].get("deletionTimestamp"):
            self._terminate(pod)
            return True
        if self.error is None or self.error[0] in ("ErrImagePull", "ImagePullBackOff"):
            try:
                for c in self._all_containers():
                    check_image(c.get("image", ""))
                self.error = None
            except ImageError as error:
                reason = "ErrImagePull" if self.error is None else "ImagePullBackOff"
                self.error = (reason, str(error))
                self._publish(pod)
                return False
        if not self.pod_ip:
            pod_dir = self.runtime.pod_dir(self.uid)
            pod_dir.mkdir(parents=True, exist_ok=True)
            if not (pod_dir / "started-at").exists():
                (pod_dir / "started-at").write_text(str(self.started_at))
            hostname = pod["spec"].get("hostname") or self.name
            self.pod_ip = self.runtime.ensure_sandbox(self.uid, self.namespace, self.name, hostname)
        if self.volumes is None:
            try:
                self.volumes = self.builder.build(pod)
                self.error = None
            except (KeyError, ValueError) as error:
                self.error = ("CreateContainerConfigError", f"volumes: {error}")
                self._publish(pod)
                self.stop.wait(2)
                return False
        # Projected service-account tokens expire: renew them as the kubelet does.
        self.builder.refresh_tokens(time.time())
        if not self.init_done:
            self._run_init(pod)
        if self.init_done:
            for c in pod["spec"]["containers"]:
                self._reconcile_container(pod, c)
        self._publish(pod)
        return False

    def _builder(self) -> VolumeBuilder:
        return VolumeBuilder(
            self.runtime.pod_dir(self.uid),
            secrets=self.cluster.secret,
            config_maps=self.cluster.config_map,
            token=self.cluster.token,
            claim_path=self.cluster.claim_path,
            host_ip=GATEWAY_IP,
        )

    def _run_init(self, pod: dict[str, Any]) -> None:
        policy = pod["spec"].get("restartPolicy", "Always")
        for c in pod["spec"].get("initContainers") or []:
            record = self.records[c["name"]]
            state = self.runtime.state(self.uid, c["name"])
            if isinstance(state, Exited) and state.code == 0:
                continue
            if isinstance(state, Running):
                return
            if isinstance(state, Exited):
                record.last = state
                if policy == "Never":
                    return
                if record.backoff_until == 0.0:
                    record.backoff_until = time.time() + podstatus.restart_delay(record.restarts)
                if time.time() < record.backoff_until:
                    record.waiting_reason = "CrashLoopBackOff"
                    return
                self._bump_restarts(record)
            self._start_container(pod, c, record)
            return
        self.init_done = True
        (self.runtime.pod_dir(self.uid) / "initialized").touch()

    def _bump_restarts(self, record: ContainerRecord) -> None:
        record.restarts += 1
        record.backoff_until = 0.0
        path = self.runtime.container_dir(self.uid, record.name) / "restarts"
        path.write_text(str(record.restarts))

    def _reconcile_container(self, pod: dict[str, Any], c: dict[str, Any]) -> None:
        record = self.records[c["name"]]
        state = self.runtime.state(self.uid, c["name"])
        policy = pod["spec"].get("restartPolicy", "Always")
        if state is None:
            self._start_container(pod, c, record)
            return
        if isinstance(state, Exited):
            if record.last is None or record.last.finished != state.finished:
                record.last = state
                record.probes.clear()
            if not podstatus.should_restart(policy, state.code):
                return
            if record.backoff_until == 0.0:
                ran_long = state.finished - state.started >= 2 * podstatus.BACKOFF_MAX
                delay = 0.0 if ran_long else podstatus.restart_delay(record.restarts)
                record.backoff_until = time.time() + delay
            if time.time() < record.backoff_until:
                record.waiting_reason = "CrashLoopBackOff"
                record.waiting_message = (
                    f"back-off restarting failed container {c['name']} in pod {self.name}"
                )
                return
            self._bump_restarts(record)
            self._start_container(pod, c, record)
            return
        if state.pid:
            self._probe(pod, c, record)

    def _start_container(
        self, pod: dict[str, Any], c: dict[str, Any], record: ContainerRecord
    ) -> None:
        try:
            env = container_env(
                pod,
                c,
                host_ip=GATEWAY_IP,
                secrets=lambda ns, n: _text(self.cluster.secret(ns, n)),
                config_maps=lambda ns, n: _text(self.cluster.config_map(ns, n)),
                base={**BASE_ENV, "PATH": self.bin_path},
            )
            command = [expand(x, env) for x in c.get("command") or []]
            args = [expand(x, env) for x in c.get("args") or []]
            argv = self.commands.resolve(command, args)
        except CommandError as error:
            record.waiting_reason = "RunContainerError"
            record.waiting_message = str(error)
            record.last = Exited(128, "StartError", str(error), time.time(), time.time())
            self.runtime.container_dir(self.uid, c["name"]).mkdir(parents=True, exist_ok=True)
            return
        except KeyError as error:
            record.waiting_reason = "CreateContainerConfigError"
            record.waiting_message = str(error)
            return
        assert self.volumes is not None
        mounts = []
        for mount in c.get("volumeMounts") or []:
            src = self.volumes.get(mount["name"])
            if src is None:
                continue
            if mount.get("subPath"):
                src = src / mount["subPath"]
            mode = ":ro" if mount.get("readOnly") else ""
            mounts.append(f"{src}:{mount['mountPath']}{mode}")
        self.runtime.reset(self.uid, c["name"])
        log_file = self.logs / f"{self.namespace}_{self.name}_{c['name']}.log"
        self.runtime.start(
            self.uid,
            c["name"],
            argv,
            env,
            cwd=c.get("workingDir") or "/",
            mounts=mounts,
            log=log_file,
            hostname=(pod["spec"].get("hostname") or self.name)[:63],
        )
        record.probes.clear()
        record.run_started = time.time()
        record.waiting_reason, record.waiting_message = "ContainerCreating", ""
        log.info("pod %s/%s: started %s: %s", self.namespace, self.name, c["name"], argv)

    # -- probes ------------------------------------------------------------------------------

    def _probe(self, pod: dict[str, Any], c: dict[str, Any], record: ContainerRecord) -> None:
        now = time.time()
        startup = c.get("startupProbe")
        kinds = ["startupProbe"]
        if not startup or record.probes.get("startupProbe", ProbeState()).passed:
            kinds = ["livenessProbe", "readinessProbe"]
        for kind in kinds:
            probe = c.get(kind)
            if not probe:
                continue
            state = record.probes.setdefault(
                kind, ProbeState(next_at=record.run_started + probe.get("initialDelaySeconds", 0))
            )
            if now < state.next_at:
                continue
            state.next_at = now + probe.get("periodSeconds", 10)
            ok = run_probe(probe, c, self.pod_ip, netns_name(self.uid))
            if ok:
                state.successes += 1
                state.failures = 0
                if state.successes >= probe.get("successThreshold", 1):
                    state.passed = True
            else:
                state.failures += 1
                state.successes = 0
                if state.failures >= probe.get("failureThreshold", 3):
                    state.passed = False
                    if kind != "readinessProbe":
                        log.info(
                            "pod %s/%s: %s %s failed; killing",
                            self.namespace,
                            self.name,
                            c["name"],
                            kind,
                        )
                        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
                        self.runtime.kill(self.uid, c["name"], float(grace))
                        return

    def _ready(
        self, c: dict[str, Any], record: ContainerRecord, running: bool
    ) -> tuple[bool, bool]:
        """Return (started, ready) of a running container."""
        if not running:
            return False, False
        started = (
            not c.get("startupProbe") or record.probes.get("startupProbe", ProbeState()).passed
        )
        if not started:
            return False, False
        if not c.get("readinessProbe"):
            return True, True
        return True, record.probes.get("readinessProbe", ProbeState()).passed

    # -- status ------------------------------------------------------------------------------

    def _container_status(
        self, c: dict[str, Any], policy: str
    ) -> tuple[dict[str, Any], podstatus.ContainerView, bool]:
        record = self.records[c["name"]]
        state = self.runtime.state(self.uid, c["name"]) if self.pod_ip else None
        image = c.get("image", "")
        status: dict[str, Any] = {
            "name": c["name"],
            "image": image,
            "imageID": f"twinmq-process://{image}",
            "restartCount": record.restarts,
        }
        is_running = isinstance(state, Running)
        started, ready = self._ready(c, record, is_running)
        status["ready"] = ready
        status["started"] = started
        if self.pod_ip:
            status["containerID"] = f"process://{self.uid}/{c['name']}/{record.restarts}"
        exit_code: int | None = None
        will_restart = False
        if self.error is not None:
            status["state"] = podstatus.waiting(*self.error)
        elif isinstance(state, Running):
            status["state"] = podstatus.running(state.started or time.time())
        elif isinstance(state, Exited):
            will_restart = podstatus.should_restart(policy, state.code)
            if will_restart and record.waiting_reason == "CrashLoopBackOff":
                status["state"] = podstatus.waiting("CrashLoopBackOff", record.waiting_message)
            elif will_restart:
                status["state"] = podstatus.running(time.time())
            else:
                exit_code = state.code
                status["state"] = podstatus.terminated(
                    state.code, state.reason, state.started, state.finished, state.message
                )
        else:
            will_restart = True
            status["state"] = podstatus.waiting(record.waiting_reason, record.waiting_message)
        last = record.last
        if last is not None and (record.restarts > 0 or not isinstance(state, Exited)):
            status["lastState"] = podstatus.terminated(
                last.code, last.reason, last.started, last.finished, last.message
            )
        else:
            status["lastState"] = {}
        view = podstatus.ContainerView(is_running, exit_code, will_restart)
        return status, view, ready

    def _publish(self, pod: dict[str, Any]) -> None:
        policy = pod["spec"].get("restartPolicy", "Always")
        statuses, views, readies = [], [], []
        for c in pod["spec"]["containers"]:
            s, v, r = self._container_status(c, policy)
            statuses.append(s)
            views.append(v)
            readies.append(r)
        init_statuses = [
            self._container_status(c, "Never")[0] for c in pod["spec"].get("initContainers") or []
        ]
        phase = podstatus.pod_phase(views, self.init_done and self.error is None)
        containers_ready = all(readies) and phase == "Running"
        gates_ok = all(
            any(
                cond.get("type") == gate["conditionType"] and cond.get("status") == "True"
                for cond in (pod.get("status") or {}).get("conditions") or []
            )
            for gate in pod["spec"].get("readinessGates") or []
        )
        conditions = {
            "PodReadyToStartContainers": bool(self.pod_ip),
            "Initialized": self.init_done,
            "ContainersReady": containers_ready,
            "Ready": containers_ready and gates_ok,
            "PodScheduled": True,
        }
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": GATEWAY_IP,
            "hostIPs": [{"ip": GATEWAY_IP}],
            "startTime": podstatus.rfc3339(self.started_at),
            "containerStatuses": statuses,
            "qosClass": (pod.get("status") or {}).get("qosClass", "BestEffort"),
            "conditions": [self._condition(t, v) for t, v in conditions.items()],
        }
        if init_statuses:
            status["initContainerStatuses"] = init_statuses
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        comparable = _strip_times(status)
        if comparable == self.last_status:
            return
        self.cluster.patch_status(self.namespace, self.name, status)
        self.last_status = comparable

    def _condition(self, kind: str, value: bool) -> dict[str, Any]:
        text = "True" if value else "False"
        previous = self.transitions.get(kind)
        if previous is None or previous[0] != text:
            self.transitions[kind] = (text, time.time())
        return {
            "type": kind,
            "status": text,
            "lastTransitionTime": podstatus.rfc3339(self.transitions[kind][1]),
        }

    # -- deletion ----------------------------------------------------------------------------

    def _terminate(self, pod: dict[str, Any]) -> None:
        grace = pod["metadata"].get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        names = [c["name"] for c in pod["spec"]["containers"]]
        threads = [
            threading.Thread(target=self.runtime.kill, args=(self.uid, n, float(grace)))
            for n in names
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.runtime.remove_sandbox(self.uid)
        self.cluster.finish_delete(self.namespace, self.name, self.uid)
        log.info("pod %s/%s: terminated and deleted", self.namespace, self.name)


def _text(data: Mapping[str, bytes]) -> dict[str, str]:
    return {k: v.decode(errors="replace") for k, v in data.items()}


def _strip_times(status: dict[str, Any]) -> dict[str, Any]:
    out = dict(status)
    out["containerStatuses"] = [
        {
            **s,
            "state": {
                k: {**v, "startedAt": None} if k == "running" else v for k, v in s["state"].items()
            },
        }
        for s in status["containerStatuses"]
    ]
    return out
