"""Users and SASL logins (PLAIN, AMQPLAIN).

Passwords are stored as salted SHA-256 (`sha256:<salt hex>:<digest hex>`, the
same scheme RabbitMQ's definitions use) or, for development, in plain text.
As in RabbitMQ, `guest` may log in only over loopback.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path

from pamqp import decode
from pydantic import BaseModel, Field, model_validator

LOOPBACK_ONLY_USERS = frozenset({"guest"})


class LoginError(Exception):
    """A refused login; the text is what the client is told."""


class User(BaseModel):
    """One user of the users file."""

    name: str
    password: str | None = None
    password_hash: str | None = None

    @model_validator(mode="after")
    def _one_secret(self) -> User:
        if (self.password is None) == (self.password_hash is None):
            raise ValueError(f"user {self.name!r}: give exactly one of password, password_hash")
        if self.password_hash is not None and len(self.password_hash.split(":")) != 3:
            raise ValueError(f"user {self.name!r}: password_hash is not sha256:<salt>:<digest>")
        return self


class UsersFile(BaseModel):
    """The `--users-file` (JSON): `{"users": [{"name": ..., "password_hash": ...}]}`."""

    users: list[User] = Field(default_factory=list)


def hash_password(password: str, salt: bytes | None = None) -> str:
    """Hash a password for the users file."""
    salt = secrets.token_bytes(4) if salt is None else salt
    digest = hashlib.sha256(salt + password.encode()).hexdigest()
    return f"sha256:{salt.hex()}:{digest}"


def _check(user: User, password: str) -> bool:
    if user.password is not None:
        return hmac.compare_digest(user.password.encode(), password.encode())
    assert user.password_hash is not None
    _, salt_hex, digest = user.password_hash.split(":")
    expected = hash_password(password, bytes.fromhex(salt_hex)).split(":")[2]
    return hmac.compare_digest(expected, digest)


class Authenticator:
    """Checks SASL responses against the configured users."""

    def __init__(self, users: list[User]) -> None:
        self.users = {u.name: u for u in users}

    @classmethod
    def from_file(cls, path: Path | None) -> Authenticator:
        """Load users from a JSON users file; without one, only guest/guest (loopback)."""
        if path is None:
            return cls([User(name="guest", password="guest")])
        data = UsersFile.model_validate(json.loads(path.read_text()))
        return cls(data.users)

    def login(self, mechanism: str, response: str | bytes, loopback: bool) -> str:
        """Return the user name, or raise `LoginError` with the reason for the client."""
        raw = response.encode("utf-8") if isinstance(response, str) else bytes(response)
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
        user = self.users.get(username)
        if user is None or not _check(user, password):
            raise LoginError(
                f"Login was refused using authentication mechanism {mechanism}. "
                "For details see the broker logfile."
            )
        if username in LOOPBACK_ONLY_USERS and not loopback:
            raise LoginError(f"user '{username}' can only connect via localhost")
        return username
