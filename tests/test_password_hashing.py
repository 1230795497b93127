"""Users-file passwords: scrypt hashes, legacy SHA-256 still accepted, checks off the loop."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys

import pytest
from pydantic import ValidationError

from twinmq.broker.auth import Authenticator, Login, LoginError, User, hash_password
from twinmq.operator import builders


def plain(user: str, password: str) -> bytes:
    """A SASL PLAIN response."""
    return b"\x00" + user.encode() + b"\x00" + password.encode()


def login(auth: Authenticator, user: str, password: str) -> str | Login:
    return auth.login("PLAIN", plain(user, password), loopback=True)


def test_a_scrypt_hash_is_checked_in_the_authenticators_threads_and_then_remembered() -> None:
    stored = hash_password("s3cret")
    assert stored.startswith("scrypt:16384:8:1:")
    auth = Authenticator([User(name="app", password_hash=stored)])
    first = login(auth, "app", "s3cret")
    assert isinstance(first, Login), "a KDF ran on the caller's thread"
    assert first.result() == "app"
    # Verified once: the same password again is a cheap HMAC compare, no thread.
    assert login(auth, "app", "s3cret") == "app"
    wrong = login(auth, "app", "guess")
    assert isinstance(wrong, Login), "a wrong password is not cached: it pays the KDF"
    with pytest.raises(LoginError, match="Login was refused"):
        wrong.result()


def test_a_legacy_salted_sha256_hash_is_accepted_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    salt = bytes.fromhex("a1b2c3d4")
    legacy = f"sha256:{salt.hex()}:{hashlib.sha256(salt + b'old-pass').hexdigest()}"
    with caplog.at_level(logging.WARNING, logger="twinmq.broker.auth"):
        auth = Authenticator([User(name="old", password_hash=legacy)])
    assert "salted SHA-256" in caplog.text and "hash-password" in caplog.text
    assert login(auth, "old", "old-pass") == "old"
    with pytest.raises(LoginError):
        login(auth, "old", "nope")


@pytest.mark.parametrize(
    "bad",
    [
        "md5:00:00",
        "sha256:zz:00",
        "scrypt:16384:8:1:00",  # a field short
        "scrypt:1000:8:1:00:00",  # N not a power of two
        "scrypt:16777216:64:1:00:00",  # 16 GiB per guess: a users file that stalls a login
    ],
)
def test_a_malformed_or_absurdly_costly_hash_is_refused_when_the_users_file_loads(
    bad: str,
) -> None:
    with pytest.raises(ValidationError, match="password_hash is neither"):
        User(name="x", password_hash=bad)


def test_guest_is_refused_off_loopback_only_after_its_password_checks_out() -> None:
    auth = Authenticator([User(name="guest", password="guest")])
    with pytest.raises(LoginError, match="Login was refused"):
        auth.login("PLAIN", plain("guest", "wrong"), loopback=False)
    with pytest.raises(LoginError, match="only connect via localhost"):
        auth.login("PLAIN", plain("guest", "guest"), loopback=False)


def test_the_hash_password_command_prints_a_hash_the_broker_accepts() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "twinmq.broker.main", "hash-password"],
        input="correct horse\n", capture_output=True, text=True, check=True,
    )  # fmt: skip
    stored = done.stdout.strip()
    auth = Authenticator([User(name="app", password_hash=stored)])
    outcome = login(auth, "app", "correct horse")
    assert isinstance(outcome, Login) and outcome.result() == "app"
    assert "correct horse" not in done.stdout + done.stderr


def test_the_operator_upgrades_a_generated_secret_scrypt_hash_and_federation_user() -> None:

    salt = b"\x01\x02\x03\x04"
    legacy = f"sha256:{salt.hex()}:{hashlib.sha256(salt + b'pw').hexdigest()}"
    found = {
        "username": builders.APP_USER,
        "password": "pw",
        "users.json": json.dumps({"users": [{"name": builders.APP_USER, "password_hash": legacy}]}),
    }
    upgraded = builders.upgrade_credentials(found)
    entry, federation = json.loads(upgraded["users.json"])["users"]
    assert entry["password_hash"].startswith("scrypt:")
    outcome = login(Authenticator([User(**entry)]), builders.APP_USER, "pw")
    assert isinstance(outcome, Login) and outcome.result() == builders.APP_USER
    # The federation links' user, added to a Secret made before it existed: tagged, its
    # password beside the app user's.
    assert federation["name"] == builders.FEDERATION_USER, federation
    assert federation["tags"] == ["federation"], federation
    linked = Authenticator([User(**federation)])
    outcome = login(linked, builders.FEDERATION_USER, upgraded["federation-password"])
    assert isinstance(outcome, Login) and outcome.result() == builders.FEDERATION_USER
    assert linked.link_refusal(builders.FEDERATION_USER) is None
    assert builders.upgrade_credentials(upgraded) is upgraded, "re-hashed again"
