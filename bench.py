"""Side-by-side SLO benchmark: the same arrivals through each policy, served online on a wall clock.

    python bench.py                       # embedded model, Azure trace slice, fcfs vs rotasched
    python bench.py --rates 1,2,4 --policies fcfs,fcfs-swap,rotasched --json out.json --plot out.png
    python bench.py --speed               # model and engine tokens/s next to HF (bench_speed.py)
    python bench.py --sim gh200           # the GPU-scale simulator (sim.py)

Metrics follow vLLM's benchmark_serving: TTFT = first token - arrival, TBT = every gap between
consecutive tokens (pooled over requests, as the paper's client does), TPOT = (e2e - TTFT)/(n - 1),
goodput = requests/s meeting both the TTFT and TPOT SLOs.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "data", "azure_llm_2023_conv.csv")
JSON_KEYS = ("policy", "rate", "num_requests", "ttft_attainment", "tbt_attainment", "goodput_req_s",
             "throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "rotations", "bytes_moved")


# ---------------------------------------------------------------- workloads

@dataclass(slots=True)
class Item:
    arrival: float      # seconds from the start of the run
    prompt_len: int
    output_len: int


class TraceError(ValueError):
    """A malformed trace file; the message names the file and line."""


def read_trace(path: str) -> list[tuple[float, int, int]]:
    """Azure LLM inference trace rows (TIMESTAMP,ContextTokens,GeneratedTokens) as (seconds, in, out)."""
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise TraceError(f"{path}:1: expected header TIMESTAMP,ContextTokens,GeneratedTokens, got {header}")
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                stamp, ctx, gen = row[0].strip(), int(row[1]), int(row[2])
                t = datetime.strptime(stamp[:26], "%Y-%m-%d %H:%M:%S.%f" if "." in stamp else "%Y-%m-%d %H:%M:%S")
            except (ValueError, IndexError) as e:
                raise TraceError(f"{path}:{line}: cannot parse {','.join(row)!r} ({e})") from None
            if ctx < 1 or gen < 1:
                raise TraceError(f"{path}:{line}: token counts must be >= 1, got {ctx},{gen}")
            rows.append((t.timestamp(), ctx, gen))
    if not rows:
        raise TraceError(f"{path}: no requests")
    t0 = rows[0][0]
    if any(b[0] < a[0] for a, b in zip(rows, rows[1:])):
        raise TraceError(f"{path}: timestamps are not in order")
    return [(t - t0, c, g) for t, c, g in rows]


def trace_workload(rows, num: int, offset: int = 0, length_scale: float = 1.0, max_len: int | None = None,
                   rate: float | None = None, time_scale: float = 1.0) -> list[Item]:
    """A slice of a trace; lengths scaled (and capped); arrivals rescaled to `rate` if given, keeping the
    trace's burstiness, else stretched by time_scale."""
    part = rows[offset:offset + num]
    if len(part) < num:
        raise ValueError(f"trace has {len(rows)} requests; cannot take {num} from offset {offset}")
    t0 = part[0][0]
    span = max(part[-1][0] - t0, 1e-9)
    scale = (len(part) - 1) / span / rate if rate else time_scale
    cap = max_len or 10**9
    return [Item((t - t0) * scale, max(1, min(cap, round(c * length_scale))), max(1, min(cap, round(g * length_scale))))
            for t, c, g in part]


