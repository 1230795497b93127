"""Broker settings: flags over environment over the settings file over defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinmq.broker import names
from twinmq.broker.settings import BrokerSettings, flag, parse_args

README = Path(__file__).resolve().parent.parent / "README.md"


def test_flags_override_environment_which_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "broker.json"
    config.write_text(json.dumps({"port": 7000, "name": "from-file", "heartbeat": 5}))
    monkeypatch.setenv(names.CONFIG_ENV, str(config))
    monkeypatch.setenv(names.setting_env("port"), "6000")
    settings = parse_args(["--heartbeat", "9"])
    assert (settings.port, settings.name, settings.heartbeat) == (6000, "from-file", 9)
    assert settings.fsync is True


def test_admin_token_from_environment_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(names.ADMIN_TOKEN_ENV, "s3cret")
    settings = parse_args([])
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


def test_every_shared_broker_variable_names_a_settings_field() -> None:
    for variable in (
        names.ADMIN_TOKEN_ENV, names.REPLICATION_TOKEN_ENV,
        names.LEASE_NAME_ENV, names.LEASE_SECONDS_ENV,
    ):  # fmt: skip
        assert variable.removeprefix(names.ENV_PREFIX).lower() in BrokerSettings.model_fields


def test_the_default_ports_and_role_are_the_shared_ones() -> None:
    defaults = BrokerSettings()
    assert (defaults.port, defaults.admin_port, defaults.replication_port) == (
        names.AMQP_PORT, names.ADMIN_PORT, names.REPLICATION_PORT,
    )  # fmt: skip
    assert defaults.role == names.ACTIVE


def test_invalid_values_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="port"):
        parse_args(["--port", "70000"])


def test_readme_documents_every_setting() -> None:
    text = README.read_text()
    for field in BrokerSettings.model_fields:
        assert f"`{flag(field)}" in text, f"README lacks {flag(field)}"
        assert f"`TWINMQ_{field.upper()}`" in text, f"README lacks TWINMQ_{field.upper()}"


def test_client_certificates_are_required_with_a_ca_unless_made_optional(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = ["--tls-cert", "c.pem", "--tls-key", "k.pem"]
    assert parse_args(files).effective_tls_client_certs == "none"
    with_ca = [*files, "--tls-ca", "ca.pem"]
    assert parse_args(with_ca).effective_tls_client_certs == "required"  # as before the option
    config = tmp_path / "broker.json"
    config.write_text(json.dumps({"tls_client_certs": "optional"}))
    monkeypatch.setenv(names.CONFIG_ENV, str(config))
    assert parse_args(with_ca).effective_tls_client_certs == "optional"
    # The environment is validated on its own (parse_args): the TLS files go with it.
    for field, value in (("tls_cert", "c.pem"), ("tls_key", "k.pem"), ("tls_ca", "ca.pem"),
                         ("tls_client_certs", "required")):  # fmt: skip
        monkeypatch.setenv(names.setting_env(field), value)
    assert parse_args([]).effective_tls_client_certs == "required"
    with pytest.raises(ValueError, match="tls_client_certs"):
        parse_args([*with_ca, "--tls-client-certs", "sometimes"])
