"""Durable topology: the shapes of exchanges, queues and bindings as they are stored.

These models are the one definition of the broker's topology used by the journal's
definitions file, the admin API and (later) configuration replication.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ExchangeType = Literal["direct", "fanout", "topic", "headers"]


class ExchangeDef(BaseModel):
    """A declared exchange."""

    model_config = ConfigDict(frozen=True)

    name: str
    type: ExchangeType
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = Field(default_factory=dict)


class QueueDef(BaseModel):
    """A declared queue.

    `qid` is the queue's incarnation: a queue deleted and declared again under the
    same name gets a new `qid`, so journal records of the old one never resurrect.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    qid: int
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = Field(default_factory=dict)


class BindingDef(BaseModel):
    """A binding from an exchange to a queue (exchange-to-exchange bindings are not supported)."""

    model_config = ConfigDict(frozen=True)

    exchange: str
    queue: str
    routing_key: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Definitions(BaseModel):
    """Everything durable except messages: what the definitions file holds."""

    exchanges: list[ExchangeDef] = Field(default_factory=list)
    queues: list[QueueDef] = Field(default_factory=list)
    bindings: list[BindingDef] = Field(default_factory=list)
    next_qid: int = 1
