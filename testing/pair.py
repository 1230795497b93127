"""The broker-pair rig: two broker processes, active and passive, for the tests, the
benchmarks and the demo.

The passive replicates either through a `FaultProxy` the test controls (to cut, stall
or partition the link) or, with `link=False`, straight from the active (benchmarks, the
demo). Failover is the operator's procedure over the product's admin client.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from twinmq.broker.admin_client import AdminError, AdminUnreachable
from twinmq.broker.names import ACTIVE, PASSIVE, REPLICATION_TOKEN_ENV, Role, setting_env
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for


def status(broker: BrokerProcess, timeout: float = 2.0) -> dict[str, Any] | None:
    """`GET /status` as a dict (the shape is the admin client's `BrokerStatus`), or None
    when the broker does not answer (dead, stopped)."""
    try:
        return broker.admin.status(timeout=timeout).model_dump(mode="json")
    except AdminUnreachable:
        return None


def post_role(
    broker: BrokerProcess,
    role: Role,
    epoch: int,
    replicate_from: str | None = None,
    timeout: float = 10.0,
    *,
    force: bool = False,
) -> tuple[int, dict[str, Any]]:
    """`POST /role`: (HTTP status, the new status or the ErrorBody as a dict)."""
    try:
        done = broker.admin.set_role(role, epoch, replicate_from, force=force, timeout=timeout)
    except AdminError as exc:
        if exc.status is None:
            raise
        return exc.status, {} if exc.body is None else exc.body.model_dump()
    return 200, done.model_dump(mode="json")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# The ports `stable_port` handed out last. A pair picks all its ports before it starts
# any broker, so a pick's bind check cannot see the pair's own earlier picks: without
# this record two of them could be the same port (one pair in ~1,000; once a suite).
_RECENT_PORTS: deque[int] = deque(maxlen=4096)


def stable_port(rng: random.Random = random.Random()) -> int:  # noqa: B008 - one shared rng
    """A free loopback port outside the kernel's ephemeral range, and none of the last
    4,096 this process handed out.

    Brokers are killed and restarted on the same ports while clients reconnect
    all the time: a port from the ephemeral range may meanwhile be the source
    port of some client connection, and the restart would fail to bind.
    """
    low, high = _ephemeral_range()
    candidates = [(1024, low - 1)] if low > 11024 else [(high + 1, 65535)]
    lo, hi = candidates[0]
    for _ in range(200):
        port = rng.randint(max(lo, 10000), hi)
        if port in _RECENT_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _RECENT_PORTS.append(port)
        return port
    raise RuntimeError("no free port outside the ephemeral range")


FAKETIME_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1")


class NoSmallDisk(RuntimeError):
    """A small tmpfs per broker could not be mounted (not root, or no mount allowed)."""


class Pair:
    """Two brokers (`a` and `b` unless named): one active, one passive replicating through
    `link` (or straight from the active)."""

    TOKEN = "pair-replication-token"

    def __init__(
        self,
        root: Path,
        *,
        replication_timeout: float | None = 1.0,
        broker_args: list[str] | None = None,
        disk_bytes: int | None = None,
        faketime: bool = False,
        link: bool = True,
        names: tuple[str, str] = ("a", "b"),
    ) -> None:
        """`broker_args` go to every broker; `replication_timeout` None leaves the broker's
        default; `disk_bytes` gives each broker's data dir a tmpfs of that size (root only:
        `start` raises `NoSmallDisk` otherwise); `faketime` runs each broker under
        libfaketime so `jump_clock` can move its clock; without `link` the passive
        replicates straight from the active (no proxy: nothing to cut, nothing in between).
        The first of `names` starts active."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.replication_timeout = replication_timeout
        self.broker_args = list(broker_args or [])
        self.disk_bytes = disk_bytes
        self.faketime = faketime
        self.mounts: list[Path] = []
        self.clock_offsets = dict.fromkeys(names, 0.0)
        self.epoch = 1
        env = {REPLICATION_TOKEN_ENV: self.TOKEN}
        self.brokers = {
            name: BrokerProcess(
                root / name,
                name=name,
                env={**env, **(self._faketime_env(name) if faketime else {})},
                port=stable_port(),
                admin_port=stable_port(),
                replication_port=stable_port(),
            )
            for name in names
        }
        self.active_name, self.passive_name = names
        self._link = (
            FaultProxy(self.active.replication_address, port=stable_port()) if link else None
        )
        # Hardened as in Kubernetes (`--peer`): each broker replicates only from the
        # other, here through the link proxy, which stands in for the peer's address.
        first, second = self.brokers.values()
        for broker, other in ((first, second), (second, first)):
            address = other.replication_address if self._link is None else self._link.address
            broker.env[setting_env("peer")] = address
        self.events: list[str] = []
        self.started = time.monotonic()

    @property
    def link(self) -> FaultProxy:
        """The replication link the test controls (a pair made with `link=True`)."""
        assert self._link is not None, "this pair replicates without a link proxy"
        return self._link

    @property
    def active(self) -> BrokerProcess:
        """The broker serving clients."""
        return self.brokers[self.active_name]

    @property
    def passive(self) -> BrokerProcess:
        """The replica."""
        return self.brokers[self.passive_name]

    @property
    def amqp_addresses(self) -> list[str]:
        """Both brokers' AMQP addresses (clients find the active one)."""
        return [f"{b.host}:{b.port}" for b in self.brokers.values()]

    def note(self, text: str) -> None:
        """Record a nemesis event."""
        self.events.append(f"{time.monotonic() - self.started:8.2f}s {text}")

    def _faketime_env(self, name: str) -> dict[str, str]:
        """libfaketime reads the broker's offset from a file it re-reads every second."""
        offset_file = self.root / f"{name}.faketime"
        offset_file.write_text("+0\n")
        return {
            "LD_PRELOAD": str(FAKETIME_LIBRARY),
            "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_CACHE_DURATION": "1",
        }

    def jump_clock(self, broker: BrokerProcess, seconds: float) -> None:
        """Move `broker`'s clocks (wall and monotonic) by `seconds`, from now on."""
        self.clock_offsets[broker.name] += seconds
        path = self.root / f"{broker.name}.faketime"
        path.write_text(f"{self.clock_offsets[broker.name]:+.0f}\n")

    def _mount_disks(self) -> None:
        """A tmpfs of `disk_bytes` per broker data dir (so one broker's disk can fill)."""
        if self.disk_bytes is None:
            return
        for broker in self.brokers.values():
            broker.data_dir.mkdir(parents=True, exist_ok=True)
            result = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={self.disk_bytes}", "tmpfs",
                 str(broker.data_dir)],
                capture_output=True,
            )  # fmt: skip
            if result.returncode != 0:
                self._unmount_disks()
                raise NoSmallDisk(f"cannot mount a tmpfs: {result.stderr.decode().strip()}")
            self.mounts.append(broker.data_dir)

    def _unmount_disks(self) -> None:
        for mount in self.mounts:
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)
        self.mounts = []

    def args(self, role: str) -> list[str]:
        """Command-line flags for a broker of the pair in `role` at the current epoch."""
        args = ["--epoch", str(self.epoch)]
        if self.replication_timeout is not None:
            args += ["--replication-timeout", str(self.replication_timeout)]
        args += self.broker_args
        if role == PASSIVE:
            source = self.active.replication_address if self._link is None else self.link.address
            args += ["--role", PASSIVE, "--replicate-from", source]
        return args

    def start(self) -> Pair:
        """Start the proxy, the active, then the passive; wait until the passive is ready."""
        self._mount_disks()
        try:
            if self._link is not None:
                self._link.start()
            self.active.extra_args = self.args(ACTIVE)
            self.active.start()
            self.passive.extra_args = self.args(PASSIVE)
            self.passive.start()
            self.wait_healthy()
        except BaseException:
            self.stop()  # nothing left running by a pair that never started
            raise
        return self

    def stop(self) -> None:
        """Stop everything (SIGCONT first, in case a broker is paused)."""
        for broker in self.brokers.values():
            broker.signal(signal.SIGCONT)
            broker.stop()
        if self._link is not None:
            self._link.close()
        self._unmount_disks()

    def __enter__(self) -> Pair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self) -> bool:
        """The active has a passive in sync and the passive says it is ready."""
        active, passive = status(self.active), status(self.passive)
        return bool(
            active is not None
            and passive is not None
            and active["role"] == ACTIVE
            and passive["role"] == PASSIVE
            and active["replication"]["ready"]
            and passive["replication"]["ready"]
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until `healthy`; raise with both statuses if it does not happen."""
        try:
            wait_for("pair in sync", self.healthy, timeout, interval=0.1)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}\nactive {self.active_name}: {status(self.active)}\n"
                f"passive {self.passive_name}: {status(self.passive)}\n"
                + "\n".join(self.events[-10:])
            ) from None

    def failover(
        self, ready_timeout: float = 10.0, on_promoted: Callable[[], None] | None = None
    ) -> bool:
        """kill -9 the active; promote the passive if it is ready, else restart the active.

        The operator's procedure: only a passive whose status says `ready` is
        promoted (epoch+1) and the old active comes back as its passive; with
        no ready passive the old active is started again, active, same epoch.
        `on_promoted` runs right after the promotion, before the old active comes
        back (a virtual IP moving to the new active: clients must not reach the
        rejoining passive on the old address). Returns whether the passive was promoted.
        """
        old, new = self.active, self.passive
        old.kill()
        self.note(f"kill -9 active {old.name}")
        try:
            wait_for(
                f"passive {new.name} ready for promotion",
                lambda: (s := status(new)) is not None and s["replication"]["ready"],
                ready_timeout,
            )
        except TimeoutError:
            self.note(f"passive {new.name} not ready: restarting {old.name} as active")
            if self._link is not None:
                self._link.heal()
            old.extra_args = self.args(ACTIVE)
            old.start()
            return False
        self.promote_passive()
        if on_promoted is not None:
            on_promoted()
        self.rejoin(old)
        return True

    def rejoin(self, old: BrokerProcess) -> None:
        """Start the old active again (after `promote_passive`) as the new active's passive."""
        old.extra_args = self.args(PASSIVE)
        old.start()
        self.note(f"{old.name} restarted as passive of {self.active.name} (epoch {self.epoch})")

    def keep_logs(self, dest: Path, why: str) -> Path:
        """Copy both brokers' logs and the nemesis events to `dest` (pytest removes its
        temporary directories with the evidence of a failing run); returns `dest`."""
        dest.mkdir(parents=True, exist_ok=True)
        for broker in self.brokers.values():
            if broker.log_path is not None and broker.log_path.exists():
                shutil.copy2(broker.log_path, dest / broker.log_path.name)
        (dest / "events.txt").write_text(f"{why}\n\n" + "\n".join(self.events) + "\n")
        return dest

    def promote_passive(self) -> None:
        """`POST /role` active at epoch+1 on the passive; point the link at it."""
        new = self.passive
        self.epoch += 1
        code, body = post_role(new, ACTIVE, self.epoch)
        if code != 200 or body.get("role") != ACTIVE:
            raise AssertionError(f"promotion of {new.name} failed: {code} {body}")
        self.note(f"promoted {new.name} to active in epoch {self.epoch}")
        new.extra_args = self.args(ACTIVE)  # what it would restart with
        if self._link is not None:
            self._link.retarget(new.replication_address)
        self.active_name, self.passive_name = self.passive_name, self.active_name
