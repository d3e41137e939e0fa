"""Speed next to HF transformers on the same weights, and the KV copy paths.

    python -m tools.bench_speed            decode tokens/s at batch 1/32/64 (ours fp32 and bf16,
                                           HF), the engine on 32 x 64 greedy tokens vs HF
                                           generate_batch and generate, GFLOP/s and GB/s against
                                           this machine's measured peaks, where a step's time goes
    python -m tools.bench_speed --profile  a decode step at batch 32 and a prefill chunk, fp32
                                           and bf16: ms per operator kind, FLOPs, bytes
    python -m tools.bench_speed --gemm     each weight shape of the model at 1/32/256 rows,
                                           F.linear vs oneDNN's matmul, fp32/bf16, and the
                                           memory oneDNN keeps per input shape
    python -m tools.bench_speed --copies   KV copies: per-layer per-block (vLLM v0) vs merged
                                           block-first vs both directions at once, GB/s
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from kv import DuplexCopier, KVPools, block_bytes, copy_merged, copy_per_layer
from cpu import speed
from model import Seq, make_batch
from superinfer import Engine, EngineConfig, Parser, SamplingParams
from tools import profiles
from weights.loader import build_model, embedded_gguf_path, hf_reference, read_gguf
from workload.metrics import best_time


# ---------------------------------------------------------------- HF transformers as a baseline

def hf_model(path: str | None):
    """transformers.LlamaForCausalLM (fp32) on the same weights as our model at `path`."""
    if path is None or path.endswith(".gguf"):
        return hf_reference(*read_gguf(path or embedded_gguf_path()))
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True).eval()


def hf_manager(hf, max_new_tokens: int, max_num_seqs: int, max_tokens: int,
               block_size: int | None = None, num_blocks: int | None = None):
    """A started HF continuous-batching manager (generate_batch's engine): greedy, no EOS, our
    batch limits and, when given, our KV pool."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    gc = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    pool = {"page_size": block_size, "num_blocks": num_blocks} if block_size else {}
    cbc = ContinuousBatchingConfig(max_batch_tokens=max_tokens, max_requests_per_batch=max_num_seqs,
                                   **pool)
    mgr = hf.init_continuous_batching(generation_config=gc, continuous_batching_config=cbc)
    mgr.start()
    return mgr


# ---------------------------------------------------------------- the model and the engine

def machine_limits() -> tuple[float, float]:
    """(fp32 matmul FLOP/s of a 1024^3 GEMM, bytes/s of a 256 MiB copy): the peaks to judge by."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    x = torch.randn(64 * 2**20)
    y = torch.empty_like(x)
    flops = max(2 * 1024**3 / best_time(lambda: a @ b, 10) for _ in range(3))
    return flops, 2 * x.numel() * 4 / best_time(lambda: y.copy_(x), 3)  # read + write


def decode_speed(model, batch: int, ctx: int = 128, steps: int = 8) -> float:
    """Tokens/s of decode steps at `batch` sequences of `ctx` tokens of context (ours)."""
    bs = 16
    nblk = -(-(ctx + steps) // bs)
    pool = torch.zeros(batch * nblk, *model.kv_block_shape(bs), dtype=model.embed.weight.dtype)
    tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
    model(make_batch([Seq([7] * ctx, 0, t, False) for t in tables], bs), pool)  # the context
    dec = [make_batch([Seq([5], ctx + s, t, True) for t in tables], bs) for s in range(steps)]
    return batch * steps / best_time(lambda: [model(d, pool) for d in dec], 2)


def hf_decode_speed(hf, batch: int, ctx: int = 128, steps: int = 8) -> float:
    from transformers import DynamicCache
    ids = torch.full((batch, ctx), 7)

    def run():
        cache = DynamicCache()
        nxt = hf(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(steps):
            nxt = hf(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return (time.perf_counter() - t) / steps
    with torch.no_grad():
        return batch / min(run() for _ in range(2))


def offline_prompts(cfg, n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, cfg.vocab_size) for _ in range(rng.randint(32, 128))]
            for _ in range(n)]


def engine_run(model, prompts, out_len: int, timers: dict | None = None) -> float:
    """Tokens/s of our engine generating out_len greedy tokens for every prompt, all at once."""
    eng = Engine(EngineConfig(policy="fcfs", max_num_seqs=len(prompts),
                              max_num_batched_tokens=512), model, None)
    if timers is not None:
        cuda = next(model.parameters()).is_cuda
        sync = torch.cuda.synchronize if cuda else None
        for name, obj, attr in (("schedule", eng.sched, "schedule"),
                                ("forward", eng.runner, "execute"), ("sampling", eng, "_sample")):
            setattr(obj, attr, timed_call(getattr(obj, attr), timers, name, sync))
    t = time.perf_counter()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    if timers is not None:
        timers["steps"] = eng.sched.num_steps
    return len(prompts) * out_len / (time.perf_counter() - t)


def timed_call(fn, timers: dict, name: str, sync=None):
    """fn, adding its wall time to timers[name] (after sync(), so a GPU's work counts)."""
    def wrapped(*args, **kw):
        t = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            if sync:
                sync()
            timers[name] = timers.get(name, 0.0) + time.perf_counter() - t
    return wrapped


def op_kinds(prof, cuda: bool = False) -> dict:
    """Self time per operator kind (tools/profiles.py) in a torch.profiler run, in microseconds;
    on a GPU the operators' device time."""
    ops: dict = {}
    for e in prof.key_averages():
        kind = profiles.kind(e.key)
        ops[kind] = ops.get(kind, 0.0) + (e.self_device_time_total if cuda
                                          else e.self_cpu_time_total)
    return ops


def step_split(model, prompts, out_len: int) -> dict:
    """Milliseconds per engine step: scheduling, sampling, and the forward split by operator
    (GEMMs, KV gather, attention, KV write, other ops); 'python' is the rest of the step."""
    timers: dict = {}
    t0 = time.perf_counter()
    engine_run(model, prompts, out_len, timers)
    total = time.perf_counter() - t0
    with torch.profiler.profile() as prof:   # op shares of the forward, from a second run
        engine_run(model, prompts, max(2, out_len // 4))
    ops = op_kinds(prof, next(model.parameters()).is_cuda)
    op_total = sum(ops.values())
    steps = timers["steps"]
    split = {k: 1e3 * timers["forward"] * v / op_total / steps for k, v in ops.items()}
    split |= {"schedule": 1e3 * timers["schedule"] / steps,
              "sampling": 1e3 * timers["sampling"] / steps}
    split["python"] = 1e3 * total / steps - sum(split.values())
    return split


def op_split(fn, reps: int = 3) -> tuple[float, dict]:
    """(best wall seconds of fn, {operator kind: CPU seconds per call}) under torch.profiler."""
    wall = best_time(fn, reps)
    with torch.profiler.profile() as prof:
        for _ in range(reps):
            fn()
    return wall, {k: v / 1e6 / reps for k, v in op_kinds(prof).items()}


def profile_steps(models: dict, peak: float, batch: int = 32, ctx: int = 128,
                  chunk: int = 256) -> None:
    """Where a decode step (batch x 1 token over ctx of context) and a chunked prefill step
    (one chunk of `chunk` prompt tokens) spend their time, per operator kind, next to the step's
    FLOPs and bytes (weights once, KV read per token of context)."""
    bs = 16
    for name, model in models.items():
        cfg, dtype = model.cfg, model.embed.weight.dtype
        size = torch.finfo(dtype).bits // 8
        wsize = 4 if dtype == torch.bfloat16 and speed.WIDEN_BF16 else size  # packed weights
        params = sum(p.numel() for p in model.parameters())
        head = model.lm_head.weight.numel()  # the embedding is a lookup; the head runs per logit
        body = params - model.embed.weight.numel() - head * (model.lm_head.weight
                                                             is not model.embed.weight)
        kv_tok = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * size
        attn_tok = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # QK^T + PV per ctx token
        nblk = -(-(ctx + chunk) // bs)
        pool = torch.zeros(batch * nblk, *model.kv_block_shape(bs), dtype=dtype)
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(batch)]
        model(make_batch([Seq([7] * ctx, 0, t, False) for t in tables], bs), pool)
        dec = make_batch([Seq([5], ctx, t, True) for t in tables], bs)
        pre = make_batch([Seq([9] * chunk, 0, tables[0], False)], bs)
        for label, fn, tokens, logits, pairs, kv_read in (
                (f"decode, batch {batch} x ctx {ctx}", lambda: model(dec, pool), batch, batch,
                 batch * ctx, batch * ctx * kv_tok),
                (f"prefill chunk of {chunk}", lambda: model(pre, pool), chunk, 0,
                 chunk * (chunk + 1) // 2, chunk * kv_tok)):
            wall, ops = op_split(fn)
            flops = 2 * body * tokens + 2 * head * logits + attn_tok * pairs
            nbytes = (body + head * bool(logits)) * wsize + kv_read
            split = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(ops.items(),
                                                                     key=lambda kv: -kv[1]))
            print(f"  {name} {label}: {1e3 * wall:.1f} ms; {flops / 1e9:.1f} GFLOP "
                  f"({flops / wall / 1e9:.0f} GFLOP/s, {flops / wall / peak:.0%} of the fp32 "
                  f"peak), {nbytes / 2**20:.0f} MiB read; ms: {split}")


def hf_generate_batch(hf, prompts, out_len: int, num_seqs: int) -> float:
    """Tokens/s of HF transformers' continuous batching (generate_batch) on the same work."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    logging.getLogger("transformers").setLevel(logging.ERROR)
    gc = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(max_batch_tokens=512, max_requests_per_batch=num_seqs)
    hf.generate_batch(prompts[:2], generation_config=gc, continuous_batching_config=cbc)
    t = time.perf_counter()
    out = hf.generate_batch(prompts, generation_config=gc, continuous_batching_config=cbc,
                            warmup=False)
    return sum(len(o.generated_tokens) for o in out.values()) / (time.perf_counter() - t)


def hf_generate(hf, prompts, out_len: int) -> float:
    """Tokens/s of plain HF generate on the prompts as one left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                    do_sample=False, pad_token_id=0)
    return len(prompts) * out_len / (time.perf_counter() - t)


def run_speed(num_requests: int = 32, out_len: int = 64, batches=(1, 32, 64)) -> dict:
    cfg, tensors = read_gguf(embedded_gguf_path())
    hf = hf_reference(cfg, {k: v.clone() for k, v in tensors.items()})
    copy = {k: v.clone() for k, v in tensors.items()}
    ours = build_model(cfg, copy, "cpu", torch.float32, "embedded")
    ours16 = build_model(cfg, tensors, "cpu", torch.bfloat16, "embedded")
    peak, bw = machine_limits()
    params = sum(p.numel() for p in ours.layers.parameters()) + cfg.vocab_size * cfg.hidden_size
    flop_tok = 2 * params
    weight_bytes = sum(p.numel() * 4 for p in ours.parameters())
    print(f"machine: {torch.get_num_threads()} threads; fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, "
          f"memory {bw / 1e9:.1f} GB/s (copy, read + write); model {flop_tok / 1e9:.3f} GFLOP and "
          f"{weight_bytes / 2**20:.0f} MiB of fp32 weights a decode step")
    res = {"peak_flops": peak, "memory_bw": bw, "flop_per_token": flop_tok}
    print(f"\n{'decode':<8}{'batch':>6}{'ours fp32':>11}{'HF fp32':>9}{'ours bf16':>11}"
          f"{'GFLOP/s':>9}{'of peak':>8}{'weight GB/s':>12}")
    for B in batches:
        o, h, o16 = decode_speed(ours, B), hf_decode_speed(hf, B), decode_speed(ours16, B)
        res[f"decode_b{B}"] = {"ours": o, "hf": h, "ours_bf16": o16}
        print(f"{'':<8}{B:>6}{o:11.1f}{h:9.1f}{o16:11.1f}{o * flop_tok / 1e9:9.0f}"
              f"{o * flop_tok / peak:8.0%}{o / B * weight_bytes / 1e9:12.1f}")
    prompts = offline_prompts(cfg, num_requests)
    e = {"ours": engine_run(ours, prompts, out_len),
         "ours_bf16": engine_run(ours16, prompts, out_len),
         "hf_generate_batch": hf_generate_batch(hf, prompts, out_len, num_requests),
         "hf_generate": hf_generate(hf, prompts, out_len)}
    res["engine"] = e
    print(f"\nengine: {num_requests} prompts of 32-128 tokens x {out_len} greedy tokens, tokens/s:")
    for k, label in (("ours", "superinfer fp32"), ("ours_bf16", "superinfer bf16"),
                     ("hf_generate_batch", "HF generate_batch"), ("hf_generate", "HF generate")):
        print(f"  {label:<20}{e[k]:8.1f}   {e[k] / e['hf_generate_batch']:5.2f}x generate_batch")
    split = step_split(ours, prompts, out_len)
    res["step_ms"] = split
    print("  a step of superinfer fp32, ms: " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
    return res


def bench_gemm(rows=(1, 32, 256)) -> None:
    """Each of the embedded model's weight shapes through F.linear (what model.py calls) and
    through oneDNN's matmul (torch.ops.mkldnn._linear_pointwise, the op torch.compile's CPU
    backend emits), and the resident memory oneDNN kept after one call per row count: it caches
    state per input shape, and an engine step's row count changes every step."""
    import torch.nn.functional as F
    cfg, _ = read_gguf(embedded_gguf_path())
    kvh = cfg.num_kv_heads * cfg.head_dim
    shapes = {"wqkv": (cfg.hidden_size, cfg.num_heads * cfg.head_dim + 2 * kvh),
              "wo": (cfg.num_heads * cfg.head_dim, cfg.hidden_size),
              "w13": (cfg.hidden_size, 2 * cfg.intermediate_size),
              "w2": (cfg.intermediate_size, cfg.hidden_size),
              "lm_head": (cfg.hidden_size, cfg.vocab_size)}
    dnn = lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    # without bf16 instructions oneDNN has no bf16 inner product here (cpu/speed.py WIDEN_BF16)
    dtypes = (torch.float32,) + (() if speed.WIDEN_BF16 else (torch.bfloat16,))
    print(f"{'weight':<9}{'dtype':>9}{'rows':>6}{'F.linear ms':>13}{'oneDNN ms':>11}"
          f"{'packed ms':>11}{'GFLOP/s':>9}{'speed-up':>10}{'max |diff|':>12}")
    with torch.inference_mode():
        for dtype in dtypes:
            for name, (k, n) in shapes.items():
                w = torch.randn(n, k, dtype=dtype) * 0.02
                # as speed.pack_weights does
                packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
                for m in rows:
                    x = torch.randn(m, k, dtype=dtype)
                    a = best_time(lambda: F.linear(x, w), 10)
                    b = best_time(lambda: dnn(x, w), 10)
                    c = best_time(lambda: dnn(x, packed), 10)
                    diff = (dnn(x, packed) - F.linear(x, w)).abs().max().item()
                    print(f"{name:<9}{str(dtype)[6:]:>9}{m:>6}{a * 1e3:13.3f}{b * 1e3:11.3f}"
                          f"{c * 1e3:11.3f}{2 * m * k * n / c / 1e9:9.0f}{a / c:9.2f}x"
                          f"{diff:12.2e}")
        rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        w, before = torch.randn(cfg.vocab_size, cfg.hidden_size), rss()
        for m in range(1, 257):
            dnn(torch.randn(m, cfg.hidden_size), w)
        print(f"oneDNN, lm_head at 1..256 rows once each: resident memory "
              f"+{rss() - before:.0f} MiB")


# ---------------------------------------------------------------- KV copies

def bench_copies(total_mib: int = 256, block_size: int = 16, layers: int = 30, kv_heads: int = 3,
                 head_dim: int = 64, dtype=torch.float32, device: str | None = None) -> dict:
    """Move the same blocks every way and report GB/s next to a plain contiguous copy."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = (layers, 2, block_size, kv_heads, head_dim)
    bb = block_bytes(shape, dtype)
    n = max(1, total_mib * 2**20 // bb)
    pools = KVPools(2 * n, 2 * n, shape, dtype, device)
    pools.device.normal_()
    pools.host.normal_()
    out_pairs = list(zip(range(n), range(n)))          # device blocks [0, n) -> host [0, n)
    in_pairs = list(zip(range(n, 2 * n), range(n, 2 * n)))
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    flat_dev, flat_host = pools.device[:n].view(-1), pools.host[:n].view(-1)
    nbytes = n * bb
    gbs = lambda fn, k=1: k * nbytes / best_time(fn, 5, sync) / 1e9
    copier = DuplexCopier(pools)
    epoch = iter(range(10**9))
    return {"device": str(device), "blocks": n, "block_bytes": bb, "mib": nbytes / 2**20,
            "bytes_per_layer_copy": bb // (2 * layers),
            "plain_d2h": gbs(lambda: flat_host.copy_(flat_dev, non_blocking=True)),
            "per_layer_d2h": gbs(lambda: copy_per_layer(pools.device, pools.host, out_pairs)),
            "merged_d2h": gbs(lambda: copy_merged(pools.device, pools.host, out_pairs)),
            "merged_h2d": gbs(lambda: copy_merged(pools.host, pools.device, in_pairs)),
            "duplex_total": gbs(lambda: (copier.submit(next(epoch), out_pairs, in_pairs),
                                         copier.synchronize()), 2)}


def print_copies(r: dict) -> None:
    plain = r["plain_d2h"]
    print(f"Copy benchmark on {r['device']}: {r['blocks']} blocks x "
          f"{r['block_bytes'] / 2**10:.0f} KiB ({r['mib']:.0f} MiB), SmolLM2-135M KV shape, "
          f"{r['bytes_per_layer_copy'] / 2**10:.0f} KiB per layer copy")
    print(f"{'path':<34}{'GB/s':>8}{'vs plain':>10}")
    for key, label in (("plain_d2h", "plain contiguous copy"),
                       ("per_layer_d2h", "per-layer per-block (vLLM v0)"),
                       ("merged_d2h", "merged block-first, d->h"),
                       ("merged_h2d", "merged block-first, h->d"),
                       ("duplex_total", "duplex, both directions (total)")):
        print(f"{label:<34}{r[key]:8.2f}{r[key] / plain:9.2f}x")
    print(f"merged / per-layer: {r['merged_d2h'] / r['per_layer_d2h']:.1f}x")


def main(argv=None) -> None:
    ap = Parser(prog="python -m tools.bench_speed", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", action="store_true", help="the KV copy benchmark instead")
    ap.add_argument("--profile", action="store_true",
                    help="where a decode step and a prefill chunk spend their time, fp32 and bf16")
    ap.add_argument("--gemm", action="store_true",
                    help="the model's weight shapes through F.linear and through oneDNN")
    ap.add_argument("--requests", type=int, default=32, help="requests in the engine benchmark")
    ap.add_argument("--output", type=int, default=64, help="tokens each generates")
    ap.add_argument("--mib", type=int, default=256, help="copies: KV bytes moved each way (MiB)")
    ap.add_argument("--device", default=None, help="copies: cpu or cuda")
    ap.add_argument("--batch", type=int, default=32, help="profile: decodes in the step")
    ap.add_argument("--ctx", type=int, default=128, help="profile: their tokens of context")
    args = ap.parse_args(argv)
    for name in ("requests", "output", "mib", "batch", "ctx"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.copies:
        print_copies(bench_copies(args.mib, device=args.device))
    elif args.gemm:
        bench_gemm()
    elif args.profile:
        cfg, tensors = read_gguf(embedded_gguf_path())
        models = {d: build_model(cfg, {k: v.clone() for k, v in tensors.items()}, "cpu",
                                 getattr(torch, d), "embedded") for d in ("float32", "bfloat16")}
        peak, _ = machine_limits()
        print(f"fp32 matmul peak {peak / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads")
        profile_steps(models, peak, args.batch, args.ctx)
    else:
        run_speed(args.requests, args.output)


if __name__ == "__main__":
    main()
