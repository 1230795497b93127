"""Users and SASL logins (PLAIN, AMQPLAIN, and EXTERNAL: a verified client certificate).

Passwords are stored hashed with scrypt (`scrypt:<n>:<r>:<p>:<salt hex>:<key hex>`,
a memory-hard KDF: ~16 MiB and tens of ms per guess), as `hash_password` and
`twinmq-broker hash-password` write them. Salted SHA-256 hashes
(`sha256:<salt hex>:<digest hex>`, RabbitMQ's definitions scheme, what TwinMQ
wrote before) are still accepted, with a warning at load: one GPU tries billions
of them a second. Plain-text passwords are for development.

Checking a scrypt hash is too slow for the event loop (a storm of wrong
passwords would stall every client): `Authenticator.login` hands it to a small
thread pool of its own and returns a `Login` to wait for. A password once
verified is remembered as an HMAC under a key of this process, so a client that
reconnects costs a hash, not a KDF. As in RabbitMQ, `guest` may log in only over
loopback. The file is read again when it changes (`reload_if_changed`, every few
seconds): users, passwords and
permissions (broker/permissions.py) change without a restart.

EXTERNAL (RabbitMQ's rabbitmq_auth_mechanism_ssl) is offered with `--tls-cert-login` on
an AMQPS connection whose client presented a certificate the listener verified: the user
is the name the certificate carries (`CertLogin`: its common name, its whole distinguished
name, or its first DNS or e-mail subject alternative name), who must be in the users file;
no password is checked, and permissions, vhosts and connection limits apply as for any
login. A user with neither `password` nor `password_hash` (RabbitMQ's user without a
password hash) logs in only this way. Only a login CA's certificate logs in: with
`--tls-federation-ca`, one a federation downstream's CA signed is refused (`login_scope`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from pamqp import decode
from pydantic import BaseModel, Field, field_validator, model_validator

from twinmq.broker.filewatch import FileWatch
from twinmq.broker.permissions import AccessControl, Permission
from twinmq.broker.tls import (
    CERT_LOGIN_SOURCES,
    CertLogin,
    broker_certificate,
    certificate_login_name,
)

log = logging.getLogger(__name__)

LOOPBACK_ONLY_USERS = frozenset({"guest"})
# scrypt's cost: N = 2^14, r = 8 (16 MiB), p = 1; OWASP's minimum for scrypt.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 14, 8, 1
SCRYPT_KEY_BYTES = 32
KDF_THREADS = 2  # logins verified at once; more wait (the handshake timeout bounds them)
PASSWORD_MECHANISMS = "PLAIN AMQPLAIN"
# The tag that lets a user's connections act as federation links (announce a server id).
FEDERATION_TAG = "federation"


class LoginError(Exception):
    """A refused login; the text is what the client is told."""


class User(BaseModel):
    """One user of the users file: with a password (or its hash), or neither (a user who
    logs in only with a client certificate, EXTERNAL)."""

    name: str
    password: str | None = None
    password_hash: str | None = None
    # RabbitMQ's user tags (a list, or its older comma-separated string); TwinMQ reads
    # `federation`: the user a downstream's federation link logs in as.
    tags: list[str] = Field(default_factory=list)

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_list(cls, value: object) -> object:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        return value

    @model_validator(mode="after")
    def _one_secret(self) -> User:
        if self.password is not None and self.password_hash is not None:
            raise ValueError(f"user {self.name!r}: give password or password_hash, not both")
        if self.password_hash is not None:
            _parse_hash(self.name, self.password_hash)
        return self


class VHost(BaseModel):
    """A vhost entry of the users file (RabbitMQ's definitions shape: `{"name": ...}`)."""

    name: str


class UsersFile(BaseModel):
    """The `--users-file` (JSON): `{"users": [{"name": ..., "password_hash": ...}]}`, and
    optionally RabbitMQ's `vhosts` (the vhosts served; `/` always is) and `permissions`
    (broker/permissions.py)."""

    users: list[User] = Field(default_factory=list)
    vhosts: list[VHost] = Field(default_factory=lambda: [VHost(name="/")])
    permissions: list[Permission] | None = None

    @model_validator(mode="after")
    def _known_names(self) -> UsersFile:
        served = self.served()
        for name in served:
            if not name or len(name.encode()) > 255:
                raise ValueError(f"vhost {name!r}: a name of 1 to 255 bytes (connection.open's)")
        names = {u.name for u in self.users}
        for p in self.permissions or []:
            if p.user not in names:
                raise ValueError(f"a permission for {p.user!r}, who is not among the users")
            if p.vhost not in served:
                raise ValueError(f"a permission of {p.user!r} for unknown vhost {p.vhost!r}")
        return self

    def served(self) -> frozenset[str]:
        """The vhosts this file declares, and `/` (always served)."""
        return frozenset({"/", *(v.name for v in self.vhosts)})

    @classmethod
    def read(cls, path: Path) -> UsersFile:
        """The file at `path` (OSError, or ValueError for JSON or a model that is wrong)."""
        return cls.model_validate(json.loads(path.read_text()))


def hash_password(password: str, salt: bytes | None = None) -> str:
    """Hash a password for the users file (scrypt)."""
    salt = secrets.token_bytes(16) if salt is None else salt
    key = _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P)
    return f"scrypt:{SCRYPT_N}:{SCRYPT_R}:{SCRYPT_P}:{salt.hex()}:{key.hex()}"


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=n, r=r, p=p, maxmem=256 * r * n, dklen=SCRYPT_KEY_BYTES
    )


