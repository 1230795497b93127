"""Broker settings: flags over environment over the settings file over defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinmq.broker.settings import BrokerSettings, flag, parse_args

README = Path(__file__).resolve().parent.parent / "README.md"


def test_flags_override_environment_which_overrides_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "broker.json"
    config.write_text(json.dumps({"port": 7000, "name": "from-file", "heartbeat": 5}))
    monkeypatch.setenv("TWINMQ_CONFIG", str(config))
    monkeypatch.setenv("TWINMQ_PORT", "6000")
    settings = parse_args(["--heartbeat", "9"])
    assert (settings.port, settings.name, settings.heartbeat) == (6000, "from-file", 9)
    assert settings.fsync is True


def test_admin_token_from_environment_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TWINMQ_ADMIN_TOKEN", "s3cret")
    settings = parse_args([])
    assert settings.admin_token is not None
    assert settings.admin_token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(settings)


def test_invalid_values_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="port"):
        parse_args(["--port", "70000"])


def test_readme_documents_every_setting() -> None:
    text = README.read_text()
    for field in BrokerSettings.model_fields:
        assert f"`{flag(field)}" in text, f"README lacks {flag(field)}"
        assert f"`TWINMQ_{field.upper()}`" in text, f"README lacks TWINMQ_{field.upper()}"
