"""GPU-scale simulator: the real scheduler and block accounting on a virtual clock.

A step's time is a roofline (compute vs weight + KV reads) plus a fixed overhead, plus, with
tensor parallelism, two all-reduces per layer; KV copies follow a link model (per-copy overhead
+ bytes / bandwidth, both directions together capped). With DuplexKV a swap-in runs under the
previous step's forward, so copies cost a step only where they outlast its compute; vLLM v0's
per-layer copies block compute.

    python -m tools.sim --hw gh200-96           # Llama-3-8B, TTFT 5 s / TBT 100 ms
    python -m tools.sim --hw h100-pcie --model qwen2.5-32b --rates 1,2,3
    python -m tools.claim                       # the README's sweeps: four settings, four workloads
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from sched import Request, Scheduler, StepPlan, block_hash
from kv import CACHING
from superinfer import ConfigError, EngineConfig, Parser
from tools.schedlog import log_name
from workload.metrics import (best_time, caching_of, plot, policy_of, print_table, summarize,
                              verdict)
from workload.trace import (DEFAULT_TRACE, SHARING, WORKLOADS, Item, TraceError, capped,
                            random_arrivals, read_hash_trace, read_trace, reshape, with_rate,
                            with_sharing)

MAX_REQUESTS = 200_000   # a run larger than this is cut short (with a message)


class Stuck(RuntimeError):
    """The scheduler made no progress with work left and nothing more to arrive (a liveness bug)."""


def simulate(sched: Scheduler, requests: list[Request], step_time: Callable[[StepPlan], float],
             on_step: Callable[[StepPlan, float], None] | None = None,
             max_steps: int | None = None):
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
        if not (plan.chunks or plan.blocks_moved or plan.rotated_in or sched.bm.fenced):
            sched.update(plan, {}, now)
            if i == len(pending):
                raise Stuck(f"step {steps}: nothing scheduled, {len(sched.waiting)} waiting, "
                            f"{len(sched.rotary)} rotary, {len(sched.running)} running")
            now = max(now, pending[i].arrival)
            continue
        now += step_time(plan)
        done += sched.update(plan, {r.rid: 0 for r in plan.chunks}, now)
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
        for f in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "dtype_bytes",
                  "experts", "top_k"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f} must be positive, got {getattr(self, f)}")
        if self.heads % self.kv_heads or self.top_k > self.experts:
            raise ValueError(f"model {self.name}: heads must divide by kv_heads, "
                             "and top_k <= experts")
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def attn_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def weight_bytes(self) -> int:
        per_layer = self.attn_params + self.experts * self.expert_params
        return (self.layers * per_layer + self.embed_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def active_flops_per_token(self) -> float:
        per_layer = self.attn_params + self.top_k * self.expert_params
        return 2.0 * (self.layers * per_layer + self.vocab * self.hidden)

    def weight_bytes_read(self, tokens: int) -> float:
        """Weights a step of `tokens` reads: for MoE, only the experts that some token routes to."""
        if self.experts == 1:
            return self.weight_bytes
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens)
        per_layer = self.attn_params + touched * self.expert_params
        return (self.layers * per_layer + self.embed_params) * self.dtype_bytes


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
    gemm_half: float = 0.0    # tokens per step at which matmuls reach half of mfu (0: no effect)
    p2p_bw: float = 450e9     # GPU-to-GPU bytes/s per direction (tensor-parallel all-reduce)
    p2p_latency: float = 5e-6  # seconds per all-reduce hop

    def __post_init__(self):
        for f in ("flops", "hbm_bw", "hbm_bytes", "host_bytes", "link_bw", "duplex_bw", "mfu",
                  "mbu", "kv_fraction", "p2p_bw"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name}: {f} must be positive, "
                                 f"got {getattr(self, f)}")
        if min(self.copy_overhead, self.step_overhead, self.gemm_half, self.p2p_latency) < 0:
            raise ValueError(f"hardware {self.name}: overheads must be >= 0")
        if self.duplex_bw < self.link_bw or max(self.mfu, self.mbu, self.kv_fraction) > 1:
            raise ValueError(f"hardware {self.name}: need link_bw <= duplex_bw and mfu, mbu, "
                             "kv_fraction <= 1")


GB = 1e9
PROFILES = {h.name: h for h in (
    # GH200: H100 with 96 GB HBM3 or 144 GB HBM3e + Grace over NVLink-C2C (450 GB/s a way
    # nominal, ~200 measured with large segments, ~384 both ways together)
    Hardware("gh200-96", 989e12, 4.0e12, 96 * GB, 400 * GB, 200 * GB, 384 * GB, 3e-6, 7.6e-3),
    Hardware("gh200-144", 989e12, 4.9e12, 144 * GB, 400 * GB, 200 * GB, 384 * GB, 3e-6, 7.6e-3),
    # PCIe cards: the host link is PCIe Gen5; GPU-to-GPU over PCIe too (no NVLink bridge)
    Hardware("h100-pcie", 756e12, 2.0e12, 80 * GB, 400 * GB, 57 * GB, 110 * GB, 12e-6, 7.6e-3,
             p2p_bw=55e9),
    Hardware("h200-pcie", 836e12, 4.8e12, 141 * GB, 400 * GB, 57 * GB, 110 * GB, 12e-6, 7.6e-3,
             p2p_bw=55e9),
)}


def cpu_profile(measure: bool = True) -> Hardware:
    """This machine: measured fp32 matmul FLOP/s and memcpy bandwidth (both tiers are RAM)."""
    flops, bw = 150e9, 14e9
    if measure:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        flops = 2 * 1024**3 / best_time(lambda: a @ b, 10)
        x = torch.randn(32 * 2**20 // 4)
        y = torch.empty_like(x)
        bw = x.numel() * 4 / best_time(lambda: y.copy_(x), 5)
    # mfu and gemm_half fitted to the real engine on two trace slices (bench.py --validate-sim)
    return Hardware("cpu", flops, 2 * bw, 4 * GB, 8 * GB, bw, bw, 2e-6, 4e-3, mfu=0.5, mbu=0.6,
                    gemm_half=16, p2p_bw=bw)


# ---------------------------------------------------------------- the cost model

class CostModel:
    """Step times for one model on tp GPUs of one kind (the KV pool and copies are per GPU)."""

    def __init__(self, model: ModelSpec, hw: Hardware, block_size: int = 16,
                 device_blocks: int | None = None, host_blocks: int | None = None, tp: int = 1):
        if tp < 1 or model.heads % tp or model.kv_heads % tp:
            raise ValueError(f"{model.name}: tensor parallel size {tp} must divide its "
                             f"{model.heads} heads and {model.kv_heads} KV heads")
        self.m, self.hw, self.block_size, self.tp = model, hw, block_size, tp
        self.block_bytes = model.kv_bytes_per_token * block_size   # all ranks' shards together
        free = hw.hbm_bytes * hw.kv_fraction - model.weight_bytes / tp
        if free < self.block_bytes / tp:
            raise ValueError(f"{model.name} ({model.weight_bytes / GB:.1f} GB of weights) does not "
                             f"fit {tp} x {hw.name} ({hw.hbm_bytes / GB:.0f} GB HBM)")
        self.device_blocks = device_blocks or int(free // (self.block_bytes / tp))
        self.host_blocks = host_blocks or int(hw.host_bytes // (self.block_bytes / tp))

    def compute_time(self, tokens: int, ctx_tokens: int, attn_pairs: float) -> float:
        """tokens computed this step; ctx_tokens = KV tokens read; attn_pairs = sum of query x
        key pairs. Per GPU: 1/tp of the FLOPs, weights and KV."""
        m, hw = self.m, self.hw
        attention = 4 * attn_pairs * m.heads * m.head_dim * m.layers
        flops = tokens * m.active_flops_per_token() + attention
        bytes_ = m.weight_bytes_read(tokens) + (ctx_tokens + tokens) * m.kv_bytes_per_token
        efficiency = hw.mfu * tokens / (tokens + hw.gemm_half)  # small batches: skinny matmuls
        roof = max(flops / (hw.flops * efficiency), bytes_ / (hw.hbm_bw * hw.mbu)) / self.tp
        return roof + self.allreduce_time(tokens)

    def allreduce_time(self, tokens: int) -> float:
        """Two ring all-reduces per layer (attention and MLP outputs) of tokens x hidden values."""
        if self.tp == 1:
            return 0.0
        n, nbytes = self.tp, tokens * self.m.hidden * self.m.dtype_bytes
        one = 2 * (n - 1) / n * nbytes / self.hw.p2p_bw + 2 * (n - 1) * self.hw.p2p_latency
        return 2 * self.m.layers * one

    def copy_time(self, copies: int, nbytes: float) -> float:
        return copies * self.hw.copy_overhead + nbytes / self.hw.link_bw

    def transfer_time(self, out_blocks: int, in_blocks: int, out_copies: int, in_copies: int,
                      duplex: bool) -> float:
        """Each GPU moves its 1/tp shard of every block over its own link, all in parallel."""
        shard = self.block_bytes / self.tp
        t_out = self.copy_time(out_copies, out_blocks * shard)
        t_in = self.copy_time(in_copies, in_blocks * shard)
        if not duplex:
            return t_out + t_in  # one direction after the other
        both = (out_blocks + in_blocks) * shard / self.hw.duplex_bw
        return max(t_out, t_in, both)

    def step_time(self, plan: StepPlan, duplex: bool, overlap: bool = True) -> float:
        tokens = ctx = 0
        pairs = 0.0
        for r, n in plan.chunks.items():
            tokens += n
            ctx += r.num_computed
            pairs += n * r.num_computed + n * (n + 1) / 2
        t_compute = self.compute_time(tokens, ctx, pairs) if tokens else 0.0
        if duplex:   # merged runs of consecutive blocks: roughly one copy per request moved
            out_c = len(plan.rotated_out) + len(plan.swap_out) // 64
            in_c = len(plan.rotated_in)
        else:        # vLLM v0: a copy per block per layer for K and for V
            out_c, in_c = (2 * self.m.layers * len(p) for p in (plan.swap_out, plan.swap_in))
        if not duplex:   # one direction after the other, and compute waits for both
            t_xfer = self.transfer_time(len(plan.swap_out), len(plan.swap_in), out_c, in_c, False)
            return self.hw.step_overhead + t_compute + t_xfer
        if overlap:      # all copies run beside this step's forward; what outlasts it stalls
            t_xfer = self.transfer_time(len(plan.swap_out), len(plan.swap_in), out_c, in_c, True)
            return self.hw.step_overhead + max(t_compute, t_xfer)
        # swapped-in requests run in this step: the forward waits for their copies, while the
        # outgoing copies (rotations out, write-backs) run beside it
        t_in = self.copy_time(in_c, len(plan.swap_in) * self.block_bytes / self.tp)
        t_out = self.copy_time(out_c, len(plan.swap_out) * self.block_bytes / self.tp)
        return self.hw.step_overhead + t_in + max(t_compute, t_out)


# ---------------------------------------------------------------- running a simulated benchmark

def azure_lengths(path: str | None = None) -> list[tuple[int, int]]:
    return [(c, g) for _, c, g in read_trace(path or DEFAULT_TRACE)]


def requests_at(rate: float, duration: float, lengths, seed: int, max_len: int | None = None,
                burstiness: float = 1.0, sharing: str | None = None,
                block_size: int = 16) -> list[Request]:
    """Requests arriving at `rate` for `duration` seconds (gamma inter-arrivals of shape
    `burstiness`, 1 = Poisson), lengths drawn from `lengths`; prompts sharing prefixes as the
    `sharing` class (workload.trace.SHARING) says."""
    items = random_arrivals(rate, duration, lengths, seed, max_len, MAX_REQUESTS, burstiness)
    if sharing:
        items = with_sharing(items, sharing, max_len or 10**9)
    return as_requests(items, block_size)


def trace_requests(items: list[Item], rate: float, duration: float,
                   block_size: int) -> list[Request]:
    """A trace of prefix hashes replayed at `rate` (its own burstiness kept) for `duration`."""
    timed = with_rate(items[:MAX_REQUESTS], rate)
    return as_requests([i for i in timed if i.arrival < duration], block_size)


def as_requests(items: list[Item], block_size: int) -> list[Request]:
    return [Request(f"r{i}", it.prompt_len, it.output_len, it.arrival,
                    hashes=piece_hashes(it, block_size)) for i, it in enumerate(items)]


def piece_hashes(it: Item, block_size: int) -> list[int]:
    """The prefix-cache hashes of an item's full prompt blocks, from its pieces (simulated
    requests have no tokens): a block's tokens are fixed by the pieces it overlaps and where
    it starts in the first, and its hash chains every block before it."""
    out, h = [], 0
    for i in range(it.prompt_len // block_size if it.pieces else 0):
        a, b = i * block_size, (i + 1) * block_size - 1
        h = block_hash(h, [*it.pieces[a // it.unit:b // it.unit + 1], a % it.unit])
        out.append(h)
    return out


def split_policies(text: str) -> list[str]:
    """'a,b' or, when a policy carries parameters, 'a;b:alpha=1,beta_f=0.3'."""
    return [p for p in text.split(";" if ";" in text else ",") if p]


def run_policy(policy: str, requests: list[Request], cost: CostModel, cfg: EngineConfig,
               keep: bool = False, log: str | None = None) -> dict:
    """Simulate one policy on fresh copies of `requests` (or, with keep, on those objects);
    with `log`, write the schedule log there."""
    cfg = replace(cfg, policy=policy_of(policy), log_path=log,
                  prefix_caching=caching_of(policy) or cfg.prefix_caching)
    s = Scheduler.create(cfg, cost.device_blocks, cost.host_blocks)
    fresh = requests if keep else [Request(r.rid, r.num_prompt, r.max_tokens, r.arrival,
                                           hashes=r.hashes) for r in requests]
    moved, busy = 0, 0.0

    def step_time(plan):
        nonlocal moved, busy
        dt = cost.step_time(plan, s.policy.duplex, s.overlap)
        moved += plan.blocks_moved
        busy += dt
        return dt
    done, rejected = simulate(s, fresh, step_time)
    s.close()
    row = summarize([(r.arrival, r.token_times) for r in fresh if r.token_times],
                    cfg.ttft_slo, cfg.tbt_slo)
    return row | {"policy": policy, "rotations": sum(r.rotations for r in fresh),
                  "recomputes": sum(r.recomputes for r in fresh),
                  "bytes_moved": moved * cost.block_bytes, "steps": s.num_steps,
                  "mean_step_ms": 1e3 * busy / max(1, s.num_steps), "rejected": len(rejected)}


def saturation_rate(cost: CostModel, queue: list[Request], cfg: EngineConfig) -> float:
    """Requests/s the simulated machine completes with a deep queue (fcfs, everyone in `queue`
    there at once), between the 10th and the 90th percentile completion, away from ramp-up and
    tail. The queue is drawn as the runs' requests are (deep_queue), so a rate is a share of
    what the machine does with the load it is given."""
    run_policy("fcfs", queue, cost, cfg, keep=True)
    ends = sorted(r.token_times[-1] for r in queue if r.token_times)
    lo, hi = len(ends) // 10, len(ends) * 9 // 10
    return (hi - lo) / (ends[hi] - ends[lo])


def deep_queue(lengths, seed: int, max_len: int | None, n: int = 1000) -> list[Request]:
    """n requests of lengths drawn from `lengths` and capped as requests_at caps them."""
    rng = random.Random(seed)
    return [Request(f"s{i}", *capped(*rng.choice(lengths), max_len), 0.0) for i in range(n)]


def trace_queue(items: list[Item], block_size: int, n: int = 1000) -> list[Request]:
    """A hash trace's first n requests, all there at once: their shared prefixes are what
    makes the trace cheaper (or not) to serve than its lengths alone."""
    return as_requests([replace(i, arrival=0.0) for i in items[:n]], block_size)


# ---------------------------------------------------------------- command line

def parse_args(argv):
    ap = Parser(prog="python -m tools.sim", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hw", default="gh200-96", choices=[*PROFILES, "cpu"], help="hardware profile")
    ap.add_argument("--model", default="llama-3-8b", choices=list(MODELS))
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    ap.add_argument("--policies",
                    default="fcfs,fcfs-swap,rotasched-lvf,rotasched,rotasched-released",
                    help="comma list; 'rotasched-lvf:alpha=1,beta_f=0.3' sets the paper's "
                         "parameters (';' between policies then); 'rotasched@device' runs with "
                         "that prefix caching (off, device, both)")
    ap.add_argument("--rates", default=None, help="request rates (req/s; default: calibrated)")
    ap.add_argument("--rate-factors", default="0.6,0.8,1.0,1.2,1.5",
                    help="rates as multiples of the saturation (saturation_rate) measured on "
                         "the runs' own requests queued at once")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--tbt-slo", type=float, default=0.1)
    ap.add_argument("--trace", default=None,
                    help="Azure-format trace for the length distribution, or a .jsonl trace of "
                         "prefix hashes (workload.trace.read_hash_trace) replayed as it arrived, "
                         "rescaled to each rate")
    ap.add_argument("--device-blocks", type=int, default=None,
                    help="device KV blocks (default: what the GPU's memory holds)")
    ap.add_argument("--prefix-caching", default="both", choices=CACHING,
                    help="reuse cached prompt prefixes: off, device, or both tiers")
    ap.add_argument("--workload", default="conv", choices=list(WORKLOADS),
                    help="conv: the trace's lengths; prefill-heavy: prompts x4, outputs x0.1; "
                         "decode-heavy: prompts x0.1, outputs x4; "
                         + "; ".join(f"{k}: {v}" for k, v in SHARING.items()))
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the inter-arrival times: 1 = Poisson, 0.1 = bursty "
                         "(coefficient of variation 3.2)")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--authors-limits", action="store_true",
                    help="the authors' engine limits: 16384 seqs and 16384 tokens per step")
    ap.add_argument("--xfer-budget", type=int, default=2400)
    ap.add_argument("--swap-in-overlap", default=None, choices=["on", "off"],
                    help="on: a swapped-in request runs one step later, its copy under the "
                         "previous forward; off: in the same step, its copy exposed (default: on "
                         "for GPU profiles, off for cpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default=None, help="write the schedule log (schedlog.py) here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    check_args(ap, args)
    return ap, args


def check_args(ap, args) -> None:
    if args.authors_limits:
        args.max_num_seqs = args.max_batched_tokens = 16384
    for name in ("duration", "ttft_slo", "tbt_slo", "burstiness"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.max_len < 2:
        ap.error("--max-len must be >= 2")
    if args.device_blocks is not None and args.device_blocks < 1:
        ap.error("--device-blocks must be >= 1")
    try:
        args.rates = [float(r) for r in args.rates.split(",")] if args.rates else None
        args.rate_factors = [float(f) for f in args.rate_factors.split(",")]
    except ValueError as e:
        ap.error(f"--rates/--rate-factors: {e}")
    if any(not r > 0 for r in (args.rates or []) + args.rate_factors):
        ap.error("request rates and rate factors must be > 0")
    args.policies = split_policies(args.policies)


def main(argv=None) -> None:
    ap, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        overlap = {"on": True, "off": False, None: args.hw != "cpu"}[args.swap_in_overlap]
        cfg = EngineConfig(policy="fcfs", max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_batched_tokens,
                           xfer_budget=args.xfer_budget, ttft_slo=args.ttft_slo,
                           tbt_slo=args.tbt_slo, swap_in_overlap=overlap,
                           prefix_caching=args.prefix_caching)
        for pol in args.policies:
            EngineConfig(policy=policy_of(pol), prefix_caching=caching_of(pol) or "off")
        args.hashed = read_hash_trace(args.trace) if (args.trace or "").endswith(".jsonl") else None
        lengths = reshape([(i.prompt_len, i.output_len) for i in args.hashed] if args.hashed
                          else azure_lengths(args.trace), args.workload)
        hw = cpu_profile() if args.hw == "cpu" else PROFILES[args.hw]
        model = MODELS["smollm2-135m"] if args.hw == "cpu" else MODELS[args.model]
        cost = CostModel(model, hw, cfg.block_size, args.device_blocks, tp=args.tp)
    except (ConfigError, TraceError, ValueError) as e:
        ap.error(str(e))
    rows: list[dict] = []
    try:
        sweep(args, cfg, cost, lengths, rows)
    except KeyboardInterrupt:  # keep the finished rows
        print(f"\nsim: interrupted; {len(rows)} finished runs kept", file=sys.stderr)
    if args.json and rows:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot and rows:
        plot(rows, args.plot, f"simulated {cost.hw.name}, {cost.m.name}")


def settings(args, cost: CostModel, cfg: EngineConfig) -> dict:
    """What a result row was run with, so that it can be judged on its own."""
    return {"hw": cost.hw.name, "model": cost.m.name, "tp": cost.tp, "workload": args.workload,
            "burstiness": args.burstiness, "trace": os.path.basename(args.trace or DEFAULT_TRACE),
            "arrivals_s": args.duration, "seed": args.seed, "ttft_slo_s": cfg.ttft_slo,
            "tbt_slo_s": cfg.tbt_slo, "max_num_seqs": cfg.max_num_seqs,
            "prefix_caching": cfg.prefix_caching,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "xfer_budget": cfg.xfer_budget, "swap_in_overlap": cfg.swap_in_overlap,
            "device_blocks": cost.device_blocks, "host_blocks": cost.host_blocks}


def load(args) -> str:
    if args.hashed:
        return f"the requests of {os.path.basename(args.trace)} at their own burstiness"
    return (f"{args.workload} lengths from the Azure trace, arrivals of burstiness "
            f"{args.burstiness:g}")


def sweep(args, cfg: EngineConfig, cost: CostModel, lengths, rows: list[dict]) -> None:
    print(f"simulated {args.tp} x {cost.hw.name}: {cost.m.name}, {cost.device_blocks} device / "
          f"{cost.host_blocks} host KV blocks of {cost.block_bytes / 2**20:.1f} MiB; SLOs TTFT "
          f"{cfg.ttft_slo}s, TBT {cfg.tbt_slo * 1e3:.0f}ms; {load(args)} over {args.duration:.0f}s")
    t = time.perf_counter()
    rates = args.rates
    if rates is None:
        queue = (trace_queue(args.hashed, cfg.block_size) if args.hashed
                 else deep_queue(lengths, args.seed, args.max_len))
        sat = saturation_rate(cost, queue, cfg)
        rates = [round(sat * f, 2) for f in args.rate_factors]
        print(f"saturation {sat:.2f} req/s -> rates {rates}")
    for rate in rates:
        if args.hashed:
            reqs = trace_requests(args.hashed, rate, args.duration, cfg.block_size)
        else:
            reqs = requests_at(rate, args.duration, lengths, args.seed, args.max_len,
                               args.burstiness, args.workload if args.workload in SHARING else None,
                               cfg.block_size)
        if len(reqs) >= MAX_REQUESTS:
            print(f"rate {rate}: capped at {MAX_REQUESTS} requests "
                  f"({reqs[-1].arrival:.0f} of {args.duration:.0f} s)")
        if not reqs:
            print(f"rate {rate}: no request arrives within {args.duration:.0f} s; skipped")
            continue
        for pol in args.policies:
            log = log_name(args.log, pol, rate, len(rates) * len(args.policies))
            row = run_policy(pol, reqs, cost, cfg, log=log) | {"rate": rate} | settings(args, cost,
                                                                                         cfg)
            rows.append(row)
            print(f"  {pol:<28} rate {rate:6.2f}: TTFT att {row['ttft_attainment']:6.1%}  TBT att "
                  f"{row['tbt_attainment']:6.1%}  {row['throughput_tok_s']:8.0f} tok/s  step "
                  f"{row['mean_step_ms']:5.1f}ms  rotations {row['rotations']}", flush=True)
    if rows:
        print_table(rows, (cfg.ttft_slo, cfg.tbt_slo), f"Simulated {cost.hw.name}, {cost.m.name}")
        for line in verdict(rows):
            print(line)
    print(f"simulated {sum(r['num_requests'] for r in rows)} requests in "
          f"{time.perf_counter() - t:.1f}s")


if __name__ == "__main__":
    main()
