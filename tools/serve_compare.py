"""Serving under load next to `vllm serve`: same client, same arrivals, same KV capacity.

    python -m tools.serve_compare --vllm-python /path/to/vllm-venv/bin/python

For --runs rounds it starts each server in turn (vLLM's OpenAI server on its CPU backend; ours
with fcfs, the like-for-like row, and with rotasched), replays the same Poisson arrivals with the
shipped trace's lengths (scaled as bench.py scales them) at each --rates, measures on the client
side (serving/client.py, as bench.py --backend openai does), and stops it. Both sides get
--kv-gib of KV cache (ours as that many fp32 blocks, vLLM through VLLM_CPU_KVCACHE_SPACE) and
their OpenMP threads on every core. Prints TTFT mean/p99, TBT p50/p99, attainments, goodput and
tok/s per server and rate (median over the rounds, with the range), and writes --json.
See tools/speed_compare.py for setting up vllm-cpu. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request

from workload.trace import WORKLOADS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "smollm2"
WARM_UP = 18  # the trace slice (x 1,000 requests) the warm-up requests come from
FIGURES = (("TTFT mean s", "ttft_mean_s", 1), ("TTFT p99 s", "ttft_p99_s", 1),
           ("TBT p50 ms", "tbt_p50_s", 1e3), ("TBT p99 ms", "tbt_p99_s", 1e3),
           ("TTFT att %", "ttft_attainment", 100), ("TBT att %", "tbt_attainment", 100),
           ("goodput/s", "goodput_req_s", 1), ("tok/s", "throughput_tok_s", 1))


def server_command(spec: str, args, port: int) -> tuple[list[str], dict]:
    """`vllm`, or `ours-POLICY` and, optionally, more options for our server after it."""
    kind, *extra = shlex.split(spec)
    threads = f"0-{(os.cpu_count() or 1) - 1}"
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": threads, "PYTHONPATH": ROOT,
                        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib)}
    if kind == "vllm":  # its own block size: its CPU attention takes only multiples of 32 tokens
        return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                args.ckpt, "--served-model-name", NAME, "--dtype", "float32", "--port",
                str(port), "--max-model-len", "2048"], env
    blocks = int(args.kv_gib * 2**30) // (30 * 2 * 16 * 3 * 64 * 4)  # fp32 SmolLM2 blocks
    return [sys.executable, "superinfer.py", "serve", "--model", args.ckpt, "--port", str(port),
            "--served-model-name", NAME, "--policy", kind.removeprefix("ours-"),
            "--num-device-blocks", str(blocks), "--ttft-slo", str(args.ttft_slo),
            "--tbt-slo", str(args.tbt_slo)] + shlex.split(args.ours_args) + extra, env


def start(kind: str, args, port: int) -> subprocess.Popen:
    cmd, env = server_command(kind, args, port)
    log = open(os.path.join(args.logs, "_".join(shlex.split(kind)) + ".log"), "a")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    end = time.time() + 600
    while time.time() < end and proc.poll() is None:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{kind} did not start; see {log.name}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def workload(args, rate: float, k: int):
    """Arrivals at `rate` from slice k of the trace (seed k), slices 1,000 requests apart, so
    every (round, rate) measures other requests. That no server finds a run's prompts in its
    prefix cache is the client's doing (serving/client.py marks each run's prompts)."""
    from workload.trace import add_workload_flags, build_workload, with_rate
    n = max(8, round(args.seconds * rate))
    ap = argparse.ArgumentParser()
    add_workload_flags(ap)
    b = ap.parse_args(["--num-requests", str(n), "--burstiness", "1", "--seed", str(k),
                       "--trace-offset", str(k * 1000), "--workload", args.workload])
    b.input_lens, b.output_lens = [64, 128, 256], [32, 64, 128]
    items, prompts, _ = build_workload(b, 49152, 0)
    return with_rate(items, rate), prompts


def run_server(kind: str, args, k: int, rows: list[dict]) -> None:
    from serving.client import serve
    from workload.metrics import summarize
    proc = start(kind, args, args.port)
    try:
        base = f"http://127.0.0.1:{args.port}"
        items, prompts = workload(args, 1.0, WARM_UP)  # not a measured slice
        serve(base, NAME, items[:2], prompts[:2], "warm-up", 120)
        for j, rate in enumerate(args.rates):
            items, prompts = workload(args, rate, k * len(args.rates) + j)
            recs, stats = serve(base, NAME, items, prompts, f"{kind} @ {rate} req/s",
                                4 * args.seconds)
            row = summarize(recs, args.ttft_slo, args.tbt_slo) | stats
            rows.append(row | {"server": kind, "rate": rate, "round": k,
                               "kv_gib": args.kv_gib, "ttft_slo_s": args.ttft_slo,
                               "workload": args.workload,
                               "ours_args": args.ours_args if kind != "vllm" else "",
                               "tbt_slo_s": args.tbt_slo})
            print(f"round {k + 1} {kind:<14} {rate:4g} req/s: " + ", ".join(
                f"{name} {row[key] * s:.2f}" for name, key, s in FIGURES), flush=True)
    finally:
        stop(proc)


def report(rows: list[dict]) -> None:
    w = max([15] + [len(r["server"]) + 1 for r in rows])
    print(f"\n{'server':<{w}}{'rate':>5} " + "  ".join(f"{name:>18}" for name, _, _ in FIGURES))
    for kind in dict.fromkeys(r["server"] for r in rows):
        for rate in sorted({r["rate"] for r in rows}):
            mine = [r for r in rows if r["server"] == kind and r["rate"] == rate]
            if not mine:
                continue
            cells = []
            for _, key, s in FIGURES:
                xs = [r[key] * s for r in mine]
                cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
            print(f"{kind:<{w}}{rate:5g} " + "  ".join(f"{c:>18}" for c in cells))


def checked(ap: argparse.ArgumentParser, args) -> list[str]:
    """Validate the options (a mistake is one line, before any server starts); the servers."""
    try:
        args.rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates must be numbers separated by commas, got {args.rates!r}")
    if min(args.rates) <= 0 or args.runs < 1 or args.seconds <= 0:
        ap.error("--rates, --runs and --seconds must be positive")
    if args.runs * len(args.rates) > WARM_UP or max(args.rates) * args.seconds > 1000:
        ap.error(f"at most {WARM_UP} (round, rate) pairs of at most 1,000 requests each: every "
                 "pair replays its own slice of the trace")
    servers = [s for s in map(str.strip, args.servers.split(","))
               if args.vllm_python or s != "vllm"]
    bad = [s for s in servers if s != "vllm" and not s.startswith("ours-")]
    if bad:
        ap.error(f"--servers: {bad[0]!r} is neither vllm nor ours-POLICY [OPTIONS]")
    return servers


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.serve_compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--servers", default="vllm,ours-fcfs,ours-rotasched",
                    help="comma-separated; an entry ours-POLICY may carry options for our "
                    "server: 'ours-fcfs,ours-fcfs --max-num-batched-tokens 2048'")
    ap.add_argument("--rates", default="1,2,4,6")
    ap.add_argument("--workload", default="conv", choices=list(WORKLOADS),
                    help="the requests' class (workload.trace.WORKLOADS): multi-turn and "
                         "shared-prefix share prefixes within a run, for the servers' caches")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=40.0, help="of arrivals per rate")
    ap.add_argument("--kv-gib", type=int, default=1,
                    help="KV cache of each server in whole GiB (vLLM takes an integer)")
    ap.add_argument("--ttft-slo", type=float, default=1.72)
    ap.add_argument("--tbt-slo", type=float, default=0.273)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--ckpt", default="/tmp/superinfer-smollm2-hf")
    ap.add_argument("--logs", default="/tmp/serve_compare_logs")
    ap.add_argument("--ours-args", default="", help="more options for our server, e.g. vLLM's "
                    "CPU batch limits: '--max-num-seqs 128 --max-num-batched-tokens 2048'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    servers = checked(ap, args)
    os.makedirs(args.logs, exist_ok=True)
    if not os.path.exists(os.path.join(args.ckpt, "model.safetensors")):
        from weights.loader import export_hf
        export_hf(args.ckpt)
    rows: list[dict] = []
    try:
        for k in range(args.runs):
            for kind in servers:
                run_server(kind, args, k, rows)
    except KeyboardInterrupt:
        print(f"\ninterrupted; {len(rows)} rows kept", file=sys.stderr)
    except RuntimeError as e:  # a server that did not start: its log says why
        print(f"stopped: {e}; {len(rows)} rows kept", file=sys.stderr)
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
