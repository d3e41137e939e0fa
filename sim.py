"""GPU-scale simulator: the real sched.py and block accounting on a virtual clock with a cost model.

Each step's time comes from a roofline (compute vs weight + KV reads) plus a fixed overhead, and
the KV copies from a link model (per-copy launch overhead + bytes / bandwidth, both directions
together capped). DuplexKV copies overlap compute, so a step stalls only by the part of the
transfer that exceeds compute; vLLM v0's per-layer per-block copies block compute.

    python sim.py --hw gh200                      # the paper's setting: Llama-3-8B, TTFT 5 s / TBT 100 ms
    python sim.py --hw h100-pcie --model qwen2.5-32b --rates 1,2,3
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import Callable

from kv import BlockManager
from sched import Request, Scheduler, StepPlan, make_policy


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


# ---------------------------------------------------------------- models and hardware

@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    head_dim: int = 0
    experts: int = 1          # MoE: experts per layer, of which top_k run per token
    top_k: int = 1
    tied: bool = False

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype_bytes", "experts", "top_k"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.heads % self.kv_heads or self.top_k > self.experts:
            raise ValueError(f"model {self.name}: heads must divide by kv_heads and top_k <= experts")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def weight_bytes(self) -> int:
        per_layer = self.attn_params + self.experts * self.expert_params
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return (self.layers * per_layer + embed) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def active_flops_per_token(self) -> float:
        return 2.0 * (self.layers * (self.attn_params + self.top_k * self.expert_params) + self.vocab * self.hidden)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights a step of `tokens` reads: for MoE, only the experts that some token routes to."""
        if self.experts == 1:
            return self.weight_bytes
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)
        per_layer = self.attn_params + touched * self.expert_params
        return (self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)) * self.dtype_bytes


