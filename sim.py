"""Virtual-clock driver for sched.py: runs the real scheduler and block accounting on simulated time."""
from __future__ import annotations

from typing import Callable

from sched import Request, Scheduler, StepPlan


class Stuck(RuntimeError):
    """The scheduler made no progress with work left and nothing more to arrive (a liveness bug)."""


def simulate(sched: Scheduler, requests: list[Request], step_time: Callable[[StepPlan], float],
             on_step: Callable[[StepPlan, float], None] | None = None, max_steps: int | None = None):
    """Feed requests at their arrival times, step the scheduler, advance a virtual clock by
    step_time(plan). Returns (finished requests, rejected (request, error) pairs)."""
    pending = sorted(requests, key=lambda r: r.arrival)
    done, rejected, i, now, steps = [], [], 0, 0.0, 0
    while i < len(pending) or sched.has_unfinished():
        while i < len(pending) and pending[i].arrival <= now:
            try:
                sched.add(pending[i])
            except ValueError as e:
                rejected.append((pending[i], str(e)))
            i += 1
        if not sched.has_unfinished():
            if i < len(pending):
                now = max(now, pending[i].arrival)
            continue
        plan = sched.schedule(now)
        if not plan.chunks and not plan.blocks_moved and not sched.bm.fenced:
            if i == len(pending):
                raise Stuck(f"step {steps}: nothing scheduled, {len(sched.waiting)} waiting, "
                            f"{len(sched.rotary)} rotary, {len(sched.running)} running")
            now = max(now, pending[i].arrival)
            continue
        now += step_time(plan)
        done += sched.update(plan, {r.rid: 0 for r, _ in plan.chunks}, now)
        sched.bm.copies_done()
        steps += 1
        if on_step:
            on_step(plan, now)
        if max_steps is not None and steps > max_steps:
            raise Stuck(f"no finish within {max_steps} steps")
    return done, rejected