def _parse_hash(name: str, value: str) -> list[str]:
    """The fields of a stored hash; a ValueError naming the user if it is not one."""
    fields = value.split(":")
    try:
        if fields[0] == "scrypt" and len(fields) == 6:
            n, r, p = (int(f) for f in fields[1:4])
            bytes.fromhex(fields[4]), bytes.fromhex(fields[5])
            if n > 1 and n & (n - 1) == 0 and 0 < r <= 64 and 0 < p <= 16 and n * r <= 1 << 24:
                return fields
        elif fields[0] == "sha256" and len(fields) == 3:
            bytes.fromhex(fields[1]), bytes.fromhex(fields[2])
            return fields
    except ValueError:
        pass
    raise ValueError(
        f"user {name!r}: password_hash is neither scrypt:<n>:<r>:<p>:<salt>:<key> (with sane "
        "costs) nor sha256:<salt>:<digest>"
    )


def _verify(user: User, password: str) -> bool:
    """Whether `password` is the user's (slow for a scrypt hash: off the event loop); a
    user without one (certificate login only) has none a client could give."""
    if user.password is not None:
        return hmac.compare_digest(user.password.encode(), password.encode())
    if user.password_hash is None:
        return False
    fields = _parse_hash(user.name, user.password_hash)
    if fields[0] == "sha256":
        salt, digest = bytes.fromhex(fields[1]), fields[2]
        return hmac.compare_digest(hashlib.sha256(salt + password.encode()).hexdigest(), digest)
    n, r, p = (int(f) for f in fields[1:4])
    key = _scrypt(password, bytes.fromhex(fields[4]), n, r, p)
    return hmac.compare_digest(key.hex(), fields[5])


def _slow(user: User) -> bool:
    return user.password_hash is not None and user.password_hash.startswith("scrypt:")


@dataclass(frozen=True, slots=True)
class Login:
    """A login whose password check runs in the authenticator's threads: `result` gives
    the user name or raises `LoginError`."""

    future: Future[bool]
    finish: Callable[[bool], str]

    def result(self) -> str:
        """The user name once the check is done (raises `LoginError` if refused)."""
        return self.finish(self.future.result())


