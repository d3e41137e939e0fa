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
"""
from __future__ import annotations

import argparse
import json
import sys

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
                          tbt_slo=rec.get("tbt_slo"), stop_ids=frozenset({STOP})))
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
            tokens = {r.rid: STOP if r.rid in stopped else 0 for r in plan.chunks}
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


def main(argv=None) -> None:
    ap = Parser(prog="python -m tools.schedlog", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("replay", help="re-decide every step of a log").add_argument("log")
    d = sub.add_parser("diff", help="compare two logs step by step")
    d.add_argument("a")
    d.add_argument("b")
    args = ap.parse_args(argv)
    try:
        steps, why = replay(args.log) if args.cmd == "replay" else diff(args.a, args.b)
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"schedlog: error: {e}")
    if why:
        print(f"after {steps} identical steps: {why}")
        sys.exit(1)
    print(f"{steps} steps: the same decisions")


if __name__ == "__main__":
    main()
