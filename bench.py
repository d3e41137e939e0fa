"""Side-by-side SLO benchmark: the same arrivals through each policy, served online on a wall clock.

    python bench.py                     embedded model, an Azure trace slice, fcfs vs fcfs-swap vs
                                        rotasched
    python bench.py --policies fcfs,fcfs-swap,rotasched,rotasched-released,hf --plot r.png
    python bench.py --backend openai --base-url http://127.0.0.1:8000 --policies openai,rotasched
                                        a server (ours, vLLM, ...) and the engine here, one table
    python bench.py --clock own         the policies' runs interleaved step by step, each on a
                                        clock of its own: the machine's drifts fall on all alike
    python bench.py --speed             tokens/s next to HF transformers (tools/bench_speed.py)

The run calibrates itself (unloaded latency gives the SLOs, a bulk run the saturation rate) and
sizes the workload to a time target per run, so a slow machine runs fewer requests, not longer.
Metrics are vLLM benchmark_serving's (workload/metrics.py); --repeat N gives their spread.
Each run's schedule log also gives the machine's speed for the same work (tools/schedlog.py):
a verdict on runs the machine served at uneven speeds says so (UNEVEN SPEED).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch

from model import ModelLoadError
from sched import Request
from serving import client
from superinfer import Engine, Parser, SamplingParams, add_engine_flags, engine_config
from tools import bench_speed, schedlog, sim
from weights.loader import load_model, resolve_device
from workload.metrics import plot, policy_of, print_table, progress, summarize, verdict
from workload.trace import (DEFAULT_TRACE, WORKLOADS, Item, Scaling, TraceError, describe_scaling,
                            read_trace, synthetic_prompts, synthetic_workload, trace_workload,
                            with_rate)

JSON_KEYS = ("policy", "rate", "num_requests", "ttft_attainment", "tbt_attainment", "goodput_req_s",
             "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "rotations",
             "bytes_moved")
QUIET_TBT = 0.035   # unloaded decode step of the embedded model on a quiet 2-core machine, s
DISTURBED = 0.15    # other processes using more of the CPUs than this during a run disturb it


# ---------------------------------------------------------------- serving loops

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


def serve_hf(hf, cfg, items: list[Item], prompts: list[list[int]], label: str,
             deadline: float = math.inf) -> tuple[list, dict]:
    """The same arrivals through HF transformers' own continuous batching (its own thread)."""
    mgr = bench_speed.hf_manager(hf, max(i.output_len for i in items), cfg.max_num_seqs,
                                 cfg.max_num_batched_tokens, cfg.block_size, cfg.num_device_blocks)
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    t0 = time.perf_counter() + 0.01
    arrivals, results, bar = {}, {}, progress(len(items), label)
    try:
        for i in order:
            time.sleep(max(0.0, t0 + items[i].arrival - time.perf_counter()))
            arrivals[str(i)] = t0 + items[i].arrival
            mgr.add_request(prompts[i], request_id=str(i), max_new_tokens=items[i].output_len,
                            record_timestamps=True)
            while (r := mgr.get_result(timeout=0)) is not None:
                results[r.request_id] = r
                bar.update(1)
        while (len(results) < len(items) and mgr.is_running()
               and time.perf_counter() - t0 < deadline):
            r = mgr.get_result(timeout=1.0)
            if r is not None:
                results[r.request_id] = r
                bar.update(1)
    finally:
        mgr.stop(block=True)
        hf.destroy_cached_continuous_batching_manager()
        bar.close()
    records = [(arrivals[k], list(results[k].timestamps or []) if k in results else [])
               for k in arrivals]
    return records, {"unfinished": len(items) - len(results)}


# ---------------------------------------------------------------- workload and calibration

