"""Side-by-side SLO benchmark: the same arrivals through each policy, served online.

    python bench.py                     the embedded model, an Azure trace slice: fcfs,
                                        fcfs-swap, rotasched; one table and a verdict
    python bench.py --repeat 3 --json r.json --plot r.png
    python bench.py --policies fcfs,fcfs-swap,rotasched-lvf,rotasched,rotasched-released
    python bench.py --workload prefill-heavy --burstiness 0.1
    python bench.py --backend openai --base-url http://127.0.0.1:8000 --policies openai,rotasched
                                        a server (ours, vLLM, ...) and the engine here, one table
    python bench.py --clock own         the policies' runs interleaved step by step, each on a
                                        clock of its own: the machine's drifts fall on all alike

The run calibrates itself (unloaded latency gives the SLOs, a bulk run the saturation rate) and
sizes the workload to a time target per run, so a slow machine runs fewer requests, not longer.
Metrics are vLLM benchmark_serving's (workload/metrics.py). Each run's schedule log also gives
the machine's speed for the same work (tools/schedlog.py), and the verdict says whether the
runs were level.
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
from dataclasses import replace

import torch

from model import ModelLoadError
from serving import client
from superinfer import Engine, Parser, add_engine_flags, engine_config
from tools import schedlog, sim
from weights.loader import load_model, resolve_device
from workload.metrics import (caching_of, plot, policy_of, print_spread, print_table,
                              summarize, verdict)
from workload.replay import OwnClock, Replay, serve, serve_interleaved
from workload.trace import (Item, TraceError, add_workload_flags, build_workload, count_requests,
                            synthetic_prompts, with_rate)

JSON_KEYS = ("policy", "rate", "num_requests", "ttft_attainment", "tbt_attainment", "goodput_req_s",
             "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "rotations",
             "bytes_moved")


# ---------------------------------------------------------------- workload and calibration

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
    caching = caching_of(label) or cfg.prefix_caching
    return Engine(replace(cfg, policy=policy_of(label), prefix_caching=caching, log_path=log),
                  model, tok, clock=clock)


def runner(pol: str, args, cfg, model, tok, runs: int):
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
    calibrator = runner("fcfs" if local else "openai", args, cfg, model, tok, runs)
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
            for pol, (recs, stats) in run_rate(args, cfg, model, tok, runs, timed, prompts,
                                               rate).items():
                results.append(base | row(pol, rate, recs, stats, ttft_slo, tbt_slo, args)
                               | {"repeat": k, "seed": args.seed + k, "clock": args.clock,
                                  "trace_offset": args.trace_offset + k * args.num_requests})
            judge_speed(results[-len(args.policies):], args, runs)


def run_rate(args, cfg, model, tok, runs: int, items, prompts, rate: float) -> dict:
    """{label: (records, stats)} of every policy's run on these arrivals, in --policies order:
    one after the other on the wall clock, or (--clock own) the engine policies interleaved."""
    together = [p for p in args.policies if args.clock == "own" and policy_of(p) != "openai"]
    out = {}
    if together:
        res = run_interleaved(together, args, cfg, model, tok, runs, items, prompts, rate)
        out = dict(zip(together, res))
    for pol in [p for p in args.policies if p not in together]:
        out[pol] = runner(pol, args, cfg, model, tok, runs)(
            items, prompts, f"{pol} @ {rate:.2f} req/s", 2 * args.run_seconds, rate=rate)
    return {p: out[p] for p in args.policies}


def judge_speed(rows: list[dict], args, runs: int) -> None:
    """Each row's `speed` among the runs of one rate and repeat, from their schedule logs: its
    step time over what the same work took across them (tools/schedlog.py's `speed`)."""
    paths = {r["policy"]: schedlog.log_name(args.log_base, r["policy"], r["rate"], runs)
             for r in rows if policy_of(r["policy"]) != "openai"}
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


def row(pol, rate, recs, stats, ttft_slo, tbt_slo, args) -> dict:
    r = {"policy": pol, "rate": rate, **summarize(recs, ttft_slo, tbt_slo, args.tpot_slo),
         "ttft_slo_s": ttft_slo, "tbt_slo_s": tbt_slo}
    r |= {k: stats.get(k, 0) for k in ("rotations", "recomputes", "bytes_moved", "unfinished")}
    r["mean_step_ms"] = stats.get("mean_step_ms", math.nan)
    cut = f", {r['unfinished']} cut off at the time cap" if r["unfinished"] else ""
    print(f"  {pol:<24} {rate:5.2f} req/s: TTFT att {r['ttft_attainment']:6.1%}  TBT att "
          f"{r['tbt_attainment']:6.1%}  {r['throughput_tok_s']:6.1f} tok/s  rotations "
          f"{r['rotations']}  step {r['mean_step_ms']:.0f} ms{cut}", flush=True)
    return r


# ---------------------------------------------------------------- command line

def parse_args(argv):
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default=None,
                    help="comma list: fcfs, priority, fcfs-swap, rotasched-lvf, rotasched, "
                         "rotasched-released; openai (the --base-url server). With parameters "
                         "use ';' between policies: 'fcfs;rotasched:alpha=1'."
                         " A policy named twice runs twice (the second labelled 'fcfs-swap#2'):"
                         " the verdict's A/A line says how far apart the machine alone puts runs."
                         " 'rotasched@device' runs with that prefix caching (off, device,"
                         " both), judged against 'fcfs@device'."
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
                         "alike (an openai row still runs on the wall clock)")
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
        bench_config(ap, args, policy=policy_of(pol),
                     prefix_caching=caching_of(pol) or args.prefix_caching)
    if args.trace != "none":
        try:
            n = count_requests(args.trace)
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
    --json (every row) and --plot from them."""
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
    if args.plot:
        plot(rows, args.plot, "SuperInfer reference engine")


def dump(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump([{k: r[k] for k in JSON_KEYS} | r for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