def synthetic_workload(num: int, rate: float, burstiness: float, prompt_lens, output_lens, seed: int) -> list[Item]:
    """Gamma inter-arrivals (burstiness 1.0 = Poisson) and lengths drawn from the given lists."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(Item(t, rng.choice(prompt_lens), rng.choice(output_lens)))
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def with_rate(items: list[Item], rate: float) -> list[Item]:
    """The same requests and arrival pattern, time-scaled to an average of `rate` requests/s."""
    span = items[-1].arrival - items[0].arrival
    scale = (len(items) - 1) / span / rate if span > 0 else 1.0
    return [Item((i.arrival - items[0].arrival) * scale, i.prompt_len, i.output_len) for i in items]


def synthetic_prompts(items: list[Item], vocab: int, seed: int) -> list[list[int]]:
    """Prompt token ids of exactly the requested lengths (ordinary tokens, no specials)."""
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)
    return [[rng.randrange(lo, vocab) for _ in range(it.prompt_len)] for it in items]


# ---------------------------------------------------------------- metrics

def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list[tuple[float, list[float]]], ttft_slo: float, tbt_slo: float,
              tpot_slo: float | None = None) -> dict:
    """records: (arrival, token times) per request. TPOT SLO defaults to the TBT SLO."""
    tpot_slo = tbt_slo if tpot_slo is None else tpot_slo
    ttft, tbt, e2e, good, n_tok = [], [], [], 0, 0
    for arrival, times in records:
        if not times:
            continue
        t1 = times[0] - arrival
        gaps = [b - a for a, b in zip(times, times[1:])]
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        ttft.append(t1)
        tbt += gaps
        e2e.append(times[-1] - arrival)
        n_tok += len(times)
        good += t1 <= ttft_slo and tpot <= tpot_slo
    start = min(a for a, _ in records)
    end = max((t[-1] for _, t in records if t), default=start)
    duration = max(end - start, 1e-9)
    n = len(records)
    stat = lambda name, xs: {f"{name}_mean_s": sum(xs) / len(xs) if xs else float("nan"),
                             f"{name}_p50_s": percentile(xs, 50), f"{name}_p99_s": percentile(xs, 99)}
    return {"num_requests": n, "duration_s": duration, **stat("ttft", ttft), **stat("tbt", tbt), **stat("e2e", e2e),
            "ttft_attainment": sum(x <= ttft_slo for x in ttft) / n if n else float("nan"),
            "tbt_attainment": sum(g <= tbt_slo for g in tbt) / len(tbt) if tbt else 1.0,
            "goodput_req_s": good / duration, "throughput_tok_s": n_tok / duration,
            "request_throughput": n / duration}


# ---------------------------------------------------------------- serving loops

class Progress:
    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled, self.t0 = label, total, enabled and sys.stderr.isatty(), time.time()

    def update(self, done: int) -> None:
        if self.enabled:
            bar = "#" * int(30 * done / self.total)
            sys.stderr.write(f"\r{self.label:<24} [{bar:<30}] {done}/{self.total} {time.time() - self.t0:5.0f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def serve(engine, items: list[Item], prompts: list[list[int]], label: str = "") -> tuple[list, dict]:
    """Online serving: requests join the running engine at their arrival times (wall clock)."""
    from superinfer import SamplingParams
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    t0 = time.perf_counter() + 0.01
    rids, nxt, prog = [], 0, Progress(label, len(items))
    done, busy = 0, 0.0
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter()
        while nxt < len(order) and t0 + items[order[nxt]].arrival <= now:
            i = order[nxt]
            rids.append(engine.add_request(prompts[i], SamplingParams(max_tokens=items[i].output_len, temperature=0,
                                                                      ignore_eos=True), arrival_time=t0 + items[i].arrival))
            nxt += 1
        if engine.has_unfinished():
            t = time.perf_counter()
            done += sum(ev.finished for ev in engine.step())
            busy += time.perf_counter() - t
            prog.update(done)
        elif nxt < len(order):
            time.sleep(max(0.0, t0 + items[order[nxt]].arrival - time.perf_counter()))
    prog.close()
    records = []
    for rid in rids:
        o = engine.output(rid)
        records.append((o.metrics.arrival_time, o.metrics.token_times))
    stats = engine.stats()
    return records, stats | {"mean_step_ms": 1e3 * busy / max(1, stats["steps"])}


def hf_manager(hf, max_new_tokens: int, max_num_seqs: int, max_tokens: int, block_size: int | None = None,
               num_blocks: int | None = None):
    """A started HF transformers continuous-batching manager: greedy, no EOS, our batch limits."""
    import logging
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(max_batch_tokens=max_tokens, max_requests_per_batch=max_num_seqs,
                                   **({"page_size": block_size, "num_blocks": num_blocks} if block_size else {}))
    mgr = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    return mgr


def hf_model(path: str | None):
    """transformers.LlamaForCausalLM (fp32) on the same weights as our model at `path`."""
    import torch
    from model import embedded_gguf_path, hf_reference, read_gguf
    if path is None or path.endswith(".gguf"):
        return hf_reference(*read_gguf(path or embedded_gguf_path()))
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()


def serve_hf(hf, items: list[Item], prompts: list[list[int]], num_blocks: int, block_size: int,
             max_num_seqs: int, max_tokens: int, label: str = "") -> list:
    """The same arrivals through HF transformers' own continuous batching (its background thread)."""
    mgr = hf_manager(hf, max(i.output_len for i in items), max_num_seqs, max_tokens, block_size, num_blocks)
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    t0 = time.perf_counter() + 0.01
    arrivals, results, prog = {}, {}, Progress(label, len(items))
    try:
        for i in order:
            time.sleep(max(0.0, t0 + items[i].arrival - time.perf_counter()))
            arrivals[str(i)] = t0 + items[i].arrival
            mgr.add_request(prompts[i], request_id=str(i), max_new_tokens=items[i].output_len, record_timestamps=True)
            while (r := mgr.get_result(timeout=0)) is not None:
                results[r.request_id] = r
                prog.update(len(results))
        while len(results) < len(items):
            r = mgr.get_result(timeout=1.0)
            if r is None and not mgr.is_running():
                break
            if r is not None:
                results[r.request_id] = r
                prog.update(len(results))
    finally:
        mgr.stop(block=True)
        hf.destroy_cached_continuous_batching_manager()
        prog.close()
    return [(arrivals[k], list(results[k].timestamps or []) if k in results else []) for k in arrivals]