def build_workload(args, vocab: int, repeat: int = 0):
    """(items, prompts, description); repeat k takes seed + k and, from a trace, the k-th next
    slice of it, so each repeat has fresh arrivals and prompts."""
    seed, offset = args.seed + repeat, args.trace_offset + repeat * args.num_requests
    burst = args.burstiness or 1.0
    if args.trace == "none":
        items = synthetic_workload(args.num_requests, 1.0, burst, args.input_lens,
                                   args.output_lens, seed)
        text = f"synthetic: prompt lengths {args.input_lens}, output lengths {args.output_lens}"
    else:
        rows = read_trace(args.trace)
        fp, fo = WORKLOADS[args.workload]
        scaling = Scaling(args.prompt_scale * fp, args.output_scale * fo, args.max_len,
                          args.max_len, args.min_output)
        items = trace_workload(rows, args.num_requests, offset, scaling,
                               time_scale=args.time_scale or 1.0)
        text = (f"{args.workload}: trace {os.path.basename(args.trace)} requests [{offset}, "
                f"{offset + args.num_requests}); " + describe_scaling(rows, items, offset, scaling))
        if args.burstiness is not None:  # the trace's lengths, gamma arrivals of that shape
            gamma = synthetic_workload(len(items), 1.0, burst, [1], [1], seed)
            items = [Item(g.arrival, i.prompt_len, i.output_len) for g, i in zip(gamma, items)]
    if args.burstiness is not None:
        text += f"; gamma arrivals, shape {burst:g} (CV {burst ** -0.5:.1f})"
    return items, synthetic_prompts(items, vocab, seed), text


