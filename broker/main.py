"""`twinmq-broker`: run a broker until SIGTERM/SIGINT.

`twinmq-broker journal check|repair` are the journal tools (`journal_command.py`),
`twinmq-broker epoch show|set` the epoch's (`epochcli.py`), `twinmq-broker
hash-password` prints a users-file hash of a password read on stdin (`auth.py`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from twinmq.broker.federation.config import FederationConfigError
from twinmq.broker.settings import BrokerSettings, parse_args


async def serve(settings: BrokerSettings) -> int:
    """Start a broker and run it until a termination signal; return the exit status."""
    from twinmq.broker.server import Broker

    broker = Broker(settings)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A line on stdout that tests and scripts can wait for.
    print(
        f"twinmq-broker ready amqp={broker.amqp_port} admin={broker.admin_port} "
        f"replication={broker.replication_port}",
        flush=True,
    )
    signalled = asyncio.ensure_future(stop.wait())
    requested = asyncio.ensure_future(broker.exit_requested.wait())
    await asyncio.wait({signalled, requested}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    requested.cancel()
    if broker.exit_requested.is_set():
        logging.getLogger(__name__).error("stopping by itself (exit %d)", broker.exit_code)
    else:
        logging.getLogger(__name__).info("termination signal: shutting down")
    await broker.stop()
    return broker.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: a subcommand (`journal`, `epoch`, `hash-password`), or
    the broker."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["journal"]:
        from twinmq.broker.journal_command import main as journal_main

        sys.exit(journal_main(args[1:]))
    if args[:1] == ["hash-password"]:
        from twinmq.broker.auth import hash_password_main

        sys.exit(hash_password_main(args[1:]))
    if args[:1] == ["epoch"]:
        from twinmq.broker.epochcli import main as epoch_main

        sys.exit(epoch_main(args[1:]))
    settings = parse_args(args)
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [{settings.name}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        sys.exit(uvloop.run(serve(settings)))
    except FederationConfigError as exc:
        # A configuration error, not a crash: one line saying where and why.
        logging.getLogger(__name__).critical("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
