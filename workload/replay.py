"""A workload's arrivals served through an engine: online on the wall clock, or several runs
interleaved step by step, each on a clock of its own (bench.py drives these).

A run's timeline on its own clock is its own steps' measured times, and waiting for an arrival
jumps to it; the runs' steps interleave, so the machine's drifts in speed fall on all of them
alike, which is what lets one run compare policies on a busy or drifting machine.
"""
from __future__ import annotations

import math
import time

from superinfer import Engine, SamplingParams
from workload.metrics import progress
from workload.trace import Item


class WallClock:
    """Online serving's clock: time passes whether or not the engine works; waiting sleeps."""
    def __call__(self) -> float:
        return time.perf_counter()

    def run(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


class OwnClock:
    """An engine's own clock for interleaved runs: it runs only while that engine steps, so a
    run's timeline is its own steps' measured times, and waiting for an arrival jumps to it.
    Steps of the runs interleave, so the machine's drifts in speed fall on all of them alike."""
    def __init__(self):
        self.t, self.since = 0.0, None

    def __call__(self) -> float:
        return self.t + (0.0 if self.since is None else time.perf_counter() - self.since)

    def run(self) -> None:
        self.since = time.perf_counter()

    def pause(self) -> None:
        self.t, self.since = self(), None

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)


class Replay:
    """One engine serving `items` at their arrival times on its clock; whatever is unfinished
    `deadline` seconds after the start is aborted. advance() is one step or one wait;
    serve() and serve_interleaved() drive it."""
    def __init__(self, engine: Engine, items: list[Item], prompts: list[list[int]],
                 deadline: float, clock=None, sync: bool = False):
        self.engine, self.items, self.prompts, self.deadline = engine, items, prompts, deadline
        self.clock = clock or WallClock()   # engine.clock, or one reading the same time
        self.order = sorted(range(len(items)), key=lambda i: items[i].arrival)
        self.t0 = self.clock() + 0.01
        self.rids, self.nxt, self.busy, self.sync = [], 0, 0.0, sync

    def advance(self) -> int | None:
        """One step (returns the requests it finished) or a wait for the next arrival (0);
        None when the run is over."""
        e, order, clock = self.engine, self.order, self.clock
        now = clock()
        if now - self.t0 > self.deadline:
            for rid in self.rids:
                e.abort(rid)
            return None
        while self.nxt < len(order) and self.t0 + self.items[order[self.nxt]].arrival <= now:
            i = order[self.nxt]
            params = SamplingParams(max_tokens=self.items[i].output_len, temperature=0,
                                    ignore_eos=True)
            self.rids.append(e.add_request(self.prompts[i], params,
                                           arrival_time=self.t0 + self.items[i].arrival))
            self.nxt += 1
        if e.has_unfinished():
            now = clock()
            clock.run()
            done = sum(ev.finished for ev in e.step())
            if self.sync:  # a device's work counts in the step that queued it
                e.runner.synchronize()
            clock.pause()
            self.busy += clock() - now
            return done
        if self.nxt < len(order):
            clock.wait_until(self.t0 + self.items[order[self.nxt]].arrival)
            return 0
        return None

    def result(self) -> tuple[list, dict]:
        outs = [self.engine.output(rid) for rid in self.rids]
        records = [(o.metrics.arrival_time, o.metrics.token_times) for o in outs]
        records += [(self.t0 + self.items[i].arrival, []) for i in self.order[len(self.rids):]]
        stats = self.engine.stats()
        unfinished = len(self.items) - sum(o.finish_reason == "length" for o in outs)
        return records, stats | {"mean_step_ms": 1e3 * self.busy / max(1, stats["steps"]),
                                 "unfinished": unfinished}


def serve(engine: Engine, items: list[Item], prompts: list[list[int]], label: str,
          deadline: float = math.inf) -> tuple[list, dict]:
    """Online serving: requests join the running engine at their arrival times (wall clock)."""
    return serve_interleaved([Replay(engine, items, prompts, deadline)], label)[0]


def serve_interleaved(replays: list[Replay], label: str) -> list[tuple[list, dict]]:
    """Run the replays step by step, always advancing the one whose clock is furthest behind
    (with one replay: plain online serving); each one's (records, stats)."""
    live = list(replays)
    bar = progress(sum(len(r.items) for r in replays), label)
    while live:
        r = min(live, key=lambda x: x.clock() - x.t0)
        done = r.advance()
        if done is None:
            live.remove(r)
        else:
            bar.update(done)
    bar.close()
    return [r.result() for r in replays]
