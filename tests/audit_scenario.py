"""A synthetic pair log with exactly known faults, and what the audit must find in it.

Epoch 1: `a` active, `b` passive; a degraded spell in the middle; then `a`
fails and `b` is promoted in epoch 2 with `a` as its passive. Injected:

- lost: two messages `a` confirmed (guarded) in epoch 1 of which `b` has no record;
- resent: a client publishes `p1:20` again (a second replication id);
- replicated twice: `b` stores `p1:25` twice;
- digest mismatch: `b` stores another body for `p1:28`;
- reordered: `b`, active in epoch 2, stores `p1:36` before `p1:35` (and so does `a`, its
  passive: one finding, the active's). Not a finding: `b`, then the
  passive, stores q2's anonymous message 6 before 5 in epoch 1 (a catch-up beside live
  batches does that; the passive sorts its queues by replication id, so its consumers
  never see it: `transforms.stream_copies`);
- unreplicated: `p1:41` confirmed by `b` at the very end (no failover since: not lost),
  a confirmed-alone message settled before the passive came back, and one still waiting;
- lag: -2 ms for every guarded confirm (the passive stores first), and the catch-up of
  the degraded spell: positive lags of 2.0 to 2.25 s.
"""

from __future__ import annotations

import dataclasses

from twinmq.audit.records import AuditEvent
from twinmq.audit.synthetic import PairLog, rid

C, CA, R, D = (
    AuditEvent.CONFIRMED,
    AuditEvent.CONFIRMED_ALONE,
    AuditEvent.REPLICATED,
    AuditEvent.DEQUEUED,
)


@dataclasses.dataclass
class Expected:
    """What the audit must report for the scenario."""

    findings: list[tuple[str, str, str | None, int]] = dataclasses.field(default_factory=list)
    lags: list[float] = dataclasses.field(default_factory=list)
    lags_by_queue: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    messages: int = 0
    confirmed: int = 0
    confirmed_alone: int = 0
    replicated: int = 0
    last_confirm_e1: float = 0.0
    first_confirm_e2: float = 0.0


class Scenario:
    """Builds the pair log; `expected` is filled in as faults are injected."""

    def __init__(self) -> None:
        self.log = PairLog(("a", "b"))
        self.expected = Expected()
        self.n = {1: 0, 2: 0}
        self.t = 1000.0

    def next_rid(self, epoch: int) -> int:
        self.n[epoch] += 1
        return rid(epoch, self.n[epoch])

    def tick(self, dt: float = 0.01) -> float:
        self.t = round(self.t + dt, 6)
        return self.t

    def guarded(
        self, epoch: int, active: str, passive: str, queue: str, mid: str | None, **kw: object
    ) -> int:
        """A message confirmed on both disks: the passive's record first, 2 ms earlier."""
        r = self.next_rid(epoch)
        t = self.tick()
        if not kw.get("skip_passive"):
            self.log.add(passive, epoch, R, queue, r, t - 0.002, mid, body=str(kw.get("body") or r))
            if kw.get("twice"):
                self.log.add(passive, epoch, R, queue, r, t - 0.001, mid, body=str(r))
            self._lag(queue, -0.002)
        self.log.add(active, epoch, C, queue, r, t, mid, body=str(r))
        self.expected.messages += 1
        self.expected.confirmed += 1
        self.expected.replicated += 0 if kw.get("skip_passive") else 1
        return r

    def _lag(self, queue: str, lag: float) -> None:
        self.expected.lags.append(lag)
        self.expected.lags_by_queue.setdefault(queue, []).append(lag)

    def find(self, kind: str, queue: str, broker: str | None, replication_id: int) -> None:
        self.expected.findings.append((kind, queue, broker, replication_id))


