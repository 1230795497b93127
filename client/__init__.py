"""Client helpers for applications of a TwinMQ pair."""

from twinmq.client.publisher import ReliablePublisher

__all__ = ["ReliablePublisher"]
