"""Speed next to HF transformers on the same weights, and the KV copy paths.

    python bench_speed.py              model prefill/decode tokens/s at batch 1/32/64, the engine on
                                       32 x 64 greedy tokens vs HF generate_batch and generate,
                                       achieved GFLOP/s against this machine's measured peak
    python bench_speed.py --copies     KV copies: per-layer per-block (vLLM v0) vs merged
                                       block-first vs both directions at once, GB/s
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from config import EngineConfig, Parser
from kv import DuplexCopier, KVPools, block_bytes, copy_merged, copy_per_layer
from loader import build_model, embedded_gguf_path, hf_reference, read_gguf
from metrics import best_time
from model import Seq, make_batch
from superinfer import Engine, SamplingParams


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

def matmul_peak() -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return max(2 * 1024**3 / best_time(lambda: a @ b, 10) for _ in range(3))


def model_speed(ours, hf, cfg, prompt_len: int, batches=(1, 32)) -> dict:
    """Prefill and decode tokens/s of the bare models (ours with a paged pool, HF with its cache)."""
    from transformers import DynamicCache
    res, steps, bs = {}, 16, 16
    for B in batches:
        ids = torch.randint(1000, cfg.vocab_size, (B, prompt_len))
        nblk = -(-(prompt_len + steps) // bs)
        pool = torch.zeros(B * nblk, *ours.kv_block_shape(bs))
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(B)]
        pre = make_batch([Seq(ids[i].tolist(), 0, tables[i], True) for i in range(B)], bs)
        t_pre = best_time(lambda: ours(pre, pool), 1)
        dec = [make_batch([Seq([5], prompt_len + s, tables[i], True) for i in range(B)], bs)
               for s in range(steps)]
        t_dec = best_time(lambda: [ours(d, pool) for d in dec], 1) / steps
        with torch.no_grad():
            t_hpre = best_time(lambda: hf(ids, past_key_values=DynamicCache(), use_cache=True), 1)

            def hf_decode():
                cache = DynamicCache()
                nxt = hf(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                t = time.perf_counter()
                for _ in range(steps):
                    nxt = hf(nxt, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                return (time.perf_counter() - t) / steps
            t_hdec = min(hf_decode() for _ in range(2))
        res[f"prefill_b{B}"] = {"ours": B * prompt_len / t_pre, "hf": B * prompt_len / t_hpre}
        res[f"decode_b{B}"] = {"ours": B / t_dec, "hf": B / t_hdec}
    return res


def engine_speed(ours, hf, cfg, num_requests: int, out_len: int) -> dict:
    """The whole engine on an offline workload vs HF's continuous batching (generate_batch)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, cfg.vocab_size) for _ in range(rng.randint(32, 128))]
               for _ in range(num_requests)]
    eng = Engine(EngineConfig(policy="fcfs", max_num_seqs=num_requests), ours, None)
    t = time.perf_counter()
    for p in prompts:
        eng.add_request(p, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    decode_steps = []
    while eng.has_unfinished():
        s = time.perf_counter()
        n = len(eng.step())
        if n == num_requests and not eng.sched.waiting:
            decode_steps.append(time.perf_counter() - s)
    t_ours = time.perf_counter() - t
    mgr = hf_manager(hf, out_len, max_num_seqs=num_requests, max_tokens=512)
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        mgr.add_request(p, request_id=str(i), max_new_tokens=out_len)
    done = {}
    while len(done) < num_requests:
        r = mgr.get_result(timeout=1.0)
        if r is not None:
            done[r.request_id] = r
    t_hf = time.perf_counter() - t
    mgr.stop(block=True)
    hf.destroy_cached_continuous_batching_manager()
    total = num_requests * out_len
    hf_tokens = sum(len(r.generated_tokens) for r in done.values())
    step = sum(decode_steps) / len(decode_steps) if decode_steps else float("nan")
    return {"ours_tok_s": total / t_ours, "hf_tok_s": hf_tokens / t_hf,
            "decode_step_ms": 1e3 * step}


def run_speed(prompt_len: int = 128, num_requests: int = 32, out_len: int = 64) -> dict:
    cfg, tensors = read_gguf(embedded_gguf_path())
    hf = hf_reference(cfg, {k: v.clone() for k, v in tensors.items()})
    ours = build_model(cfg, tensors, "cpu", torch.float32, "embedded")
    peak = matmul_peak()
    flop_tok = 2 * (sum(p.numel() for p in ours.layers.parameters()) + cfg.vocab_size * cfg.hidden_size)
    print(f"machine: {torch.get_num_threads()} threads, fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; "
          f"model {flop_tok / 1e9:.3f} GFLOP/token -> decode roofline {peak / flop_tok:.0f} tok/s")
    res = {"peak_flops": peak, "flop_per_token": flop_tok}
    res |= model_speed(ours, hf, cfg, prompt_len)
    print(f"\n{'':<10}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>10}{'ratio':>7}   (prompt {prompt_len})")
    for key, r in res.items():
        if isinstance(r, dict):
            name, b = key.split("_b")
            print(f"{name:<10}{b:>6}{r['ours']:12.1f}{r['hf']:10.1f}{r['ours'] / r['hf']:6.2f}x")
    e = engine_speed(ours, hf, cfg, num_requests, out_len)
    res["engine"] = e
    dec = num_requests / (e["decode_step_ms"] / 1e3)
    print(f"\nengine, {num_requests} requests x {out_len} greedy tokens (prompts 32-128):")
    print(f"  superinfer {e['ours_tok_s']:7.1f} tok/s   HF generate_batch {e['hf_tok_s']:7.1f} tok/s"
          f"   ratio {e['ours_tok_s'] / e['hf_tok_s']:.2f}x")
    print(f"  decode steps at batch {num_requests}: {dec:.0f} tok/s = {dec * flop_tok / 1e9:.0f} "
          f"GFLOP/s, {dec * flop_tok / peak:.0%} of the matmul peak")
    return res


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
    print(f"Copy benchmark on {r['device']}: {r['blocks']} blocks x {r['block_bytes'] / 2**10:.0f} KiB "
          f"({r['mib']:.0f} MiB), SmolLM2-135M KV shape, {r['bytes_per_layer_copy'] / 2**10:.0f} KiB "
          "per layer copy")
    print(f"{'path':<34}{'GB/s':>8}{'vs plain':>10}")
    for key, label in (("plain_d2h", "plain contiguous copy"),
                       ("per_layer_d2h", "per-layer per-block (vLLM v0)"),
                       ("merged_d2h", "merged block-first, d->h"), ("merged_h2d", "merged block-first, h->d"),
                       ("duplex_total", "duplex, both directions (total)")):
        print(f"{label:<34}{r[key]:8.2f}{r[key] / plain:9.2f}x")
    print(f"merged / per-layer: {r['merged_d2h'] / r['per_layer_d2h']:.1f}x")


def main(argv=None) -> None:
    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", action="store_true", help="the KV copy benchmark instead")
    ap.add_argument("--prompt", type=int, default=128, help="prompt length for the model benchmark")
    ap.add_argument("--requests", type=int, default=32, help="requests in the engine benchmark")
    ap.add_argument("--output", type=int, default=64, help="tokens each generates")
    ap.add_argument("--mib", type=int, default=256, help="copies: KV bytes moved each way (MiB)")
    ap.add_argument("--device", default=None, help="copies: cpu or cuda")
    args = ap.parse_args(argv)
    for name in ("prompt", "requests", "output", "mib"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if args.copies:
        print_copies(bench_copies(args.mib, device=args.device))
    else:
        run_speed(args.prompt, args.requests, args.output)


if __name__ == "__main__":
    main()
