"""Schedule logs: replay one on the scheduler's virtual clock, or compare two.

A schedule log is JSON lines, written by the engine or the simulator with --log PATH:
    {"event": "config", "settings": {...EngineConfig...}, "device_blocks": N, "host_blocks": M}
    {"event": "add", "rid": "7", "arrival": 0.31, "num_prompt": 42, "max_tokens": 16, ...}
    {"event": "step", "step": 0, "now": 0.32, "done": 0.41, "tokens": {"7": 42}, "admitted": ["7"],
     "resumed": [], "rotated_in": [], "rotated_out": [], "preempted": [], "swap_out": 0,
     "swap_in": 0, "stopped": []}
    {"event": "finish" | "abort", "rid": "7", "reason": "stop"}
Another engine can write the same step records (tokens computed per request, who was admitted,
resumed, rotated in or out, preempted) to have its decisions compared with ours.

    python -m tools.schedlog replay run.jsonl       re-decide every step; stop at the first
                                                    difference
    python -m tools.schedlog diff a.jsonl b.jsonl   the first step where two logs decide differently
    python -m tools.schedlog speed a.jsonl b.jsonl  how fast the machine ran each of them, for the
                                                    same work (a step-cost model fitted to both)
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

from sched import Request, Scheduler
from superinfer import EngineConfig, Parser

DECISIONS = ("tokens", "admitted", "resumed", "rotated_in", "rotated_out", "preempted",
             "swap_out", "swap_in")
STOP = -1  # the token a replayed request 'samples' where the log says it stopped


def log_name(base: str | None, policy: str, rate: float, runs: int) -> str | None:
    """--log PATH for a run: PATH itself, or PATH.<policy>.<rate>.jsonl when there are several."""
    if base is None or runs == 1:
        return base
    safe = policy.replace(":", "_").replace(",", "_").replace("=", "")
    return f"{base.removesuffix('.jsonl')}.{safe}.{rate:g}.jsonl"


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def difference(a: dict, b: dict) -> str | None:
    """Why two step records differ, in words; None if they decide the same."""
    why = []
    for key in DECISIONS:
        x, y = a.get(key), b.get(key)
        if key == "tokens":
            x, y = x or {}, y or {}
            for rid in sorted(set(x) | set(y)):
                if x.get(rid) != y.get(rid):
                    why.append(f"request {rid} computes {x.get(rid, 0)} vs {y.get(rid, 0)} tokens")
        elif x != y:
            why.append(f"{key}: {x} vs {y}")
    return "; ".join(why) or None


def replay(path: str) -> tuple[int, str | None]:
    """Drive a fresh scheduler with the log's settings, arrivals, clock and stops; compare each
    step's decisions with the log's. Returns (steps replayed, first difference or None)."""
    records = read(path)
    head = records[0]
    if head.get("event") != "config":
        raise ValueError(f"{path}: the first record must be the config")
    cfg = EngineConfig(**(head["settings"] | {"log_path": None}))
    s = Scheduler.create(cfg, head["device_blocks"], head["host_blocks"])
    steps = 0
    for rec in records[1:]:
        kind = rec["event"]
        if kind == "add":
            s.add(Request(rec["rid"], rec["num_prompt"], rec["max_tokens"], rec["arrival"],
                          priority=rec.get("priority", 0), ttft_slo=rec.get("ttft_slo"),
                          tbt_slo=rec.get("tbt_slo"), stop_ids=frozenset({STOP}),
                          prompt=rec.get("prompt"), hashes=rec.get("hashes", [])))
        elif kind == "abort":
            s.abort(rec["rid"], rec.get("reason", "abort"))
        elif kind == "finish":
            s.finish(rec["rid"], rec["reason"])
        elif kind == "step":
            s.bm.copies_done(rec["landed"])  # the copies known to have landed at that step
            plan = s.schedule(rec["now"])
            why = difference(plan.decisions(), rec)
            if why:
                return steps, f"step {rec['step']} (t={rec['now']:.3f}): log has {why}"
            stopped = set(rec.get("stopped", []))
            sampled = rec.get("sampled", {})  # logged where prefix caching hashes the tokens
            tokens = {r.rid: sampled.get(r.rid, 0) for r in plan.chunks}
            for r in plan.chunks:
                if r.rid in stopped:  # it stops on this token in the replay too
                    tokens[r.rid] = sampled.get(r.rid, STOP)
                    r.stop_ids = frozenset({tokens[r.rid]})
            s.update(plan, tokens, rec["done"])
            steps += 1
    return steps, None


def diff(path_a: str, path_b: str) -> tuple[int, str | None]:
    a = [r for r in read(path_a) if r.get("event", "step") == "step"]
    b = [r for r in read(path_b) if r.get("event", "step") == "step"]
    for i, (x, y) in enumerate(zip(a, b)):
        why = difference(x, y)
        if why:
            return i, f"step {i}: {why} (first vs second)"
    if len(a) != len(b):
        return min(len(a), len(b)), f"same decisions for {min(len(a), len(b))} steps, then one " \
                                    f"log ends ({len(a)} vs {len(b)} steps)"
    return len(a), None


def step_work(records: list[dict]) -> list[tuple[float, tuple[float, ...]]]:
    """(seconds, work) for each step of a log that computed tokens. The work: 1 (a step's fixed
    cost), tokens computed, sequences, KV tokens read (each sequence's context after the step),
    attention pairs (new tokens x context) and blocks copied between the tiers. A request
    preempted by recompute starts its context over; a rotated one keeps it."""
    context: dict[str, int] = {}
    out = []
    for rec in records:
        if rec.get("event") != "step":
            continue
        for rid in rec.get("preempted", []):
            context[rid] = 0
        tokens = rec["tokens"]
        if not tokens:
            continue
        after = {rid: context.get(rid, 0) + n for rid, n in tokens.items()}
        context.update(after)
        work = (1.0, sum(tokens.values()), len(tokens), sum(after.values()),
                sum(n * after[rid] for rid, n in tokens.items()), rec["swap_out"] + rec["swap_in"])
        out.append((rec["done"] - rec["now"], work))
    return out


def speed(logs: dict[str, list[dict]]) -> dict[str, float]:
    """How slow the machine was in each run, for the same work. A step's time is modelled as the
    run's machine factor times a cost linear in its `step_work`, with one cost for all the runs;
    both are fitted by alternating least squares, and the factors are returned with their
    geometric mean 1. 1.04: this run's steps took 4% longer than the same work took across the
    runs. Runs whose factors differ by a few percent ran on a machine not equally fast (clock,
    memory traffic of other tenants): near saturation that alone moves TTFT attainment by
    points. Copies are part of the work, so a policy's own copy cost is not a slow machine."""
    steps = {k: step_work(v) for k, v in logs.items()}
    runs = {k: (np.array([w for _, w in v]), np.array([t for t, _ in v]))
            for k, v in steps.items() if v}
    if len(runs) < 2 or sum(len(y) for _, y in runs.values()) < 24:
        return {}
    x = np.concatenate([w for w, _ in runs.values()])
    factor = dict.fromkeys(runs, 1.0)
    for _ in range(100):
        y = np.concatenate([t / factor[k] for k, (_, t) in runs.items()])
        cost = np.linalg.lstsq(x, y, rcond=None)[0]
        new = {k: t.sum() / max(float((w @ cost).sum()), 1e-12) for k, (w, t) in runs.items()}
        done = max(abs(new[k] / factor[k] - 1) for k in runs) < 1e-9
        factor = new
        if done:
            break
    mean = math.exp(sum(math.log(f) for f in factor.values()) / len(factor))
    return {k: f / mean for k, f in factor.items()}


def main(argv=None) -> None:
    ap = Parser(prog="python -m tools.schedlog", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("replay", help="re-decide every step of a log").add_argument("log")
    d = sub.add_parser("diff", help="compare two logs step by step")
    d.add_argument("a")
    d.add_argument("b")
    sub.add_parser("speed", help="the machine's speed in each log, for the same work"
                   ).add_argument("logs", nargs="+")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "speed":
            for path, x in speed({p: read(p) for p in args.logs}).items():
                print(f"{x:.3f}  {path}")
            return
        steps, why = replay(args.log) if args.cmd == "replay" else diff(args.a, args.b)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"schedlog: error: {e}")
    if why:
        print(f"after {steps} identical steps: {why}")
        sys.exit(1)
    print(f"{steps} steps: the same decisions")


if __name__ == "__main__":
    main()
