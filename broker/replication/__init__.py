"""The replication engine: a passive broker mirrors the active one, synchronously.

The design follows Qpid HA: replication IDs assigned before enqueue, the
active's topology mirrored, per-queue message and dequeue events by ID, a
catch-up handshake on every (re)connect, delayed completion (a confirm waits
for the passive's disk too), and epochs that fence split brain.
"""
