"""Speed next to HF transformers on the same weights: the model (prefill and decode tokens/s at
batch 1 and 32) and the whole engine (an offline workload vs HF's continuous batching), with the
achieved FLOP/s against this machine's measured fp32 matmul peak.

    python bench_speed.py            (or python bench.py --speed)
"""
from __future__ import annotations

import argparse
import random
import time

from bench import hf_manager


def run_speed(prompt_len: int = 128, num_requests: int = 32) -> dict:
    import torch
    from transformers import DynamicCache
    from model import embedded_gguf_path, hf_reference, make_batch, read_gguf, build_model
    from superinfer import Engine, SamplingParams
    cfg, tensors = read_gguf(embedded_gguf_path())
    ours = build_model(cfg, tensors, "cpu", torch.float32, "embedded")
    hf = hf_reference(cfg, tensors)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    peak = max(2 * 1024**3 / timed(lambda: a @ b, 10) for _ in range(3))
    flop_tok = 2 * (sum(p.numel() for p in ours.layers.parameters()) + cfg.vocab_size * cfg.hidden_size)
    print(f"machine: {torch.get_num_threads()} threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; "
          f"model {flop_tok / 1e9:.3f} GFLOP/token -> decode roofline {peak / flop_tok:.0f} tok/s")
    res = {"peak_flops": peak, "flop_per_token": flop_tok}
    L, steps = prompt_len, 16
    print(f"\n{'':<10}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>7}   (prompt {L}, {steps} decode steps)")
    for B in (1, 32):
        ids = torch.randint(1000, cfg.vocab_size, (B, L))
        bs = 16
        nblk = -(-(L + steps) // bs)
        pool = torch.zeros(B * nblk, *ours.kv_block_shape(bs))
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(B)]
        pre = make_batch([(ids[i].tolist(), 0, tables[i], True) for i in range(B)], bs)
        t_pre = timed(lambda: ours(pre, pool), 1)
        dec = [make_batch([([5], L + s, tables[i], True) for i in range(B)], bs) for s in range(steps)]
        t_dec = timed(lambda: [ours(d, pool) for d in dec], 1) / steps
        with torch.no_grad():
            t_hpre = timed(lambda: hf(ids, past_key_values=DynamicCache(), use_cache=True), 1)
            def hf_decode():
                cache = DynamicCache()
                out = hf(ids, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                t = time.perf_counter()
                for _ in range(steps):
                    out = hf(nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
                return (time.perf_counter() - t) / steps
            t_hdec = min(hf_decode() for _ in range(2))
        for name, o, h in (("prefill", B * L / t_pre, B * L / t_hpre), ("decode", B / t_dec, B / t_hdec)):
            print(f"{name:<10}{B:>6}{o:12.1f}{h:10.1f}{o / h:6.2f}x")
            res[f"{name}_b{B}"] = {"ours": o, "hf": h}
    # the engine on an offline workload vs HF's own continuous batching, same weights
    rng = random.Random(0)
    n, lo, hi = num_requests, 64, 128
    plens = [rng.randint(32, 128) for _ in range(n)]
    olens = [rng.randint(lo, hi) for _ in range(n)]
    prompts = [[rng.randrange(1000, cfg.vocab_size) for _ in range(p)] for p in plens]
    total_out = sum(olens)
    eng = Engine(ours, None, policy="rotasched", max_num_seqs=32, max_num_batched_tokens=512)
    t = time.perf_counter()
    for p, o in zip(prompts, olens):
        eng.add_request(p, SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
    decode_steps = []
    while eng.has_unfinished():
        s = time.perf_counter()
        plan_tokens = len(eng.step())
        if plan_tokens == 32 and not eng.sched.waiting:
            decode_steps.append(time.perf_counter() - s)
    t_ours = time.perf_counter() - t
    mgr = hf_manager(hf, hi, max_num_seqs=32, max_tokens=512)
    outs = {}
    t = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, olens)):
        mgr.add_request(p, request_id=str(i), max_new_tokens=o)
    while len(outs) < n:
        r = mgr.get_result(timeout=1.0)
        if r is not None:
            outs[r.request_id] = r
    t_hf = time.perf_counter() - t
    mgr.stop(block=True)
    hf.destroy_cached_continuous_batching_manager()
    hf_tokens = sum(len(r.generated_tokens) for r in outs.values())
    dec_tok_s = 32 / (sum(decode_steps) / len(decode_steps)) if decode_steps else float("nan")
    print(f"\nengine, {n} requests (prompts 32-128, outputs {lo}-{hi}, ignore_eos), max 32 seqs:")
    print(f"  superinfer (rotasched) {total_out / t_ours:7.1f} tok/s   HF continuous batching "
          f"{hf_tokens / t_hf:7.1f} tok/s   ratio {total_out / t_ours / (hf_tokens / t_hf):.2f}x")
    print(f"  decode steps at batch 32: {dec_tok_s:.0f} tok/s = {dec_tok_s * flop_tok / 1e9:.0f} GFLOP/s, "
          f"{dec_tok_s * flop_tok / peak:.0%} of the matmul peak")
    res["engine"] = {"ours_tok_s": total_out / t_ours, "hf_tok_s": hf_tokens / t_hf, "decode_b32_tok_s": dec_tok_s}
    return res


def timed(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=128, help="prompt length for the model benchmark")
    ap.add_argument("--requests", type=int, default=32, help="requests in the engine benchmark")
    args = ap.parse_args(argv)
    run_speed(args.prompt, args.requests)


if __name__ == "__main__":
    main()