def calibrate(run, items, prompts, cfg, args) -> tuple[float, float, float]:
    """(TTFT SLO, TBT SLO, saturation req/s) measured with run(items, prompts, label, deadline):
    the unloaded latency of a median request (the median of 3 runs: one slow first step, seen
    once at 4.6x, must not set the SLOs) sets the SLOs, and requests queued all at once
    measure the rate this machine (or server) serves."""
    run([Item(0.0, 16, 4)], [[1000] * 16], "warm-up", args.run_seconds)
    med = sorted(items, key=lambda i: i.prompt_len)[len(items) // 2]
    recs = [run([Item(0.0, med.prompt_len, 16)], synthetic_prompts([med], 2000, 1),
                "unloaded latency", args.run_seconds)[0][0] for _ in range(3)]
    if any(len(times) < 2 for _, times in recs):
        raise SystemExit("bench: error: the unloaded request did not complete; cannot calibrate")
    ttft0 = statistics.median(times[0] - start for start, times in recs)
    tbt0 = statistics.median((t[-1] - t[0]) / (len(t) - 1) for _, t in recs)
    ttft_slo = args.ttft_slo or round(args.ttft_slo_factor * ttft0, 2)
    tbt_slo = args.tbt_slo or round(args.tbt_slo_factor * tbt0, 3)
    print(f"unloaded (median of 3): TTFT {ttft0:.3f} s (prompt {med.prompt_len}), "
          f"TBT {tbt0 * 1e3:.1f} ms -> SLOs TTFT {ttft_slo:.2f} s, TBT {tbt_slo * 1e3:.0f} ms")
    if args.model is None and "openai" not in args.policies and tbt0 > 2.5 * QUIET_TBT:
        print(f"warning: decoding is {tbt0 / QUIET_TBT:.1f}x slower than on a quiet 2-core machine "
              "(is something else running?); the workload is shrunk to keep the run short, and "
              "results will be noisier")
    k = min(len(items), 2 * cfg.max_num_seqs)
    bulk = [Item(0.0, i.prompt_len, i.output_len) for i in items[:k]]
    recs, _ = run(bulk, prompts[:k], "calibrating saturation", args.run_seconds)
    ends = sorted(t[-1] for _, t in recs if t)
    sat = len(ends) / (ends[-1] - min(a for a, _ in recs)) if ends else 0.1
    return ttft_slo, tbt_slo, sat


# ---------------------------------------------------------------- the benchmark

def new_engine(label: str, args, cfg, model, tok, runs: int, rate=None, clock=None) -> Engine:
    """An engine for one run of policy `label` ('fcfs-swap#2' too), its schedule log named by
    the run (tools/schedlog.py)."""
    log = schedlog.log_name(args.log_base, label, rate, runs) if rate is not None else None
    return Engine(replace(cfg, policy=policy_of(label), log_path=log), model, tok, clock=clock)


def runner(pol: str, args, cfg, model, tok, hf, runs: int):
    """run(items, prompts, label, deadline, rate) -> (records, stats): one row of the table.
    `pol` may be a repeat's label, 'fcfs-swap#2' (policy_of)."""
    def engine(items, prompts, text, deadline, rate=None):
        e = new_engine(pol, args, cfg, model, tok, runs, rate)
        try:
            return serve(e, items, prompts, text, deadline)
        finally:
            e.close()
    if policy_of(pol) == "openai":
        return lambda *a, rate=None: client.serve(args.base_url, args.served_model, *a)
    if policy_of(pol) == "hf":
        return lambda *a, rate=None: serve_hf(hf, cfg, *a)
    return engine


def run_interleaved(labels: list[str], args, cfg, model, tok, runs: int, items, prompts,
                    rate: float) -> list[tuple[list, dict]]:
    """The engine runs of `labels` side by side on the same arrivals, step by step, each on its
    own clock (OwnClock): what each run's timeline would be online, with the machine's speed
    shared out evenly among them. On a GPU each step waits for its device work."""
    clocks, engines = [OwnClock() for _ in labels], []
    sync = resolve_device(cfg.device).type != "cpu"
    try:  # each engine is closed, however far this got
        for p, c in zip(labels, clocks):
            engines.append(new_engine(p, args, cfg, model, tok, runs, rate, c))
        return serve_interleaved([Replay(e, items, prompts, 2 * args.run_seconds, c, sync)
                                  for e, c in zip(engines, clocks)],
                                 f"{', '.join(labels)} @ {rate:.2f} req/s")
    finally:
        for e in engines:
            e.close()


def label_repeats(policies: list[str]) -> list[str]:
    """A policy named again runs again, labelled 'fcfs-swap#2', ...: the same policy twice on
    the same arrivals shows how far apart the machine alone puts two runs (the verdict's A/A
    line)."""
    seen: dict[str, int] = {}
    out = []
    for p in policies:
        seen[p] = seen.get(p, 0) + 1
        out.append(p if seen[p] == 1 else f"{p}#{seen[p]}")
    return out


def size_pool(cfg, items, args, verbose: bool) -> None:
    """A device pool of --pool-seqs mean requests (at least the largest one), unless given."""
    mean_len = statistics.mean(i.prompt_len + i.output_len for i in items)
    biggest = max(-(-(i.prompt_len + i.output_len) // cfg.block_size) for i in items)
    cfg.num_device_blocks = cfg.num_device_blocks or max(
        biggest, round(args.pool_seqs * mean_len / cfg.block_size))
    if args.swap_watermark is None:  # the released policy's watermark, scaled to the pool
        cfg.swap_watermark = max(4, cfg.num_device_blocks // 4)
    if verbose:
        print(f"KV pool: {cfg.num_device_blocks} device blocks of {cfg.block_size} tokens (about "
              f"{cfg.num_device_blocks * cfg.block_size / mean_len:.1f} mean requests), "
              f"{cfg.num_host_blocks} host blocks; <= {cfg.max_num_seqs} seqs and "
              f"{cfg.max_num_batched_tokens} tokens a step; B_xfer {cfg.xfer_budget} blocks, "
              f"released watermark {cfg.swap_watermark}")


def choose_rates(args, items, sat: float) -> tuple[list[float], int]:
    """The rates to run, and how many requests make about --run-seconds of work at each."""
    if args.rates:
        return args.rates, len(items)
    if args.time_scale is not None and args.trace != "none":  # the trace's own timing
        return [(len(items) - 1) / (items[-1].arrival - items[0].arrival)], len(items)
    n = max(12, min(len(items), round(args.run_seconds * sat)))
    return [round(sat * f, 2) for f in args.rate_factors], n


def bench_config(ap, args, **override):
    """The engine settings of the runs (the SLOs are measured later unless given)."""
    calibrated = {"ttft_slo": args.ttft_slo or 5.0, "tbt_slo": args.tbt_slo or 0.1}  # for now
    return engine_config(ap, args, **calibrated | override)


def run_serving(args, ap, results: list[dict]) -> None:
    """Every (repeat, rate, policy) run, each finished row appended to `results` as it
    completes. The SLOs and the rates are calibrated once, on the first repeat's workload."""
    cfg = bench_config(ap, args, policy="fcfs")
    local = [p for p in args.policies if p != "openai"]
    model, tok = load_model(cfg.model, cfg.device, cfg.dtype) if local else (None, None)
    torch.manual_seed(args.seed)
    vocab = model.cfg.vocab_size if model else args.vocab_size
    items, prompts, text = build_workload(args, vocab)
    print(f"workload: {text}")
    size_pool(cfg, items, args, verbose=bool(local))
    runs = len(args.policies) * max(1, len(args.rates or args.rate_factors)) * args.repeat
    hf = bench_speed.hf_model(cfg.model) if "hf" in args.policies else None
    calibrator = runner("fcfs" if local else "openai", args, cfg, model, tok, hf, runs)
    ttft_slo, tbt_slo, sat = calibrate(calibrator, items, prompts, cfg, args)
    cfg = replace(cfg, ttft_slo=ttft_slo, tbt_slo=tbt_slo)
    rates, n = choose_rates(args, items, sat)
    print(f"saturation {sat:.2f} req/s -> rates {rates}; {n} requests a run; {runs} runs of about "
          f"{n / max(sat, 1e-3):.0f} s each (each cut off at {2 * args.run_seconds:.0f} s)")
    base = settings(args, cfg, sat)
    for k in range(args.repeat):
        if k:
            items, prompts, text = build_workload(args, vocab, k)
            print(f"repeat {k + 1}/{args.repeat}: {text}")
        for rate in rates:
            timed = with_rate(items[:n], rate)
            for pol, (recs, stats) in run_rate(args, cfg, model, tok, hf, runs, timed, prompts,
                                               rate).items():
                kind = policy_of(pol)
                results.append(base | row(pol, rate, recs, stats, ttft_slo, tbt_slo, args)
                               | {"repeat": k, "seed": args.seed + k, "clock": args.clock,
                                  "trace_offset": args.trace_offset + k * args.num_requests})
                if args.validate_sim and kind not in ("hf", "openai"):
                    results[-1]["sim"] = validate_row(results[-1], timed,
                                                      replace(cfg, policy=kind), kind)
            judge_speed(results[-len(args.policies):], args, runs)


def run_rate(args, cfg, model, tok, hf, runs: int, items, prompts, rate: float) -> dict:
    """{label: (records, stats)} of every policy's run on these arrivals, in --policies order:
    one after the other on the wall clock, or (--clock own) the engine policies interleaved."""
    together = [p for p in args.policies if args.clock == "own"
                and policy_of(p) not in ("hf", "openai")]
    out = {}
    if together:
        mark = cpu_mark()
        res = run_interleaved(together, args, cfg, model, tok, runs, items, prompts, rate)
        other = other_cpu_share(mark)
        out = {p: (recs, stats | {"other_cpu": other}) for p, (recs, stats) in zip(together, res)}
    for pol in [p for p in args.policies if p not in together]:
        mark = cpu_mark()
        recs, stats = runner(pol, args, cfg, model, tok, hf, runs)(
            items, prompts, f"{pol} @ {rate:.2f} req/s", 2 * args.run_seconds, rate=rate)
        stats["other_cpu"] = None if policy_of(pol) == "openai" else other_cpu_share(mark)
        out[pol] = (recs, stats)
    return {p: out[p] for p in args.policies}


def judge_speed(rows: list[dict], args, runs: int) -> None:
    """Each row's `speed` among the runs of one rate and repeat, from their schedule logs: its
    step time over what the same work took across them (tools/schedlog.py's `speed`)."""
    paths = {r["policy"]: schedlog.log_name(args.log_base, r["policy"], r["rate"], runs)
             for r in rows if policy_of(r["policy"]) not in ("hf", "openai")}
    found = {p: schedlog.read(f) for p, f in paths.items() if f and os.path.exists(f)}
    speeds = schedlog.speed(found)
    for r in rows:
        r["speed"] = speeds.get(r["policy"])
    if speeds:
        print("  machine speed for the same work (step time / the runs' fitted cost): "
              + ", ".join(f"{p} {x:.3f}" for p, x in speeds.items()), flush=True)


def settings(args, cfg, sat: float) -> dict:
    """What a result row was run with, so that it can be judged on its own."""
    return {"hw": f"cpu: {platform.machine()}, {os.cpu_count()} cores, "
                  f"{torch.get_num_threads()} torch threads",
            "model": cfg.model or "SmolLM2-135M-Instruct (embedded)", "dtype": cfg.dtype,
            "trace": "none" if args.trace == "none" else os.path.basename(args.trace),
            "workload": args.workload, "burstiness": args.burstiness,
            "prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
            "num_device_blocks": cfg.num_device_blocks, "num_host_blocks": cfg.num_host_blocks,
            "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "saturation_req_s": sat}


def cpu_mark() -> tuple[float, float, float] | None:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process); None where
    /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    return time.perf_counter(), busy, t.user + t.system


def other_cpu_share(mark) -> float | None:
    """The share of all CPUs other processes used since `mark` (0.3 = 30% of the machine)."""
    now = cpu_mark()
    if mark is None or now is None or now[0] - mark[0] < 1.0:
        return None
    other = (now[1] - mark[1]) - (now[2] - mark[2])
    return max(0.0, other / ((now[0] - mark[0]) * (os.cpu_count() or 1)))


def row(pol, rate, recs, stats, ttft_slo, tbt_slo, args) -> dict:
    r = {"policy": pol, "rate": rate, **summarize(recs, ttft_slo, tbt_slo, args.tpot_slo),
         "ttft_slo_s": ttft_slo, "tbt_slo_s": tbt_slo}
    r |= {k: stats.get(k, 0) for k in ("rotations", "recomputes", "bytes_moved", "unfinished")}
    r["mean_step_ms"] = stats.get("mean_step_ms", math.nan)
    r["other_cpu"] = stats.get("other_cpu")
    r["disturbed"] = (r["other_cpu"] or 0) > DISTURBED
    cut = f", {r['unfinished']} cut off at the time cap" if r["unfinished"] else ""
    busy = f", DISTURBED: others used {r['other_cpu']:.0%} of the CPUs" if r["disturbed"] else ""
    print(f"  {pol:<24} {rate:5.2f} req/s: TTFT att {r['ttft_attainment']:6.1%}  TBT att "
          f"{r['tbt_attainment']:6.1%}  {r['throughput_tok_s']:6.1f} tok/s  rotations "
          f"{r['rotations']}  step {r['mean_step_ms']:.0f} ms{cut}{busy}", flush=True)
    return r


def validate_row(real: dict, items: list[Item], cfg, policy: str) -> dict:
    """The same workload through sim.py's `cpu` profile: how far is the cost model from here?"""
    cost = sim.CostModel(sim.MODELS["smollm2-135m"], sim.cpu_profile(), cfg.block_size,
                         device_blocks=cfg.num_device_blocks, host_blocks=cfg.num_host_blocks)
    reqs = [Request(f"v{i}", it.prompt_len, it.output_len, it.arrival)
            for i, it in enumerate(items)]
    r = sim.run_policy(policy, reqs, cost, cfg)
    print(f"  {'  sim (cpu profile)':<24}            TTFT att {r['ttft_attainment']:6.1%}  TBT att "
          f"{r['tbt_attainment']:6.1%}  {r['throughput_tok_s']:6.1f} tok/s  rotations "
          f"{r['rotations']}  step {r['mean_step_ms']:.0f} ms "
          f"({r['mean_step_ms'] / real['mean_step_ms'] - 1:+.0%})", flush=True)
    return {k: r[k] for k in ("ttft_attainment", "tbt_attainment", "throughput_tok_s", "rotations",
                              "mean_step_ms")}


# ---------------------------------------------------------------- command line

def parse_args(argv):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=None,
                    help="comma list: fcfs, priority, fcfs-swap, rotasched-lvf, rotasched, "
                         "rotasched-released; hf (HF transformers' continuous batching); openai "
                         "(the --base-url server). With parameters use ';' between policies: "
                         "'fcfs;rotasched:alpha=1'."
                         " A policy named twice runs twice (the second labelled 'fcfs-swap#2'):"
                         " the verdict's A/A line says how far apart the machine alone puts runs."
                         " Default: fcfs,fcfs-swap,rotasched; with --backend openai: openai")
    ap.add_argument("--rates", default=None, help="request rates (req/s); default: calibrated")
    ap.add_argument("--rate-factors", default="1.5", help="without --rates: multiples of the "
                    "measured saturation rate (default 1.5)")
    ap.add_argument("--run-seconds", type=float, default=50.0,
                    help="time target of a run: sizes the workload to about this much work and "
                         "cuts a run off at twice it (default 50)")
    ap.add_argument("--clock", default="wall", choices=["wall", "own"],
                    help="wall: the policies' runs one after the other, each online on the wall "
                         "clock; own: their steps interleaved, each run on its own clock that "
                         "runs only while it steps, so the machine's drifts in speed fall on all "
                         "alike (hf and openai rows still run on the wall clock)")
    add_workload_flags(ap)
    ap.add_argument("--pool-seqs", type=float, default=6.0,
                    help="without --num-device-blocks: a device pool of this many mean requests")
    ap.add_argument("--ttft-slo-factor", type=float, default=10.0, help="TTFT SLO / unloaded TTFT")
    ap.add_argument("--tbt-slo-factor", type=float, default=5.0, help="TBT SLO / unloaded TBT")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds, for goodput (TBT SLO)")
    ap.add_argument("--json", default=None, help="write one record per (policy, rate)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run everything N times, each with a fresh seed and the next slice of "
                         "the trace; prints min / median / max of each figure")
    ap.add_argument("--plot", default=None, help="PNG of attainment vs rate per policy")
    ap.add_argument("--validate-sim", action="store_true",
                    help="also run each workload through sim.py's cpu profile")
    ap.add_argument("--speed", action="store_true", help="tokens/s next to HF (bench_speed.py)")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (default: calibrated)")
    ap.add_argument("--tbt-slo", type=float, default=None, help="seconds (default: calibrated)")
    ap.add_argument("--backend", default="engine", choices=["engine", "openai"],
                    help="openai: replay against the OpenAI-compatible server at --base-url (the "
                         "row 'openai'; add engine policies to compare in one table)")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    ap.add_argument("--served-model", default=None,
                    help="model name to ask the server for (default: --model)")
    ap.add_argument("--vocab-size", type=int, default=32000,
                    help="prompt token ids are drawn below this when no model is loaded here")
    # a small pool and batch, so that a CPU sees KV pressure within minutes
    add_engine_flags(ap, skip=("policy", "ttft_slo", "tbt_slo", "seed"), max_num_seqs=16,
                     max_num_batched_tokens=256, num_host_blocks=4096)
    args = ap.parse_args(argv)
    check_args(ap, args)
    return ap, args


def add_workload_flags(ap) -> None:
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Azure-format trace CSV, or 'none'")
    ap.add_argument("--trace-offset", type=int, default=0, help="first request of the trace slice")
    ap.add_argument("--num-requests", type=int, default=48, help="most requests a run")
    ap.add_argument("--prompt-scale", type=float, default=0.15, help="trace prompt lengths x this")
    ap.add_argument("--output-scale", type=float, default=0.3, help="trace output lengths x this")
    ap.add_argument("--min-output", type=int, default=8, help="shortest scaled output (tokens)")
    ap.add_argument("--max-len", type=int, default=384, help="cap on scaled prompts and outputs")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="replay the trace's own timing stretched by this factor (not calibrated)")
    ap.add_argument("--workload", default="conv", choices=list(WORKLOADS),
                    help="conv: the trace's lengths; prefill-heavy: prompts x4, outputs x0.1; "
                         "decode-heavy: prompts x0.1, outputs x4 (before the scales below)")
    ap.add_argument("--burstiness", type=float, default=None,
                    help="gamma shape of the arrivals (1 = Poisson, 0.1 = bursty, CV 3.2); "
                         "default: the trace's own timing, Poisson for synthetic")
    ap.add_argument("--input-lens", default="64,128,256", help="synthetic prompt lengths")
    ap.add_argument("--output-lens", default="32,64,128", help="synthetic output lengths")
    ap.add_argument("--seed", type=int, default=0)


def check_args(ap, args) -> None:
    for name in ("run_seconds", "prompt_scale", "output_scale", "pool_seqs",
                 "ttft_slo_factor", "tbt_slo_factor"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    for name, lo in (("num_requests", 1), ("trace_offset", 0), ("min_output", 1), ("max_len", 1),
                     ("repeat", 1)):
        if getattr(args, name) < lo:
            ap.error(f"--{name.replace('_', '-')} must be >= {lo}")
    for name in ("ttft_slo", "tbt_slo", "tpot_slo", "time_scale", "burstiness"):
        if getattr(args, name, None) is not None and not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else None
        args.rate_factors = [float(f) for f in args.rate_factors.split(",")]
        args.input_lens = [int(x) for x in args.input_lens.split(",")]
        args.output_lens = [int(x) for x in args.output_lens.split(",")]
    except ValueError as e:
        ap.error(f"a comma list: {e}")
    values = (args.rates or []) + args.rate_factors + args.input_lens + args.output_lens
    if any(not x > 0 for x in values):
        ap.error("rates, rate factors and lengths must be > 0")
    if args.policies is None:
        args.policies = "openai" if args.backend == "openai" else "fcfs,fcfs-swap,rotasched"
    args.policies = label_repeats(sim.split_policies(args.policies))
    if args.backend == "openai" and "openai" not in args.policies:
        args.policies.insert(0, "openai")
    args.served_model = args.served_model or args.model
    local = [p for p in args.policies if p != "openai"]
    if not local:
        args.model = None  # a name on the server, not a checkpoint here
    for pol in local:
        if policy_of(pol) != "hf":
            bench_config(ap, args, policy=policy_of(pol))
    if args.trace != "none":
        try:
            n = len(read_trace(args.trace))
        except TraceError as e:
            ap.error(str(e))
        last = args.trace_offset + args.repeat * args.num_requests
        if last > n:
            ap.error(f"--trace-offset + --repeat x --num-requests ({last}) "
                     f"exceeds the trace's {n} requests")
    try:
        resolve_device(args.device)
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> None:
    ap, args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.speed:
        bench_speed.run_speed()
        return
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="superinfer-bench-") as tmp:
            args.log_base = args.log_path or os.path.join(tmp, "run.jsonl")  # speed from logs
            run_serving(args, ap, rows)
    except (ModelLoadError, TraceError) as e:
        sys.exit(f"bench: error: {e}")
    except KeyboardInterrupt:  # keep what finished; the run in progress is dropped
        print(f"\nbench: interrupted; {len(rows)} finished runs kept", file=sys.stderr)
        report(rows, args)
        sys.exit(130)
    report(rows, args)


def report(rows: list[dict], args) -> None:
    """The table and the verdict of the finished runs (per repeat), the spread over repeats;
    --json (every row, and with --repeat one file per repeat too) and --plot from them."""
    if not rows:
        return
    print_table(rows, (rows[0]["ttft_slo_s"], rows[0]["tbt_slo_s"]))
    repeats = sorted({r["repeat"] for r in rows})
    for k in repeats:
        for line in verdict([r for r in rows if r["repeat"] == k]):
            print(f"repeat {k + 1}: {line}" if len(repeats) > 1 else line)
    if len(repeats) > 1:
        print_spread(rows)
    if args.json:
        dump(rows, args.json)
        if len(repeats) > 1:
            for k in repeats:
                dump([r for r in rows if r["repeat"] == k], f"{args.json.removesuffix('.json')}"
                                                             f".r{k + 1}.json")
    if args.plot:
        plot(rows, args.plot, "SuperInfer reference engine")


def dump(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump([{k: r[k] for k in JSON_KEYS} | r for r in rows], f, indent=1)


SPREAD = (("TTFT att", "ttft_attainment", 100, "%"), ("TBT att", "tbt_attainment", 100, "%"),
          ("TBT p99", "tbt_p99_s", 1e3, " ms"), ("tok/s", "throughput_tok_s", 1, ""))


def print_spread(rows: list[dict]) -> None:
    """min / median / max over the repeats of each figure, per policy and rate (and the TTFT
    attainment gain over fcfs in the same repeat)."""
    print(f"\n== spread over {len({r['repeat'] for r in rows})} repeats: min / median / max ==")
    for pol in dict.fromkeys(r["policy"] for r in rows):
        for rate in sorted({r["rate"] for r in rows}):
            mine = [r for r in rows if r["policy"] == pol and r["rate"] == rate]
            if not mine:
                continue
            parts = [f"{name} " + " / ".join(f"{x * scale:.1f}" for x in spread(
                [r[key] for r in mine])) + unit for name, key, scale, unit in SPREAD]
            base = {r["repeat"]: r for r in rows if r["policy"] == "fcfs" and r["rate"] == rate}
            gains = [100 * (r["ttft_attainment"] - base[r["repeat"]]["ttft_attainment"])
                     for r in mine if r["repeat"] in base and pol != "fcfs"]
            if gains:
                parts.append("TTFT gain " + " / ".join(f"{g:+.1f}" for g in spread(gains)))
            print(f"{pol:<24} {rate:6.2f}: " + "; ".join(parts))


def spread(xs: list[float]) -> tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


if __name__ == "__main__":
    main()
