"""Deferred copy streams: the ordering of DuplexKV checked on a CPU.

A stand-in for CudaStreams. Each copy stream queues what the copier enqueues (copies, event
records, waits) and runs it only when the test advances that stream, or when compute waits on
one of its events; a queued wait holds its stream until the awaited event has run. So copies
land as late, and in whatever interleaving, the declared waits allow - as on a GPU at its worst.
Compute itself (the model, or the test's stand-in) runs synchronously, when it is called: an
ordering bug then shows as corrupted bytes, or as compute touching a block that a queued copy
still reads or writes (check_compute).
"""
from __future__ import annotations

import random
from collections import deque

from kv import IN, OUT


class Event:
    def __init__(self, stream: str):
        self.stream, self.passed = stream, False


class DeferredStreams:
    def __init__(self, rng: random.Random | None = None, prefer: str | None = None):
        self.queues: dict[str, deque] = {OUT: deque(), IN: deque()}
        self.rng = rng or random.Random(0)
        self.prefer = prefer  # a stream to run as far as it can before any other (worst order)

    # ------------------------------------------------------------ the Streams interface
    def enqueue(self, stream: str, fn, touches=()) -> None:
        self.queues[stream].append(("run", fn, tuple(touches)))

    def record(self, stream: str) -> Event:
        ev = Event(stream)
        self.queues[stream].append(("record", ev))
        return ev

    def wait(self, stream: str, event: Event | None) -> None:
        if event is not None:
            self.queues[stream].append(("wait", event))

    def wait_compute(self, stream: str) -> None:
        pass  # compute runs synchronously: everything it was asked to do is done

    def compute_wait(self, event: Event | None) -> None:
        """Compute needs event: first let the preferred stream (or random ones) run ahead."""
        if event is None:
            return
        if self.prefer is not None:
            self.run_ahead(self.prefer)
        else:
            self.advance()
        self.drain(event)

    def run_ahead(self, stream: str) -> None:
        q = self.queues[stream]
        while q and not (q[0][0] == "wait" and not q[0][1].passed):
            self._run_head(None, q)

    def done(self, event: Event | None) -> bool:
        """Asking is a moment in which the streams may have moved on."""
        self.advance()
        return event is None or event.passed

    def synchronize(self) -> None:
        for q in self.queues.values():
            while q:
                self._run_head(q[0][0] == "wait" and q[0][1] or None, q)

    # ------------------------------------------------------------ driving the streams
    def _run_head(self, blocker: Event | None, q: deque) -> None:
        if blocker is not None and not blocker.passed:
            self.drain(blocker)
        op = q.popleft()
        if op[0] == "run":
            op[1]()
        elif op[0] == "record":
            op[1].passed = True

    def drain(self, event: Event) -> None:
        """Run event's stream until the event has passed (and whatever it waits on first)."""
        q = self.queues[event.stream]
        while not event.passed:
            self._run_head(q[0][1] if q[0][0] == "wait" else None, q)

    def runnable(self) -> list[str]:
        return [s for s, q in self.queues.items()
                if q and not (q[0][0] == "wait" and not q[0][1].passed)]

    def advance(self, max_ops: int = 3) -> None:
        """Run a few operations on randomly chosen streams, as far as their waits allow."""
        for _ in range(self.rng.randint(0, max_ops)):
            ready = self.runnable()
            if not ready:
                return
            q = self.queues[self.rng.choice(ready)]
            self._run_head(None, q)

    def pending(self) -> list[tuple[str, int, str]]:
        """(tier, block, 'r' or 'w') of every copy still queued."""
        return [t for q in self.queues.values() for op in q if op[0] == "run" for t in op[2]]

    def check_compute(self, tier: str, blocks, mode: str) -> None:
        """Compute is about to read ('r') or write ('w') these blocks: no queued copy may still
        write them, nor (for a write) read them."""
        blocks = set(blocks)
        for t, b, m in self.pending():
            if t == tier and b in blocks and (m == "w" or mode == "w"):
                what = "writes" if m == "w" else "reads"
                raise AssertionError(f"compute {'writes' if mode == 'w' else 'reads'} {tier} block "
                                     f"{b} while a queued copy still {what} it")
