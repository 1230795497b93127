"""Upstream queues of links no longer configured (issue 15): deleted, or reported.

Each link has a durable queue on its upstream (`agent.queue_name`) that keeps collecting
what the upstream routes to it while the link is down. When the federation file stops
federating an exchange, nothing consumes that queue any more: it would grow without bound
upstream. So the links a server runs are remembered in `links.json` of its federation
state directory; at the next start (a restart with another file, a promotion) the links
remembered and not configured any more are its orphans:

- its upstream still named in the file: the queue is deleted there, once, by a
  connection of its own (the upstream may have no link left), retried with the
  upstream's backoff until it is done; remembered until then (a crash retries it);
- its upstream gone from the file: no address nor credentials to delete it with, so it is
  logged and listed in `/status` (`upstream_queues_left`) and forgotten (delete it by
  hand).

A wiped data dir (or a pair's passive promoted, never active with the links) has no
record: the upstream's state replication then says what is there. At each start a
connection to each upstream in the file subscribes to its `amq.twinmq.state`, and every
queue of its full state named as a link queue of this server (`federation:<exchange>:
<server id>`, `agent.queue_name`) that no configured link uses is an orphan found there:
pending, deleted and reported by the same rule as a remembered one. Only names that
split one way are taken (no `:` in the exchange name nor in the server id): otherwise a
queue of a server whose id ends with `:<this id>` could be taken for one of ours.

Only queues this server's links declared are ever deleted (names recorded here, or named
for this server's identifier upstream), and never one a configured link uses: a queue of
another downstream, or of a link still in the file, is not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from pydantic import (
    BaseModel,
    ConfigDict,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from twinmq.broker.atomicfile import replace_file
from twinmq.broker.federation.agent import QUEUE_PREFIX
from twinmq.broker.federation.config import Upstream
from twinmq.broker.federation.identity import (
    SERVER_ID_PROPERTY,
    STATE_PROPERTY,
    duplicate_refusal,
)
from twinmq.broker.federation.state import STATE_EXCHANGE, StateMessage, StateView
from twinmq.broker.federation.wire import Delivery, LinkClient

log = logging.getLogger(__name__)

FILE_NAME = "links.json"
FIRST_PAUSE = 1.0  # seconds before the first retry of a failed clean-up
STATE_WAIT = 10.0  # seconds a scan waits for the upstream's full state (then retried)


def link_exchange(queue: str, server_id: str) -> str | None:
    """The upstream exchange of `queue` if it is a link queue of `server_id`
    (`federation:<exchange>:<server id>`), else None; None too when the name could split
    another way (a `:` in the exchange or the id: then it may be another server's)."""
    if ":" in server_id or not queue.startswith(QUEUE_PREFIX):
        return None
    exchange, sep, owner = queue[len(QUEUE_PREFIX) :].rpartition(":")
    if not sep or not exchange or ":" in exchange or owner != server_id:
        return None
    return exchange


class LinkQueue(BaseModel):
    """A link's queue on its upstream, as remembered: which upstream (by its name in the
    federation file), which queue, for which local exchange."""

    model_config = ConfigDict(frozen=True)

    upstream: str
    queue: str
    exchange: str
    vhost: str = "/"  # the upstream's vhost the queue is in

    @model_serializer(mode="wrap")
    def _without_root_vhost(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # `/`'s entries are written as before vhosts (the same links.json, byte for byte).
        out: dict[str, Any] = handler(self)
        if self.vhost == "/":
            out.pop("vhost", None)
        return out

    def shown(self) -> str:
        """`upstream/queue` (`upstream/vhost/queue` in another vhost than `/`, the vhost
        percent-encoded), as `/status` and the logs name it."""
        if self.vhost == "/":
            return f"{self.upstream}/{self.queue}"
        return f"{self.upstream}/{quote(self.vhost, safe='')}/{self.queue}"


class KnownLinks(BaseModel):
    """`links.json`: the link queues this server has upstream (configured, or orphans not
    yet deleted)."""

    links: list[LinkQueue] = []


class Orphans:
    """The orphan queues of one start: found, deleted upstream, or left."""

    def __init__(self, state_dir: Path, server_id: str, configured: Iterable[LinkQueue]) -> None:
        self.path = state_dir / FILE_NAME
        self.server_id = server_id
        self.configured = list(dict.fromkeys(configured))
        self.pending: list[LinkQueue] = []
        self.deleted: list[str] = []
        self.left: list[str] = []
        self.found: list[str] = []  # pending ones found by the upstreams' state, not the record
        self._task: asyncio.Task[None] | None = None

    def _remembered(self) -> list[LinkQueue]:
        try:
            return KnownLinks.model_validate_json(self.path.read_text()).links
        except FileNotFoundError:
            return []
        except (OSError, ValidationError) as exc:
            # Only a clean-up is lost (the queues stay, as before this existed).
            log.warning("federation: %s unreadable, no orphan queue cleaned: %s", self.path, exc)
            return []

    def find(self, upstreams: Iterable[str]) -> None:
        """Compare what is remembered with what is configured: the orphans to delete
        (`pending`) and those that cannot be (`left`, logged); the record rewritten."""
        named = set(upstreams)
        configured = set(self.configured)
        # Never a queue a configured link uses: two upstream names may be one server
        # (an exchange moved from one to the other keeps its queue there).
        used = {(link.vhost, link.queue): link.upstream for link in self.configured}
        pending: list[LinkQueue] = []
        for link in self._remembered():
            if link in configured or link in pending or link.shown() in self.left:
                continue
            if link.upstream in named and (link.vhost, link.queue) not in used:
                pending.append(link)
                continue
            self.left.append(link.shown())
            why = (
                f"a configured link uses the same queue name (upstream "
                f"{used[link.vhost, link.queue]}): delete it by hand if that is another server"
                if (link.vhost, link.queue) in used
                else f"upstream {link.upstream} is no longer in the federation file (no "
                "address nor credentials): delete it by hand"
            )
            log.warning(
                "federation: upstream queue %s (exchange %s no longer federated) NOT "
                "deleted: %s", link.shown(), link.exchange, why,
            )  # fmt: skip
        self.pending = pending
        self._save()

    def _save(self) -> None:
        known = KnownLinks(links=[*self.configured, *self.pending])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(self.path, (known.model_dump_json(indent=1) + "\n").encode())

    def start(self, upstreams: Mapping[str, Upstream]) -> None:
        """Look for orphans in each upstream's state and delete the pending ones there, in
        the background (active only)."""
        if (self.pending or upstreams) and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._clean(dict(upstreams)), name="twinmq-federation-orphans"
            )

    async def stop(self) -> None:
        """Stop cleaning (demotion, shutdown): what is left is retried at the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _clean(self, upstreams: dict[str, Upstream]) -> None:
        # `find` left pending only orphans of upstreams in the file.
        await asyncio.gather(
            *(self._clean_upstream(name, upstream) for name, upstream in upstreams.items())
        )

    async def _clean_upstream(self, name: str, upstream: Upstream) -> None:
        pause = FIRST_PAUSE
        while True:
            try:
                await self._delete(name, upstream)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure is retried, as a link's session is
                if any(link.upstream == name for link in self.pending):
                    log.warning(
                        "federation: orphan queues on upstream %s not deleted yet (retry in "
                        "%.0f s): %s", name, pause, exc,
                    )  # fmt: skip
                else:
                    # Only the look in its state: the links say loudly enough that it is
                    # not reachable.
                    log.info(
                        "federation: upstream %s not searched for orphan queues yet (retry "
                        "in %.0f s): %s", name, pause, exc,
                    )  # fmt: skip
            await asyncio.sleep(pause)
            pause = min(pause * 2, upstream.reconnect_max_seconds)

    async def _delete(self, name: str, upstream: Upstream) -> None:
        # The URI's vhost first (the look in its state), then each other vhost holding a
        # pending orphan of this upstream, by a connection opening that vhost.
        home = upstream.vhost
        await self._delete_in(name, upstream, None)
        others = {link.vhost for link in self.pending if link.upstream == name}
        for vhost in sorted(others - {home or "/"}):
            await self._delete_in(name, upstream, vhost)

    async def _delete_in(self, name: str, upstream: Upstream, vhost: str | None) -> None:
        connection = await LinkClient.connect(
            upstream.connect_uri(vhost),
            {
                SERVER_ID_PROPERTY: self.server_id,
                "connection_name": f"federation clean-up from {self.server_id}",
            },
            tls=upstream.tls_context(),
            server_name=upstream.tls_server_name,
        )
        try:
            refusal = duplicate_refusal(
                self.server_id, connection.server_properties.get(SERVER_ID_PROPERTY),
                side="upstream",
            )  # fmt: skip
            if refusal is not None:
                raise ConnectionError(refusal)
            announced = connection.server_properties.get(STATE_PROPERTY)
            if vhost is None and announced in (STATE_EXCHANGE, STATE_EXCHANGE.encode()):
                self._add_found(
                    name, await _link_queues(connection, self.server_id), upstream.vhost or "/"
                )
            opened = vhost or upstream.vhost or "/"
            for link in [x for x in self.pending if x.upstream == name and x.vhost == opened]:
                dropped = await connection.queue_delete(link.queue)
                self.pending.remove(link)
                self.deleted.append(link.shown())
                self._save()
                log.info(
                    "federation: upstream queue %s on %s deleted (exchange %s no longer "
                    "federated; %d messages dropped with it)",
                    link.queue, name, link.exchange, dropped,
                )  # fmt: skip
        finally:
            with contextlib.suppress(Exception):
                await connection.close()

    def _add_found(self, name: str, queues: Mapping[str, str], vhost: str = "/") -> None:
        """Pending: the link queues of this server on upstream `name` (queue -> exchange,
        from its state) that no configured link uses nor the record already holds."""
        known = {(link.vhost, link.queue) for link in (*self.configured, *self.pending)}
        found = [LinkQueue(upstream=name, queue=queue, exchange=exchange, vhost=vhost)
                 for queue, exchange in sorted(queues.items())
                 if (vhost, queue) not in known]  # fmt: skip
        if not found:
            return
        for link in found:
            self.found.append(link.shown())
            log.warning(
                "federation: upstream queue %s (exchange %s upstream) is named for this server "
                "and no configured link uses it: an orphan (found in the upstream's state, "
                "not in %s); deleting it", link.shown(), link.exchange, self.path,
            )  # fmt: skip
        self.pending.extend(found)
        self._save()


async def _link_queues(connection: LinkClient, server_id: str) -> dict[str, str]:
    """The link queues of `server_id` on the upstream (queue -> upstream exchange), from
    a full state of its `amq.twinmq.state` (a private queue, gone with the connection)."""
    view = StateView()
    full = asyncio.Event()

    def received(delivery: Delivery) -> None:
        try:
            message = StateMessage.model_validate_json(delivery.body)
        except ValueError as exc:
            log.warning("federation: unreadable state message from an upstream: %s", exc)
            return
        view.apply(message)
        if message.kind == "full":
            full.set()

    queue = await connection.declare_private_queue()
    await connection.watch(queue, "state", received)
    await connection.queue_bind(queue, STATE_EXCHANGE, "", None)
    async with asyncio.timeout(STATE_WAIT):  # a TimeoutError is retried with the backoff
        await full.wait()
    assert view.state is not None
    out: dict[str, str] = {}
    for name in view.state.queues:
        exchange = link_exchange(name, server_id)
        if exchange is not None:
            out[name] = exchange
    return out
