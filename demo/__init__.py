"""`make demo`: the story on loopback (`loopback`) and on the local cluster (`kubernetes`).

A development tool (it runs brokers from `twinmq.testing` and the local cluster): installed
by the dev distribution (`dev/pyproject.toml`), not by the product wheel.
"""
