"""`twinmq-broker epoch show|set <data-dir>`: read or repair a stopped broker's epoch.

The recovery for an epoch that is wrong anyway (docs/replication.md): a
broker that persisted an absurd epoch refuses every role change with 409 and
every peer of a lower epoch. Setting it is safe only while the broker is
stopped and only to the epoch its pair really is in; `set` to a lower value
than the stored one needs `--force`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twinmq.broker.epoch import EpochStore

EPOCH_FILE = "epoch.json"

_WARNING = """\
WARNING: lowering an epoch removes the fence that keeps an old active from
serving clients after a failover. Do this only with the broker stopped, set it
to the epoch the pair is really in (the other broker's, or the operator's
status.epoch), and start the brokers of the pair in the right roles.
"""


def _store(data_dir: Path) -> EpochStore:
    if not data_dir.is_dir():
        raise SystemExit(f"twinmq-broker epoch: {data_dir} is not a data directory")
    return EpochStore(data_dir / EPOCH_FILE)


def show(data_dir: Path) -> int:
    """Print the stored epoch."""
    store = _store(data_dir)
    where = store.path if store.path.exists() else f"{store.path} (absent: epoch 0)"
    print(f"epoch {store.epoch} ({where})")
    return 0


def set_epoch(data_dir: Path, epoch: int, *, force: bool) -> int:
    """Store `epoch`; lowering one needs `force`. Returns the exit status."""
    store = _store(data_dir)
    old = store.epoch
    if epoch == old:
        print(f"epoch is already {old}: nothing changed")
        return 0
    if epoch < old and not force:
        print(
            f"refusing to lower the epoch from {old} to {epoch} without --force\n\n{_WARNING}",
            file=sys.stderr,
        )
        return 2
    if epoch < old:
        print(_WARNING, file=sys.stderr)
    store.write(epoch)
    print(f"epoch {old} -> {epoch} ({store.path})")
    return 0


def main(argv: list[str]) -> int:
    """`twinmq-broker epoch ...`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="twinmq-broker epoch",
        description="Show or set the epoch a stopped broker persisted in <data-dir>/epoch.json",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show_parser = commands.add_parser("show", help="print the stored epoch")
    show_parser.add_argument("data_dir", type=Path)
    set_parser = commands.add_parser("set", help="store an epoch (the broker must be stopped)")
    set_parser.add_argument("data_dir", type=Path)
    set_parser.add_argument("epoch", type=int)
    set_parser.add_argument(
        "--force", action="store_true", help="allow lowering the epoch (read the warning)"
    )
    args = parser.parse_args(argv)
    if args.command == "show":
        return show(args.data_dir)
    if args.epoch < 0:
        parser.error("an epoch is 0 or more")
    return set_epoch(args.data_dir, args.epoch, force=args.force)