class Authenticator:
    """Checks SASL responses against the configured users."""

    def __init__(
        self,
        users: list[User],
        permissions: list[Permission] | None = None,
        vhosts: frozenset[str] = frozenset({"/"}),
    ) -> None:
        self.path: Path | None = None
        self._watch: FileWatch | None = None
        self.generation = 0  # bumped by every reload: connections drop their cached checks
        self.vhosts = vhosts  # the vhosts the file declares (and `/`)
        self._set(users, permissions)
        self._key = secrets.token_bytes(32)  # for the remembered passwords; this process only
        self._pool: ThreadPoolExecutor | None = None
        self.cert_login: CertLogin = "off"  # `--tls-cert-login` (the broker sets it)
        # Why a verified certificate may not log in (its CA is trusted for TLS only:
        # `TlsListener.login_refusal`), or None; the broker sets it with AMQPS.
        self.login_scope: Callable[[x509.Certificate], str | None] | None = None

    def _set(self, users: list[User], permissions: list[Permission] | None) -> None:
        self.users = {u.name: u for u in users}
        # Without permissions every user of the file may do everything: only of the file.
        self.access = AccessControl(permissions, [u.name for u in users])
        self._verified: dict[str, bytes] = {}  # user -> HMAC of the password last verified
        for user in users:
            if user.password_hash is not None and user.password_hash.startswith("sha256:"):
                log.warning(
                    "user %r has a salted SHA-256 password hash: accepted, but cheap to "
                    "guess; replace it with `twinmq-broker hash-password` (scrypt)",
                    user.name,
                )

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        """Load users (and permissions) from a JSON users file; without one, only
        guest/guest (loopback)."""
        if path is None:
            # No file: a development broker (guest, loopback only), whose guest may link.
            return cls([User(name="guest", password="guest", tags=[FEDERATION_TAG])])
        watch = FileWatch(path)
        data = UsersFile.read(path)
        auth = cls(data.users, data.permissions, data.served())
        auth.path, auth._watch = path, watch
        return auth

    def reload_if_changed(self) -> bool:
        """Read the users file again if it changed; whether it did. A file that does not
        read (half-written, invalid) is logged and the old users stay."""
        if self.path is None or self._watch is None or not self._watch.changed():
            return False
        try:
            data = UsersFile.read(self.path)
        except (OSError, ValueError) as exc:
            log.error("users file %s changed but does not load (%s): keeping the old users",
                      self.path, exc)  # fmt: skip
            return False
        self._set(data.users, data.permissions)
        self.vhosts = data.served()
        self.generation += 1
        log.info("users file %s reloaded: %d users, %s", self.path, len(data.users),
                 "everyone may do everything" if data.permissions is None
                 else f"{len(data.permissions)} permissions")  # fmt: skip
        return True

    def link_refusal(self, user: str) -> str | None:
        """Why `user`'s connection may not act as a federation link (it announced a
        server id: its publishes keep their origin headers and are deduplicated on
        them), or None. Only a user tagged `federation` may: any other could stamp
        another site's next origin sequences and have that site's messages dropped as
        copies (tests/test_security_attacks.py)."""
        known = self.users.get(user)
        if known is not None and FEDERATION_TAG in known.tags:
            return None
        return (
            f"user '{user}' announced a federation server id but is not a federation "
            f"link's user: tag it '{FEDERATION_TAG}' in the users file"
        )

    def mechanisms(self, certificate: x509.Certificate | None) -> str:
        """connection.start's mechanisms for a connection whose client presented the
        verified `certificate` (None: plaintext, or TLS without one): EXTERNAL only with
        one and `--tls-cert-login` on, last, so a client that takes the first it knows
        still takes PLAIN."""
        if certificate is None or self.cert_login == "off":
            return PASSWORD_MECHANISMS
        return f"{PASSWORD_MECHANISMS} EXTERNAL"

    def login(
        self,
        mechanism: str,
        response: str | bytes,
        loopback: bool,
        certificate: x509.Certificate | None = None,
    ) -> str | Login:
        """The user name, a `Login` to wait for (a KDF to run), or `LoginError` with the
        reason for the client. `certificate`: the client's, verified by the TLS listener
        (None: plaintext, or none presented), for EXTERNAL."""
        raw = response.encode("utf-8") if isinstance(response, str) else bytes(response)
        if mechanism == "EXTERNAL":
            return self._external(raw, certificate)
        if mechanism == "PLAIN":
            parts = raw.split(b"\x00")
            if len(parts) != 3:
                raise LoginError("malformed PLAIN response")
            username, password = (
                parts[1].decode(errors="replace"),
                parts[2].decode(errors="replace"),
            )
        elif mechanism == "AMQPLAIN":
            try:
                # AMQPLAIN's response is a field table without its length prefix.
                _, table = decode.field_table(len(raw).to_bytes(4, "big") + raw)
            except ValueError as exc:
                raise LoginError("malformed AMQPLAIN response") from exc
            username, password = str(table.get("LOGIN", "")), str(table.get("PASSWORD", ""))
        else:
            raise LoginError(f"unsupported authentication mechanism {mechanism!r}")
        refused = LoginError(
            f"Login was refused using authentication mechanism {mechanism}. "
            "For details see the broker logfile."
        )
        user = self.users.get(username)
        if user is None:
            raise refused

        def admit() -> str:
            if username in LOOPBACK_ONLY_USERS and not loopback:
                raise LoginError(f"user '{username}' can only connect via localhost")
            return username

        mac = hmac.new(self._key, password.encode(), hashlib.sha256).digest()
        known = self._verified.get(username)
        if known is not None and hmac.compare_digest(known, mac):
            return admit()
        if not _slow(user):
            if not _verify(user, password):
                raise refused
            return admit()

        generation = self.generation

        def finish(ok: bool) -> str:
            if not ok:
                raise refused
            if self.generation == generation:  # not a password the file has since replaced
                self._verified[username] = mac
            return admit()

        if self._pool is None:
            self._pool = ThreadPoolExecutor(KDF_THREADS, thread_name_prefix="twinmq-kdf")
        return Login(self._pool.submit(_verify, user, password), finish)

    def _external(self, authzid: bytes, certificate: x509.Certificate | None) -> str:
        """The user a certificate login (EXTERNAL) is, or `LoginError` saying why not. The
        reasons are specific, unlike a wrong password's: the client holds a certificate our
        CA signed, and what it is told is only what that certificate says."""
        if certificate is None or self.cert_login == "off":
            raise LoginError(
                "EXTERNAL is not offered on this connection: it needs AMQPS, a client "
                "certificate the broker verified and --tls-cert-login"
            )
        if broker_certificate(certificate):
            # A broker's own certificate (the replication link's identity) is no user.
            raise LoginError(
                "certificate login refused: the certificate is for client and server use, a "
                "broker's own (a replication identity), not an application's"
            )
        scoped = self.login_scope(certificate) if self.login_scope is not None else None
        if scoped is not None:
            # A federation downstream's CA: its key is another tenant's, it names no one here.
            raise LoginError(scoped)
        name = certificate_login_name(certificate, self.cert_login)
        if name is None:
            raise LoginError(
                f"certificate login refused: the client certificate has no "
                f"{CERT_LOGIN_SOURCES[self.cert_login]} to take the user name from"
            )
        # SASL EXTERNAL's response is an authorization identity (RFC 4422): empty (act as
        # the certificate's user, what clients send) or that same name; never another user.
        if authzid and authzid.decode(errors="replace") != name:
            raise LoginError(
                f"certificate login refused: the certificate's user is '{name}', not the "
                f"'{authzid.decode(errors='replace')}' asked for"
            )
        if name in LOOPBACK_ONLY_USERS:
            raise LoginError(f"certificate login refused: '{name}' is a built-in user")
        if name not in self.users:
            raise LoginError(f"certificate login refused: no user '{name}' (the certificate's "
                             f"{CERT_LOGIN_SOURCES[self.cert_login]})")  # fmt: skip
        return name


def hash_password_main(argv: list[str]) -> int:
    """`twinmq-broker hash-password`: read a password on stdin, print its scrypt hash."""
    if argv:
        print("usage: twinmq-broker hash-password < password-file", file=sys.stderr)
        return 2
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        print("twinmq-broker hash-password: no password on stdin", file=sys.stderr)
        return 2
    print(hash_password(password))
    return 0