# ---------------------------------------------------------------- report

def print_table(rows: list[dict], slos: tuple[float, float]) -> None:
    print(f"\n{'=' * 30} Serving benchmark (TTFT SLO {slos[0]:.2f}s, TBT SLO {slos[1] * 1e3:.0f}ms) {'=' * 30}")
    head = (f"{'policy':<20}{'rate':>6}{'reqs':>5}{'dur s':>7} | {'TTFT mean/p50/p99 s':>21} | "
            f"{'TBT mean/p50/p99 ms':>20} | {'E2E p50/p99 s':>14} | {'TTFT att':>8}{'TBT att':>8}"
            f"{'goodput':>8}{'tok/s':>7}{'rot':>6}{'MB moved':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['policy']:<20}{r['rate']:6.2f}{r['num_requests']:5d}{r['duration_s']:7.1f} | "
              f"{r['ttft_mean_s']:6.2f} {r['ttft_p50_s']:6.2f} {r['ttft_p99_s']:7.2f} | "
              f"{r['tbt_mean_s'] * 1e3:6.0f} {r['tbt_p50_s'] * 1e3:6.0f} {r['tbt_p99_s'] * 1e3:6.0f} | "
              f"{r['e2e_p50_s']:6.1f} {r['e2e_p99_s']:7.1f} | {r['ttft_attainment']:8.1%}{r['tbt_attainment']:8.1%}"
              f"{r['goodput_req_s']:8.2f}{r['throughput_tok_s']:7.1f}{r['rotations']:6d}{r['bytes_moved'] / 2**20:9.1f}")


