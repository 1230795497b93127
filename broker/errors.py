"""AMQP reply codes and the exceptions that carry them out of the protocol core."""

from __future__ import annotations

from enum import IntEnum


class ReplyCode(IntEnum):
    """AMQP 0-9-1 reply codes (as RabbitMQ sends them)."""

    REPLY_SUCCESS = 200
    CONTENT_TOO_LARGE = 311
    NO_ROUTE = 312
    NO_CONSUMERS = 313
    CONNECTION_FORCED = 320
    INVALID_PATH = 402
    ACCESS_REFUSED = 403
    NOT_FOUND = 404
    RESOURCE_LOCKED = 405
    PRECONDITION_FAILED = 406
    FRAME_ERROR = 501
    SYNTAX_ERROR = 502
    COMMAND_INVALID = 503
    CHANNEL_ERROR = 504
    UNEXPECTED_FRAME = 505
    RESOURCE_ERROR = 506
    NOT_ALLOWED = 530
    NOT_IMPLEMENTED = 540
    INTERNAL_ERROR = 541


# Codes that close the whole connection rather than one channel (AMQP 0-9-1 spec, 1.6).
CONNECTION_CODES = frozenset(
    {
        ReplyCode.CONNECTION_FORCED,
        ReplyCode.INVALID_PATH,
        ReplyCode.FRAME_ERROR,
        ReplyCode.SYNTAX_ERROR,
        ReplyCode.COMMAND_INVALID,
        ReplyCode.CHANNEL_ERROR,
        ReplyCode.UNEXPECTED_FRAME,
        ReplyCode.RESOURCE_ERROR,
        ReplyCode.NOT_ALLOWED,
        ReplyCode.NOT_IMPLEMENTED,
        ReplyCode.INTERNAL_ERROR,
    }
)


class AMQPError(Exception):
    """A protocol error: closes the channel, or the connection for connection-level codes.

    `class_id`/`method_id` name the method that failed, as `channel.close` and
    `connection.close` report it.
    """

    def __init__(
        self,
        code: ReplyCode,
        text: str,
        class_id: int = 0,
        method_id: int = 0,
        *,
        connection: bool | None = None,
    ) -> None:
        super().__init__(f"{code.name} - {text}")
        self.code = code
        self.text = text
        self.class_id = class_id
        self.method_id = method_id
        self.connection_level = code in CONNECTION_CODES if connection is None else connection

    @property
    def reply_text(self) -> str:
        """The reply text sent to the client, in RabbitMQ's `CODE - text` form (max 255 bytes)."""
        return f"{self.code.name} - {self.text}"[:255]


def channel_error(code: ReplyCode, text: str, method: tuple[int, int] = (0, 0)) -> AMQPError:
    """A channel-level error for the method `method` = (class id, method id)."""
    return AMQPError(code, text, method[0], method[1], connection=False)


class StaleEpoch(Exception):
    """A role change carried an epoch older than one this broker has seen."""


class DamagedBroker(Exception):
    """A broker whose journal was corrupt was asked to become active without force."""


class MirrorRefused(Exception):
    """A DR switch that cannot happen (wrong role, stale or unmet token): 409."""


class VhostRefused(Exception):
    """A vhost deletion that must not happen (`/`, a vhost still served, a passive): 409."""


class VhostNotFound(Exception):
    """A vhost deletion of a vhost the broker does not have: 404."""


class MirrorNotDrained(Exception):
    """A demotion whose replication queue did not drain in time: 503, call again."""
