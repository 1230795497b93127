"""The disaster-recovery mirror: asynchronous replication of one broker pair to another.

By concern: `events` (what is mirrored and its bytes), `source` (the durable
replication queue, filled in the same group commit as the change), `link` (the
source's connection to the mirror), `applier` (idempotent apply on the mirror),
`listener` (the mirror's end of the link), `metrics`. Design: docs/mirror.md.
"""
