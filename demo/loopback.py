"""`make demo`: the main job on an embedded default, as far as the product goes today.

1. One broker on a throw-away data directory: a real client (pika) declares,
   publishes with confirms, consumes and acks; the broker is killed with SIGKILL
   and restarts from its journal with every unacknowledged confirmed message.
2. A replicated pair: the reliable publisher (`twinmq.client`) sends numbered
   messages while the active broker is killed; the passive, ready, is promoted
   in a new epoch; the old active comes back passive and catches up. Nothing
   confirmed is lost, nothing is enqueued twice.
3. (`make demo` then runs `make cluster-demo`: the local Kubernetes, the chart,
   confirmed traffic through a Service, a killed pod.)
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import pika

from twinmq.broker.admin_client import AdminClient
from twinmq.client import ReliablePublisher
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair

QUEUE = "demo.orders"
EXCHANGE = "demo.events"
MESSAGES = 2000
CONSUME_BEFORE_CRASH = 800
PAIR_MESSAGES = 3000


def say(text: str) -> None:
    """One line of the demo's story."""
    print(f"[demo] {text}", flush=True)


def queue_depth(broker: BrokerProcess, name: str) -> int:
    """Ready messages in a queue, from the admin API (open to loopback clients: no token)."""
    return next(q.messages for q in broker.admin.status().queues if q.name == name)


def drain(broker: BrokerProcess, queue: str, limit: int | None = None) -> list[bytes]:
    """Consume (and ack) up to `limit` messages; None drains the queue."""
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=200)
    seen: list[bytes] = []
    for method, _props, body in ch.consume(queue, inactivity_timeout=1.0):
        if method is None:
            break
        seen.append(body)
        ch.basic_ack(method.delivery_tag)
        if limit is not None and len(seen) >= limit:
            break
    ch.cancel()
    conn.close()
    return seen


def single_broker(root: Path) -> dict[str, Any]:
    """Part 1: the crash-safe journal."""
    say("part 1: one broker, its journal, and kill -9")
    data = root / "single"
    broker = BrokerProcess(data, name="demo-broker").start()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.exchange_declare(EXCHANGE, "topic", durable=True)
        ch.queue_declare(QUEUE, durable=True)
        ch.queue_bind(QUEUE, EXCHANGE, "order.#")
        ch.confirm_delivery()
        started = time.perf_counter()
        for i in range(MESSAGES):
            ch.basic_publish(
                EXCHANGE,
                f"order.created.{i % 7}",
                str(i).encode(),
                pika.BasicProperties(delivery_mode=2),
            )
        conn.close()
        say(
            f"published {MESSAGES} persistent messages with confirms (each fsynced before its "
            f"confirm) in {time.perf_counter() - started:.2f}s"
        )
        first = drain(broker, QUEUE, CONSUME_BEFORE_CRASH)
        depth = queue_depth(broker, QUEUE)
        say(f"consumed and acknowledged {len(first)}; {depth} left; now kill -9")
        broker.kill()
        broker = BrokerProcess(
            data, name="demo-broker", port=broker.port, admin_port=broker.admin_port
        ).start()
        after = queue_depth(broker, QUEUE)
        rest = drain(broker, QUEUE)
        received = sorted(int(b) for b in first + rest)
        say(f"restarted from the journal with {after} messages; drained them")
    finally:
        broker.stop()
    return {
        "confirmed": MESSAGES,
        "recovered": after,
        "expected": depth,
        "lost": len(set(range(MESSAGES)) - set(received)),
        "duplicates": len(received) - len(set(received)),
    }