def build() -> Scenario:
    """The scenario of the module docstring."""
    s = Scenario()
    log = s.log
    p1: dict[int, int] = {}
    # Epoch 1: p1:1..30 on q1 and anonymous messages on q2, interleaved.
    q2: dict[int, int] = {}
    for n in range(1, 31):
        lost = n in (10, 11)
        p1[n] = s.guarded(
            1, "a", "b", "q1", f"p1:{n}",
            skip_passive=lost, twice=n == 25, body="corrupt" if n == 28 else None,
        )  # fmt: skip
        if lost:
            s.find("lost", "q1", "a", p1[n])
        if n == 25:
            s.find("replicated-twice", "q1", "b", p1[n])
        if n == 28:
            s.find("digest-mismatch", "q1", None, p1[n])
        if n == 20:  # the client re-sends p1:20 (its confirm got lost): another id
            again = s.guarded(1, "a", "b", "q1", "p1:20")
            s.find("resent", "q1", "a", again)
        if n <= 13:
            if n in (5, 6):
                continue  # q2's 5 and 6 are written below, the passive storing 6 first
            q2[n] = s.guarded(1, "a", "b", "q2", None)
        if n == 13:
            r5, r6 = s.next_rid(1), s.next_rid(1)
            t = s.tick()
            log.add("b", 1, R, "q2", r6, t - 0.002)
            log.add("b", 1, R, "q2", r5, t - 0.002)
            log.add("a", 1, C, "q2", r5, t)
            log.add("a", 1, C, "q2", r6, t)
            s._lag("q2", -0.002)
            s._lag("q2", -0.002)
            s.expected.messages += 2
            s.expected.confirmed += 2
            s.expected.replicated += 2
            q2[5], q2[6] = r5, r6
    log.rotate("a")
    log.rotate("b")
    # Consumers settle p1:1..9 on both brokers.
    for n in range(1, 10):
        t = s.tick()
        log.add("a", 1, D, "q1", p1[n], t)
        log.add("b", 1, D, "q1", p1[n], t - 0.001)
    # A degraded spell: the passive is away; q2 14..20 confirmed alone; 14 is consumed
    # before the passive comes back, the others are caught up 2 s after.
    alone = {}
    for n in range(14, 21):
        alone[n] = s.next_rid(1)
        log.add("a", 1, CA, "q2", alone[n], s.tick())
        s.expected.messages += 1
        s.expected.confirmed_alone += 1
    log.add("a", 1, D, "q2", alone[14], s.tick())
    s.find("unreplicated", "q2", "a", alone[14])
    caught_up = s.tick(2.0)
    for n in range(15, 21):
        log.add("b", 1, R, "q2", alone[n], caught_up)
        s.expected.replicated += 1
    confirms = {
        r.replication_id: r.time
        for seg in log.segments["a"]
        for r in seg.records
        if r.event in (C, CA)
    }
    for n in range(15, 21):
        s._lag("q2", round(caught_up - confirms[alone[n]], 9))
    log.rotate("b")
    s.expected.last_confirm_e1 = max(confirms.values())

    # Failover: a dies; b is promoted in epoch 2 three seconds after a's last confirm.
    s.t = round(s.expected.last_confirm_e1 + 3.0 - 0.01, 6)
    s.guarded(2, "b", "a", "q1", "p1:31")
    s.expected.first_confirm_e2 = s.t
    # a comes back passive: the catch-up discards the two messages b never had.
    for n in (10, 11):
        log.add("a", 2, D, "q1", p1[n], s.tick())
    for n in range(32, 41):
        if n == 35:
            continue
        if n == 36:
            # p1:36 reached the active first: the publisher's order is lost on arrival,
            # on the active and (as replicated) on its passive.
            r36, r35 = s.next_rid(2), s.next_rid(2)
            t = s.tick()
            log.add("a", 2, R, "q1", r36, t - 0.002, "p1:36", body=str(r36))
            log.add("a", 2, R, "q1", r35, t - 0.002, "p1:35", body=str(r35))
            log.add("b", 2, C, "q1", r36, t, "p1:36", body=str(r36))
            log.add("b", 2, C, "q1", r35, t, "p1:35", body=str(r35))
            s._lag("q1", -0.002)
            s._lag("q1", -0.002)
            s.expected.messages += 2
            s.expected.confirmed += 2
            s.expected.replicated += 2
            s.find("reordered", "q1", "b", r35)  # once: on the active that stored it
            continue
        s.guarded(2, "b", "a", "q1", f"p1:{n}")
    log.rotate("a")
    log.rotate("b")
    # At the very end: p1:41 confirmed by b, a's record not there (no failover since),
    # and a message confirmed alone, still waiting for the passive.
    last = s.guarded(2, "b", "a", "q1", "p1:41", skip_passive=True)
    s.find("unreplicated", "q1", "b", last)
    waiting = s.next_rid(2)
    log.add("b", 2, CA, "q2", waiting, s.tick())
    s.expected.messages += 1
    s.expected.confirmed_alone += 1
    s.find("unreplicated", "q2", "b", waiting)
    return s
