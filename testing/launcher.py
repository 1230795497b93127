"""Start a broker as a child process and wait until it serves (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from twinmq.broker.admin_client import SyncAdminClient
from twinmq.broker.names import ADMIN_TOKEN_ENV


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on `host` (loopback by default)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class BrokerProcess:
    """A `twinmq-broker` child process on loopback."""

    data_dir: Path
    name: str = "twinmq"
    host: str = "127.0.0.1"
    # 0: a free port is picked here, and picked again if another process takes it first.
    port: int = 0
    admin_port: int = 0
    replication_port: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    _admin: SyncAdminClient | None = field(default=None, repr=False)
    _picked: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        self._picked = tuple(
            f for f in ("port", "admin_port", "replication_port") if getattr(self, f) == 0
        )
        self._pick_ports()

    def _pick_ports(self) -> None:
        for f in self._picked:
            setattr(self, f, free_port(self.host))

    def start(self, timeout: float = 30.0) -> BrokerProcess:
        """Start the broker and wait for its ready line; raise with its log if it dies.

        A free port is only free until someone binds it: when the broker cannot bind a
        port (another process took it in between), it starts again, up to three times,
        with new ports where this launcher picked them (a port in `extra_args` is tried
        again: its holder may be a passing outgoing connection).
        """
        log_path = self.log_path or self.data_dir.parent / f"{self.name}.log"
        for attempt in range(3):
            offset = log_path.stat().st_size if log_path.exists() else 0
            try:
                return self._start_once(timeout)
            except RuntimeError:
                lost_race = b"address already in use" in log_path.read_bytes()[offset:].lower()
                if not lost_race or attempt == 2:
                    raise
                self._pick_ports()
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> BrokerProcess:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.data_dir.parent / f"{self.name}.log"
        self.log_path = log_path
        args = [
            sys.executable, "-m", "twinmq.broker.main",
            "--name", self.name, "--host", self.host,
            "--port", str(self.port), "--admin-port", str(self.admin_port),
            "--replication-port", str(self.replication_port),
            "--data-dir", str(self.data_dir), *self.extra_args,
        ]  # fmt: skip
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=log, env={**os.environ, **self.env}
        )
        log.close()
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = b""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"broker {self.name} exited with {self.proc.returncode}:\n"
                    + log_path.read_text()[-4000:]
                )
            chunk = self.proc.stdout.read()
            if chunk:
                buf += chunk
                if b"twinmq-broker ready" in buf:
                    return self
            time.sleep(0.02)
        self.kill()
        raise TimeoutError(f"broker {self.name} not ready in {timeout}s:\n" + log_path.read_text())

    @property
    def url(self) -> str:
        """AMQP URL for guest on loopback."""
        return f"amqp://guest:guest@{self.host}:{self.port}/%2F"

    @property
    def replication_address(self) -> str:
        """host:port of the replication listener (what a passive's --replicate-from names)."""
        return f"{self.host}:{self.replication_port}"

    @property
    def admin_url(self) -> str:
        """Base URL of the admin API."""
        return f"http://{self.host}:{self.admin_port}"

    @property
    def admin(self) -> SyncAdminClient:
        """The client of this broker's admin API (with its `TWINMQ_ADMIN_TOKEN`, if set;
        loopback needs none). One pooled client per process object, closed by stop/kill."""
        if self._admin is None:
            self._admin = SyncAdminClient(self.admin_url, self.env.get(ADMIN_TOKEN_ENV))
        return self._admin

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def signal(self, sig: int) -> None:
        """Send a signal (SIGKILL, SIGSTOP, SIGCONT, ...)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """kill -9 and reap."""
        self._close_admin()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait for a clean exit (kill -9 after `timeout`); returns the exit code."""
        self._close_admin()
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def __enter__(self) -> BrokerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