MODELS = {m.name: m for m in (
    ModelSpec("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064, head_dim=128),
    ModelSpec("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2),
    ModelSpec("smollm2-135m", 30, 576, 9, 3, 1536, 49152, dtype_bytes=4, tied=True),
)}


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float              # dense peak FLOP/s at the model's dtype
    hbm_bw: float             # device memory bandwidth, bytes/s
    hbm_bytes: float
    host_bytes: float         # host memory the KV host pool may use
    link_bw: float            # host link, bytes/s per direction with large segments
    duplex_bw: float          # both directions together
    copy_overhead: float      # seconds per copy call (launch + small-segment inefficiency)
    step_overhead: float      # scheduling, sampling, launch per step
    mfu: float = 0.6          # achieved fraction of peak FLOP/s by large matmuls
    mbu: float = 0.8          # achieved fraction of memory bandwidth
    kv_fraction: float = 0.9  # of HBM usable for weights + KV
    gemm_half: float = 0.0    # tokens per step at which matmuls reach half of mfu (0: no size effect)

    def __post_init__(self):
        for f in ("flops", "hbm_bw", "hbm_bytes", "host_bytes", "link_bw", "duplex_bw", "mfu", "mbu", "kv_fraction"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.copy_overhead < 0 or self.step_overhead < 0 or self.gemm_half < 0:
            raise ValueError(f"hardware {self.name}: overheads must be >= 0")
        if self.duplex_bw < self.link_bw or self.mfu > 1 or self.mbu > 1 or self.kv_fraction > 1:
            raise ValueError(f"hardware {self.name}: need link_bw <= duplex_bw and mfu, mbu, kv_fraction <= 1")


GB = 1e9
PROFILES = {h.name: h for h in (
    # GH200: H100 96 GB HBM3 + Grace over NVLink-C2C (DESIGN.md section 8)
    Hardware("gh200", 989e12, 4.0e12, 96 * GB, 400 * GB, 200 * GB, 384 * GB, 3e-6, 7.6e-3),
    Hardware("h100-pcie", 756e12, 2.0e12, 80 * GB, 400 * GB, 57 * GB, 110 * GB, 12e-6, 7.6e-3),
    Hardware("h200-pcie", 836e12, 4.8e12, 141 * GB, 400 * GB, 57 * GB, 110 * GB, 12e-6, 7.6e-3),
)}


def cpu_profile(measure: bool = True) -> Hardware:
    """This machine: measured fp32 matmul FLOP/s and memcpy bandwidth (host and 'device' are both RAM)."""
    flops, bw = 150e9, 14e9
    if measure:
        import torch
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        a @ b
        t = time.perf_counter()
        for _ in range(10):
            a @ b
        flops = 10 * 2 * 1024**3 / (time.perf_counter() - t)
        x = torch.randn(32 * 2**20 // 4)
        y = torch.empty_like(x)
        y.copy_(x)
        t = time.perf_counter()
        for _ in range(5):
            y.copy_(x)
        bw = 5 * x.numel() * 4 / (time.perf_counter() - t)
    # mfu and gemm_half fitted to the real engine on two trace slices (bench.py --validate-sim)
    return Hardware("cpu", flops, 2 * bw, 4 * GB, 8 * GB, bw, bw, 2e-6, 4e-3, mfu=0.5, mbu=0.6, gemm_half=16)


# ---------------------------------------------------------------- the cost model

class CostModel:
    def __init__(self, model: ModelSpec, hw: Hardware, block_size: int = 16, device_blocks: int | None = None,
                 host_blocks: int | None = None):
        self.m, self.hw, self.block_size = model, hw, block_size
        self.block_bytes = model.kv_bytes_per_token * block_size
        free = hw.hbm_bytes * hw.kv_fraction - model.weight_bytes
        if free < self.block_bytes:
            raise ValueError(f"{model.name} ({model.weight_bytes / GB:.1f} GB of weights) does not fit {hw.name} "
                             f"({hw.hbm_bytes / GB:.0f} GB HBM)")
        self.device_blocks = device_blocks or int(free // self.block_bytes)
        self.host_blocks = host_blocks or int(hw.host_bytes // self.block_bytes)

    def compute_time(self, tokens: int, ctx_tokens: int, attn_pairs: float) -> float:
        """tokens computed this step; ctx_tokens = KV tokens read; attn_pairs = sum of query x key pairs."""
        m = self.m
        flops = tokens * m.active_flops_per_token() + 4 * attn_pairs * m.heads * m.head_dim * m.layers
        bytes_ = m.weight_bytes_read(tokens) + (ctx_tokens + tokens) * m.kv_bytes_per_token
        efficiency = self.hw.mfu * tokens / (tokens + self.hw.gemm_half)  # small batches: skinny matmuls
        return max(flops / (self.hw.flops * efficiency), bytes_ / (self.hw.hbm_bw * self.hw.mbu))

    def copy_time(self, copies: int, nbytes: float) -> float:
        return copies * self.hw.copy_overhead + nbytes / self.hw.link_bw

    def transfer_time(self, out_blocks: int, in_blocks: int, out_copies: int, in_copies: int, duplex: bool) -> float:
        t_out = self.copy_time(out_copies, out_blocks * self.block_bytes)
        t_in = self.copy_time(in_copies, in_blocks * self.block_bytes)
        if not duplex:
            return t_out + t_in  # one direction after the other
        both = (out_blocks + in_blocks) * self.block_bytes / self.hw.duplex_bw
        return max(t_out, t_in, both)

    def step_time(self, plan: StepPlan, duplex: bool) -> float:
        tokens = ctx = 0
        pairs = 0.0
        for r, n in plan.chunks:
            tokens += n
            ctx += r.num_computed
            pairs += n * r.num_computed + n * (n + 1) / 2
        t_compute = self.compute_time(tokens, ctx, pairs) if tokens else 0.0
        if duplex:   # merged runs of consecutive blocks: roughly one copy per request moved
            out_c, in_c = len(plan.rotated_out) + len(plan.swap_out) // 64, len(plan.rotated_in)
        else:        # vLLM v0: a copy per block per layer for K and for V
            out_c, in_c = (2 * self.m.layers * len(p) for p in (plan.swap_out, plan.swap_in))
        t_xfer = self.transfer_time(len(plan.swap_out), len(plan.swap_in), out_c, in_c, duplex)
        if duplex:   # copies run beside compute; only the excess stalls the step
            return self.hw.step_overhead + max(t_compute, t_xfer)
        return self.hw.step_overhead + t_compute + t_xfer


# ---------------------------------------------------------------- running a simulated benchmark

def azure_lengths(path: str | None = None) -> list[tuple[int, int]]:
    from bench import DEFAULT_TRACE, read_trace
    return [(c, g) for _, c, g in read_trace(path or DEFAULT_TRACE)]


def poisson_requests(rate: float, duration: float, lengths: list[tuple[int, int]], seed: int,
                     max_len: int | None = None) -> list[Request]:
    rng = random.Random(seed)
    t, out = rng.expovariate(rate), []
    while t < duration:
        p, o = rng.choice(lengths)
        if max_len:
            p, o = min(p, max_len - 1), max(1, min(o, max_len - min(p, max_len - 1)))
        out.append(Request(f"r{len(out)}", p, o, t))
        t += rng.expovariate(rate)
    return out


def split_policies(text: str) -> list[str]:
    """'a,b' or, when a policy carries parameters, 'a;b:alpha=1,quantum=0.5'."""
    return [p for p in text.split(";" if ";" in text else ",") if p]


def run_policy(policy: str, requests: list[Request], cost: CostModel, *, ttft_slo: float, tbt_slo: float,
               max_num_seqs: int = 1024, max_num_batched_tokens: int = 8192, xfer_budget: int = 2400,
               keep: list[Request] | None = None) -> dict:
    """Simulate one policy on fresh copies of `requests` (or, with keep=requests, on those objects)."""
    pol = make_policy(policy)
    bm = BlockManager(cost.device_blocks, cost.host_blocks, cost.block_size, duplex=pol.duplex)
    s = Scheduler(bm, pol, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                  xfer_budget=xfer_budget, ttft_slo=ttft_slo, tbt_slo=tbt_slo)
    fresh = keep if keep is not None else [Request(r.rid, r.num_prompt, r.max_tokens, r.arrival) for r in requests]
    moved, steps, busy = [0], [0], [0.0]

    def step_time(plan):
        dt = cost.step_time(plan, pol.duplex)
        moved[0] += plan.blocks_moved
        steps[0] += 1
        busy[0] += dt
        return dt
    done, rejected = simulate(s, fresh, step_time)
    from bench import summarize
    row = summarize([(r.arrival, r.token_times) for r in fresh if r.token_times], ttft_slo, tbt_slo)
    return row | {"policy": policy, "rotations": sum(r.rotations for r in fresh),
                  "recomputes": sum(r.recomputes for r in fresh), "bytes_moved": moved[0] * cost.block_bytes,
                  "steps": steps[0], "mean_step_ms": 1e3 * busy[0] / max(1, steps[0]), "rejected": len(rejected)}


def saturation_rate(cost: CostModel, lengths, seed: int, ttft_slo: float, tbt_slo: float, n: int = 1000,
                    **sched_kw) -> float:
    """Requests/s the simulated machine completes with a deep queue (fcfs, everyone queued at once),
    measured between the 10th and the 90th percentile completion, away from ramp-up and tail."""
    rng = random.Random(seed)
    reqs = [Request(f"s{i}", *rng.choice(lengths), 0.0) for i in range(n)]
    run_policy("fcfs", reqs, cost, ttft_slo=ttft_slo, tbt_slo=tbt_slo, keep=reqs, **sched_kw)
    ends = sorted(r.token_times[-1] for r in reqs if r.token_times)
    lo, hi = len(ends) // 10, len(ends) * 9 // 10
    return (hi - lo) / (ends[hi] - ends[lo])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", default="gh200", help=f"hardware profile: {', '.join(PROFILES)}, cpu")
    ap.add_argument("--model", default="llama-3-8b", help=f"model: {', '.join(MODELS)}")
    ap.add_argument("--policies", default="fcfs,fcfs-swap,rotasched,rotasched-released",
                    help="comma list; 'rotasched:per-layer' uses vLLM v0's per-layer copies instead of DuplexKV, "
                         "'rotasched:alpha=1,quantum=0.5' sets RotaSched parameters (use ';' between policies then)")
    ap.add_argument("--rates", default=None, help="request rates (req/s); default: around the saturation rate")
    ap.add_argument("--rate-factors", default="0.6,0.8,1.0,1.2,1.5")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of Poisson arrivals")
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--trace", default=None, help="Azure-format trace for the length distribution")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--xfer-budget", type=int, default=2400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    from bench import plot, print_table, verdict
    if args.model not in MODELS:
        raise SystemExit(f"unknown model {args.model!r}; choose from {', '.join(MODELS)}")
    hw = cpu_profile() if args.hw == "cpu" else PROFILES.get(args.hw)
    if hw is None:
        raise SystemExit(f"unknown hardware profile {args.hw!r}; choose from {', '.join(PROFILES)}, cpu")
    model = MODELS["smollm2-135m"] if args.hw == "cpu" and args.model == "llama-3-8b" else MODELS[args.model]
    cost = CostModel(model, hw)
    lengths = azure_lengths(args.trace)
    print(f"simulated {hw.name}: {model.name}, {cost.device_blocks} device / {cost.host_blocks} host KV blocks of "
          f"{cost.block_bytes / 2**20:.1f} MiB; SLOs TTFT {args.ttft_slo}s, TBT {args.tbt_slo * 1e3:.0f}ms; "
          f"Azure conversation lengths, Poisson arrivals over {args.duration:.0f}s")
    t = time.perf_counter()
    if args.rates:
        rates = [float(r) for r in args.rates.split(",")]
    else:
        sat = saturation_rate(cost, lengths, args.seed, args.ttft_slo, args.tbt_slo, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_batched_tokens, xfer_budget=args.xfer_budget)
        rates = [round(sat * float(f), 2) for f in args.rate_factors.split(",")]
        print(f"saturation {sat:.2f} req/s -> rates {rates}")
    rows = []
    for rate in rates:
        reqs = poisson_requests(rate, args.duration, lengths, args.seed, args.max_len)
        for pol in split_policies(args.policies):
            row = run_policy(pol, reqs, cost, ttft_slo=args.ttft_slo, tbt_slo=args.tbt_slo,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
                             xfer_budget=args.xfer_budget)
            rows.append(row | {"rate": rate, "hw": hw.name, "model": model.name})
            print(f"  {pol:<24} rate {rate:6.2f}: TTFT att {row['ttft_attainment']:6.1%}  TBT att "
                  f"{row['tbt_attainment']:6.1%}  {row['throughput_tok_s']:8.0f} tok/s  step {row['mean_step_ms']:5.1f}ms"
                  f"  rotations {row['rotations']}", flush=True)
    print_table(rows, (args.ttft_slo, args.tbt_slo))
    for line in verdict(rows):
        print(line)
    print(f"simulated {sum(r['num_requests'] for r in rows)} requests in {time.perf_counter() - t:.1f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        plot(rows, args.plot, f"simulated {hw.name}, {model.name}")


if __name__ == "__main__":
    main()
