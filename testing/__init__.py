"""Test rigs written once, for the tests, e2e, the benchmarks and the demo.

- `launcher`: `BrokerProcess`, one `twinmq-broker` child process on loopback (its admin
  API through the product's client, `twinmq.broker.admin_client`: there is no other).
- `pair`: `Pair`, an active/passive pair of them, replicating through a `FaultProxy`
  (`faultproxy`) or straight; failover as the operator does it.
- `waiting`: `wait_for` (and `until` inside an event loop), the one poll loop.
- `rawamqp`: AMQP frames built and read with pamqp, and `RawClient`, a blocking socket
  that sends exactly the bytes a test means (bad input included).
- `amqpclient`: `AMQPClient`, a small asyncio client whose every wait has a deadline
  (the fault suite's producers and consumers).

Installed only in development environments, by the dev distribution
(`dev/pyproject.toml`, `make venv`); never in the product wheel or the image
(tests/test_wheel_contents.py).
"""
