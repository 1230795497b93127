"""Columnar schemas of shipped audit segments, derived from `AuditRecord` in one place.

A shipped segment (Parquet) holds the record's fields, in the model's order
and with the model's types, followed by two provenance columns the shipper
adds: `segment_seq` (the segment's sequence number on its broker) and `line`
(0-based line in the segment). Together they give a record's position in its
broker's log, the order in which that broker stored messages.

`columns()` is the only place where Python types become column types; the
Arrow schema (shipper) and the Spark schema (job) are both built from it, so
neither is ever written out by hand.
"""

from __future__ import annotations

import enum
import types
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from twinmq.audit.records import AuditRecord

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql.types import StructType

ColumnType = Literal["string", "int64", "float64"]

PROVENANCE: tuple[tuple[str, ColumnType], ...] = (("segment_seq", "int64"), ("line", "int64"))
"""Columns the shipper adds after the record's fields."""


@dataclass(frozen=True)
class Column:
    """One column of a shipped segment."""

    name: str
    type: ColumnType
    nullable: bool


def _column_type(annotation: Any) -> tuple[ColumnType, bool]:
    """Column type and nullability of a model field's annotation."""
    nullable = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(args) < len(typing.get_args(annotation))
        if len(args) != 1:
            raise TypeError(f"unsupported union in the audit record: {annotation!r}")
        annotation = args[0]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum | str):
        return "string", nullable
    if annotation is bool:
        raise TypeError("booleans are not used in audit records")
    if annotation is int:
        return "int64", nullable
    if annotation is float:
        return "float64", nullable
    raise TypeError(f"unsupported type in the audit record: {annotation!r}")


def columns() -> tuple[Column, ...]:
    """Every column of a shipped segment: `AuditRecord`'s fields, then provenance."""
    fields = []
    for name, info in AuditRecord.model_fields.items():
        kind, nullable = _column_type(info.annotation)
        fields.append(Column(name, kind, nullable))
    fields += [Column(name, kind, False) for name, kind in PROVENANCE]
    return tuple(fields)


def arrow_schema() -> pa.Schema:
    """The Arrow schema of a shipped segment."""
    import pyarrow as pa

    types_ = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64()}
    return pa.schema([pa.field(c.name, types_[c.type], c.nullable) for c in columns()])


def record_arrow_schema() -> pa.Schema:
    """The Arrow schema of the JSON lines a broker writes (no provenance columns)."""
    schema = arrow_schema()
    for name, _ in PROVENANCE:
        schema = schema.remove(schema.get_field_index(name))
    return schema


def spark_schema() -> StructType:
    """The Spark schema of a shipped segment."""
    from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

    types_ = {"string": StringType(), "int64": LongType(), "float64": DoubleType()}
    return StructType([StructField(c.name, types_[c.type], c.nullable) for c in columns()])