def replicated_pair(root: Path) -> dict[str, Any]:
    """Part 2: failover of a replicated pair under a reliable publisher."""
    say("part 2: an active/passive pair, a kill -9 of the active, a promotion")
    pair = Pair(
        root / "pair", names=("broker-a", "broker-b"), link=False, replication_timeout=None
    ).start()
    a, b = pair.active, pair.passive
    try:
        conn = pika.BlockingConnection(pika.URLParameters(a.url))
        conn.channel().queue_declare(QUEUE, durable=True)
        conn.close()
        pair.wait_healthy()
        say("broker-a active (epoch 1), broker-b passive and ready (caught up)")
        failover: dict[str, float] = {}

        async def publish_through_failover() -> ReliablePublisher:
            publisher = ReliablePublisher([a.url, b.url], reconnect_delay=0.05)
            window = asyncio.Semaphore(100)
            confirmed = 0
            a_third = asyncio.Event()

            async def one(i: int) -> None:
                nonlocal confirmed
                try:
                    await publisher.publish(str(i).encode(), QUEUE, message_id=f"order-{i}")
                    confirmed += 1
                    if confirmed >= PAIR_MESSAGES // 3:
                        a_third.set()
                    if (
                        "killed" in failover
                        and "first_confirm" not in failover
                        and (publisher.reconnects)
                    ):
                        failover["first_confirm"] = time.monotonic()
                finally:
                    window.release()

            async def kill_midway() -> None:
                await a_third.wait()
                a.kill()
                failover["killed"] = time.monotonic()
                say(f"killed broker-a (kill -9) after {confirmed} confirms, publishes in flight")
                # What the operator will do: promote the ready passive in a new epoch.
                async with AdminClient(b.admin_url) as passive:
                    status = await passive.status()
                assert status.replication.ready, "the passive was not ready"
                await asyncio.to_thread(pair.promote_passive)  # POST /role: active, epoch 2
                failover["promoted"] = time.monotonic()
                say("promoted broker-b to active in epoch 2")

            killer = asyncio.create_task(kill_midway())
            tasks = []
            for i in range(PAIR_MESSAGES):
                await window.acquire()
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks, killer)
            await publisher.close()
            return publisher

        publisher = asyncio.run(publish_through_failover())
        say(
            f"every publish confirmed; the publisher reconnected {publisher.reconnects}x and "
            f"re-sent {publisher.resends} unconfirmed messages under their ids"
        )
        pair.rejoin(a)
        pair.wait_healthy()
        a_status, b_status = a.admin.status(), b.admin.status()
        say(
            f"broker-a came back passive and caught up: epoch {a_status.epoch}, "
            f"{queue_depth(a, QUEUE)} messages, same as broker-b's {queue_depth(b, QUEUE)}"
        )
        received = [int(x) for x in drain(b, QUEUE)]
        seconds = failover.get("first_confirm", failover["promoted"]) - failover["killed"]
        return {
            "confirmed": PAIR_MESSAGES,
            "lost": len(set(range(PAIR_MESSAGES)) - set(received)),
            "duplicates": len(received) - len(set(received)),
            "resends": publisher.resends,
            "failover_seconds": seconds,
            "active": b_status.name,
            "epoch": b_status.epoch,
        }
    finally:
        pair.stop()


def main() -> None:
    """Run the demo and print what happened."""
    # The client library logs each broken connection with a traceback; the demo
    # breaks one on purpose and reports what happened itself.
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="twinmq-demo-") as tmp:
        single = single_broker(Path(tmp))
        pair = replicated_pair(Path(tmp))
    ok = (
        single["lost"] == 0 and single["recovered"] == single["expected"]
        and pair["lost"] == 0 and pair["duplicates"] == 0
    )  # fmt: skip
    print()
    print("TwinMQ demo report")
    print("  one broker, kill -9")
    print(f"    confirmed messages        {single['confirmed']}")
    print(f"    recovered after kill -9   {single['recovered']} (expected {single['expected']})")
    print(f"    lost confirmed messages   {single['lost']}")
    print("  replicated pair, kill -9 of the active, promotion")
    print(f"    confirmed messages        {pair['confirmed']}")
    print(f"    active now                {pair['active']} (epoch {pair['epoch']})")
    print(f"    kill -9 to first confirm  {pair['failover_seconds']:.2f}s on the promoted broker")
    print(f"    re-sent by the publisher  {pair['resends']} (deduplicated by message id)")
    print(f"    lost confirmed messages   {pair['lost']}")
    print(f"    duplicates                {pair['duplicates']}")
    print(f"  verdict                     {'PASS' if ok else 'FAIL'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
