"""Names and numbers shared by the broker, the operator, the plugin, demos and tests.

Role names, the default ports and the `TWINMQ_*` environment variables are
defined here once and imported everywhere else, so a rename is one edit (and a
test, tests/test_names.py, ties each broker variable to a settings field).
"""

from __future__ import annotations

from typing import Final, Literal

Role = Literal["active", "passive"]
"""A broker's role, as `GET /status` reports it and `POST /role` sets it."""

ACTIVE: Final = "active"
PASSIVE: Final = "passive"

# Default ports (the broker's settings defaults, and the ports of a pod the operator builds).
AMQP_PORT: Final = 5672
AMQPS_PORT: Final = 5671
ADMIN_PORT: Final = 15672
REPLICATION_PORT: Final = 5673

ENV_PREFIX: Final = "TWINMQ_"
"""Every broker setting can be given as `TWINMQ_<FIELD>` (pydantic-settings' env_prefix)."""


def setting_env(field: str) -> str:
    """The environment variable of a broker setting (`admin_token` -> `TWINMQ_ADMIN_TOKEN`)."""
    return ENV_PREFIX + field.upper()


# The broker's variables that other components set (the operator's pods, demos, tests).
ADMIN_TOKEN_ENV: Final = setting_env("admin_token")
ADMIN_READ_TOKEN_ENV: Final = setting_env("admin_read_token")
REPLICATION_TOKEN_ENV: Final = setting_env("replication_token")
LEASE_NAME_ENV: Final = setting_env("lease_name")
LEASE_SECONDS_ENV: Final = setting_env("lease_seconds")
CONFIG_ENV: Final = ENV_PREFIX + "CONFIG"
"""The broker's JSON settings file (not a setting itself: `--config`)."""

# The operator's own variables.
OPERATOR_NAMESPACES_ENV: Final = ENV_PREFIX + "OPERATOR_NAMESPACES"
OPERATOR_METRICS_PORT_ENV: Final = ENV_PREFIX + "OPERATOR_METRICS_PORT"