def verdict(rows: list[dict], base: str = "fcfs", ours: str = "rotasched") -> list[str]:
    lines = []
    for rate in sorted({r["rate"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["rate"] == rate}
        if base in by and ours in by:
            b, o = by[base], by[ours]
            lines.append(f"rate {rate:.2f}/s: {ours} TTFT attainment {o['ttft_attainment']:.1%} vs {base} "
                         f"{b['ttft_attainment']:.1%} ({100 * (o['ttft_attainment'] - b['ttft_attainment']):+.1f} points)")
            lines.append(f"rate {rate:.2f}/s: TBT attainment {100 * (o['tbt_attainment'] - b['tbt_attainment']):+.1f} "
                         f"points, throughput {o['throughput_tok_s'] / b['throughput_tok_s'] - 1:+.1%}")
    return lines


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "ttft_attainment", "TTFT SLO attainment"),
                          (axes[1], "tbt_attainment", "TBT SLO attainment")):
        for pol in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == pol)
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=pol)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- the real-engine benchmark

def run_serving(args) -> list[dict]:
    import torch
    from sim import split_policies
    from model import load_model
    from superinfer import Engine
    torch.manual_seed(args.seed)
    model, tok = load_model(args.model, args.device, args.dtype)
    vocab = model.cfg.vocab_size
    if args.trace != "none":
        rows = read_trace(args.trace)
        items = trace_workload(rows, args.num_requests, args.trace_offset, args.length_scale, args.max_len,
                               time_scale=args.time_scale or 1.0)
        src = (f"trace {os.path.basename(args.trace)} requests [{args.trace_offset}, "
               f"{args.trace_offset + args.num_requests}), lengths x{args.length_scale} (cap {args.max_len})")
    else:
        lens = [int(x) for x in args.input_lens.split(",")], [int(x) for x in args.output_lens.split(",")]
        items = synthetic_workload(args.num_requests, 1.0, args.burstiness, *lens, args.seed)
        src = f"synthetic: prompt lengths {args.input_lens}, output lengths {args.output_lens}"
    prompts = synthetic_prompts(items, vocab, args.seed)
    engine_kw = dict(block_size=args.block_size, num_host_blocks=args.host_blocks,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens)
    mean_len = sum(i.prompt_len + i.output_len for i in items) / len(items)
    dev_blocks = args.device_blocks or max(
        max(-(-(i.prompt_len + i.output_len) // args.block_size) for i in items),
        round(args.pool_seqs * mean_len / args.block_size))
    engine_kw["num_device_blocks"] = dev_blocks
    print(f"workload: {src}; {len(items)} requests, mean prompt {sum(i.prompt_len for i in items) / len(items):.0f}, "
          f"mean output {sum(i.output_len for i in items) / len(items):.0f} tokens")
    print(f"KV pool: {dev_blocks} device blocks x {args.block_size} tokens (~{dev_blocks * args.block_size / mean_len:.1f} "
          f"mean requests), {args.host_blocks} host blocks; batch <= {args.max_num_seqs} seqs, "
          f"{args.max_batched_tokens} tokens/step")

    # calibration: unloaded latency -> default SLOs; bulk throughput -> the saturation rate
    med = sorted(items, key=lambda i: i.prompt_len)[len(items) // 2]
    serve(Engine(model, tok, policy="fcfs", **engine_kw), [Item(0.0, 16, 4)], [[1000] * 16])  # warm-up
    recs, _ = serve(Engine(model, tok, policy="fcfs", **engine_kw), [Item(0.0, med.prompt_len, 16)],
                    synthetic_prompts([med], vocab, 1))
    ttft0 = recs[0][1][0] - recs[0][0]
    tbt0 = (recs[0][1][-1] - recs[0][1][0]) / (len(recs[0][1]) - 1)
    ttft_slo = args.ttft_slo or round(args.ttft_slo_factor * ttft0, 2)
    tbt_slo = args.tbt_slo or round(args.tbt_slo_factor * tbt0, 3)
    print(f"unloaded: TTFT {ttft0:.3f}s (prompt {med.prompt_len}), TBT {tbt0 * 1e3:.1f}ms -> "
          f"SLOs: TTFT {ttft_slo:.2f}s ({'given' if args.ttft_slo else f'{args.ttft_slo_factor:g}x'}), "
          f"TBT {tbt_slo * 1e3:.0f}ms ({'given' if args.tbt_slo else f'{args.tbt_slo_factor:g}x'})")
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    elif args.time_scale is not None and args.trace != "none":  # the trace's own timing, stretched
        rates = [(len(items) - 1) / (items[-1].arrival - items[0].arrival)]
        print(f"trace time x{args.time_scale:g}: {rates[0]:.2f} req/s")
    else:
        k = min(len(items), 2 * args.max_num_seqs)
        bulk = [Item(0.0, i.prompt_len, i.output_len) for i in items[:k]]
        recs, _ = serve(Engine(model, tok, policy="fcfs", **engine_kw), bulk, prompts[:k], "calibrating")
        sat = k / (max(t[-1] for _, t in recs) - min(a for a, _ in recs))
        factors = [float(f) for f in args.rate_factors.split(",")]
        rates = [round(sat * f, 2) for f in factors]
        print(f"saturation: {sat:.2f} req/s ({k} requests at once, fcfs) -> rates {rates} "
              f"(x{', x'.join(args.rate_factors.split(','))})")
    sched_kw = dict(ttft_slo=ttft_slo, tbt_slo=tbt_slo, xfer_budget=args.xfer_budget)
    results, hf = [], None
    for rate in rates:
        timed = with_rate(items, rate)
        for pol in split_policies(args.policies):
            if pol == "hf":
                hf = hf or hf_model(args.model)
                recs = serve_hf(hf, timed, prompts, dev_blocks, args.block_size, args.max_num_seqs,
                                args.max_batched_tokens, f"hf @ {rate}/s")
                stats = {"rotations": 0, "bytes_moved": 0}
            else:
                eng = Engine(model, tok, policy=pol, **engine_kw, **sched_kw)  # name may carry parameters
                recs, stats = serve(eng, timed, prompts, f"{pol} @ {rate}/s")
            row = {"policy": pol, "rate": rate, **summarize(recs, ttft_slo, tbt_slo, args.tpot_slo or tbt_slo),
                   "rotations": stats["rotations"], "bytes_moved": stats["bytes_moved"],
                   "mean_step_ms": stats.get("mean_step_ms", float("nan"))}
            results.append(row)
            print(f"  {pol:<20} rate {rate:5.2f}: TTFT att {row['ttft_attainment']:6.1%}  TBT att "
                  f"{row['tbt_attainment']:6.1%}  {row['throughput_tok_s']:6.1f} tok/s  rotations {row['rotations']}"
                  f"  step {row['mean_step_ms']:.0f}ms", flush=True)
            if args.validate_sim and pol != "hf":
                results[-1]["sim"] = validate_row(row, timed, dev_blocks, args, ttft_slo, tbt_slo)
    print_table(results, (ttft_slo, tbt_slo))
    for line in verdict(results):
        print(line)
    return results


def validate_row(real: dict, items: list[Item], dev_blocks: int, args, ttft_slo: float, tbt_slo: float) -> dict:
    """The same workload through sim.py's `cpu` profile: how far is the cost model from this machine?"""
    import sim
    from sched import Request
    if not hasattr(validate_row, "cost"):
        validate_row.cost = sim.CostModel(sim.MODELS["smollm2-135m"], sim.cpu_profile(), args.block_size,
                                          device_blocks=dev_blocks, host_blocks=args.host_blocks)
    reqs = [Request(f"v{i}", it.prompt_len, it.output_len, it.arrival) for i, it in enumerate(items)]
    row = sim.run_policy(real["policy"], reqs, validate_row.cost, ttft_slo=ttft_slo, tbt_slo=tbt_slo,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                         xfer_budget=args.xfer_budget)
    print(f"  {'  sim (cpu profile)':<20}            TTFT att {row['ttft_attainment']:6.1%}  TBT att "
          f"{row['tbt_attainment']:6.1%}  {row['throughput_tok_s']:6.1f} tok/s  rotations {row['rotations']}"
          f"  step {row['mean_step_ms']:.0f}ms ({row['mean_step_ms'] / real['mean_step_ms'] - 1:+.0%})", flush=True)
    return {k: row[k] for k in ("ttft_attainment", "tbt_attainment", "throughput_tok_s", "rotations", "mean_step_ms")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="fcfs,rotasched",
                    help="comma list: fcfs, fcfs-swap, priority, rotasched, rotasched-released, hf (HF transformers); "
                         "with parameters use ';' between policies: 'fcfs;rotasched:alpha=1,quantum=0.5'")
    ap.add_argument("--rates", default=None, help="request rates to sweep (req/s); default: calibrated around saturation")
    ap.add_argument("--rate-factors", default="1.5", help="without --rates: rates as multiples of the measured saturation")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Azure-format trace CSV, or 'none' for synthetic")
    ap.add_argument("--trace-offset", type=int, default=0, help="first request of the trace slice")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--length-scale", type=float, default=0.15, help="multiply trace lengths (CPU scale)")
    ap.add_argument("--max-len", type=int, default=384, help="cap on scaled prompt and output lengths")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="replay the trace's own timing stretched by this factor (instead of calibrated rates)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="synthetic: gamma shape (1 = Poisson)")
    ap.add_argument("--input-lens", default="64,128,256")
    ap.add_argument("--output-lens", default="32,64,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=None, help="KV device pool size in blocks")
    ap.add_argument("--pool-seqs", type=float, default=6.0,
                    help="without --device-blocks: size the device pool to this many mean-length requests")
    ap.add_argument("--host-blocks", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=256)
    ap.add_argument("--xfer-budget", type=int, default=2400, help="blocks moved per step (B_xfer)")
    ap.add_argument("--ttft-slo", type=float, default=None, help="seconds (default: factor x unloaded TTFT)")
    ap.add_argument("--tbt-slo", type=float, default=None, help="seconds (default: factor x unloaded TBT)")
    ap.add_argument("--tpot-slo", type=float, default=None, help="seconds, for goodput (default: the TBT SLO)")
    ap.add_argument("--ttft-slo-factor", type=float, default=10.0)
    ap.add_argument("--tbt-slo-factor", type=float, default=5.0)
    ap.add_argument("--json", default=None, help="write one record per (policy, rate)")
    ap.add_argument("--plot", default=None, help="PNG of attainment vs rate per policy (needs matplotlib)")
    ap.add_argument("--speed", action="store_true", help="model and engine tokens/s next to HF transformers")
    ap.add_argument("--speed-prompt", type=int, default=128)
    ap.add_argument("--speed-requests", type=int, default=32)
    ap.add_argument("--sim", default=None, metavar="HW", help="simulate on a hardware profile (see sim.py)")
    ap.add_argument("--validate-sim", action="store_true",
                    help="also run each workload through sim.py's cpu profile and report the difference")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--sim" in argv:  # everything else goes to sim.py's own options
        import sim
        i = argv.index("--sim")
        if i + 1 >= len(argv):
            ap.error("--sim needs a hardware profile, e.g. --sim gh200")
        return sim.main(["--hw", argv[i + 1]] + argv[:i] + argv[i + 2:])
    args = ap.parse_args(argv)
    if args.speed:
        import bench_speed
        bench_speed.run_speed(args.speed_prompt, args.speed_requests)
        return
    rows = run_serving(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: r[k] for k in JSON_KEYS} | {k: v for k, v in r.items() if k not in JSON_KEYS}
                       for r in rows], f, indent=1)
    if args.plot:
        plot(rows, args.plot, "SuperInfer reference engine (CPU, embedded SmolLM2-135M)")


if __name__ == "__main__":
    main()
