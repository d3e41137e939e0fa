"""One prepared check for a machine with a GPU: run it once, read one report.

    python -m tools.gpu_check --out gpu_report            (about 3-5 minutes on one H200)
    python -m tools.gpu_check --dry-run --out /tmp/dry    the same steps, small, on the CPU

1. the CUDA tests (real streams; one holds the out stream back with torch.cuda._sleep);
2. copy bandwidth of the engine's own paths, GB/s per direction and both at once, for merged
   block-first copies vs vLLM v0's per-layer per-block copies vs one plain pinned copy, at
   segments of 64 KiB to 64 MiB;
3. the embedded SmolLM2 in fp32 on CUDA: greedy tokens equal the CPU's, and equal across fcfs,
   fcfs-swap and rotasched with a device pool small enough to rotate;
4. a Llama-3-8B-shaped model with random bf16 weights: decode and prefill tokens/s at batch
   1/32/128 and the step's split (schedule / copies / forward).
Writes report.json and report.txt under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from kv import DuplexCopier, KVPools, block_bytes, copy_merged, copy_per_layer
from model import ModelConfig, Seq, make_batch
from superinfer import LLM, Engine, EngineConfig, Parser, SamplingParams
from tools.bench_speed import engine_run, offline_prompts, step_split
from weights.loader import load_model, random_model
from workload.metrics import best_time

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                        max_position_embeddings=8192)
TINY = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4,
                   num_heads=8, num_kv_heads=2, max_position_embeddings=4096)


def cuda_tests() -> dict:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-k", "cuda", "tests"],
                       capture_output=True, text=True)
    return {"returncode": r.returncode, "summary": r.stdout.strip().splitlines()[-1:],
            "seconds": time.perf_counter() - t, "output_tail": r.stdout[-3000:]}


def copy_sweep(device: torch.device, total_mib: int) -> list[dict]:
    """GB/s of each copy path at segments of 64 KiB .. 64 MiB (Llama-3-8B KV: a 64 KiB block
    is one layer of 16 tokens; vLLM v0 copies K and V of it separately, 32 KiB each)."""
    shape = (1, 2, 16, 8, 128)
    bb = block_bytes(shape, torch.bfloat16)
    n = total_mib * 2**20 // bb
    pools = KVPools(2 * n, 2 * n, shape, torch.bfloat16, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows, flat_d, flat_h = [], pools.device[:n].view(-1), pools.host[:n].view(-1)
    plain = n * bb / best_time(lambda: flat_h.copy_(flat_d, non_blocking=True), 3, sync) / 1e9
    for run in (1, 4, 16, 64, 256, 1024):
        # runs of `run` consecutive blocks, with a gap between runs so that they do not merge
        src = [b for start in range(0, n, 2 * run) for b in range(start, min(start + run, n))]
        out = list(zip(src, src))
        inn = [(n + s, n + d) for s, d in out]
        moved = len(out) * bb
        gbs = lambda fn, k=1: k * moved / best_time(fn, 3, sync) / 1e9
        row = {"segment_kib": run * bb // 1024, "plain_pinned_gbs": plain,
               "merged_d2h_gbs": gbs(lambda: copy_merged(pools.device, pools.host, out)),
               "merged_h2d_gbs": gbs(lambda: copy_merged(pools.host, pools.device, inn))}
        if run == 1:
            row["per_layer_d2h_gbs"] = gbs(lambda: copy_per_layer(pools.device, pools.host, out))
        copier, epoch = DuplexCopier(pools), iter(range(10**9))
        row["duplex_total_gbs"] = gbs(
            lambda: (copier.submit(next(epoch), out, inn), copier.synchronize()), 2)
        rows.append(row)
    return rows


def smollm_on_device(device: torch.device) -> dict:
    prompts = ["What is the capital of France?", "Write a haiku about the sea.",
               "List three prime numbers.", "Explain what a KV cache is."]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens = {}
    for where, policy, blocks in (("cpu", "fcfs", 512), (device.type, "fcfs", 512),
                                  (device.type, "fcfs-swap", 12), (device.type, "rotasched", 12)):
        model, tok = load_model(None, where, "float32")
        llm = LLM.from_engine(Engine(EngineConfig(policy=policy, block_size=8,
                                                  num_device_blocks=blocks, num_host_blocks=256,
                                                  max_num_seqs=4), model, tok))
        outs = llm.generate([llm.chat_prompt(p) for p in prompts], params)
        tokens[f"{where}/{policy}/{blocks}"] = [o.token_ids for o in outs]
        tokens[f"{where}/{policy}/{blocks}/rotations"] = llm.engine.stats()["rotations"]
        llm.close()
    runs = [v for k, v in tokens.items() if not k.endswith("rotations")]
    return {"all_equal": all(r == runs[0] for r in runs), "tokens": tokens}


def big_model_speed(cfg: ModelConfig, device: torch.device, dtype, batches) -> dict:
    model = random_model(cfg, device, dtype)
    res = {}
    for B in batches:
        ctx, bs, steps = 512, 16, 8
        nblk = -(-(ctx + steps) // bs)
        pool = torch.zeros(B * nblk, *model.kv_block_shape(bs), dtype=dtype, device=device)
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(B)]
        sync = torch.cuda.synchronize if device.type == "cuda" else None
        prefill_seqs = [Seq([7] * ctx, 0, t, False) for t in tables[:8]]
        pre = make_batch(prefill_seqs, bs, device)
        t_pre = best_time(lambda: model(pre, pool), 2, sync)
        dec = [make_batch([Seq([5], ctx + s, t, True) for t in tables], bs, device)
               for s in range(steps)]
        t_dec = best_time(lambda: [model(d, pool) for d in dec], 2, sync) / steps
        res[f"b{B}"] = {"prefill_tok_s": len(pre.input_ids) / t_pre, "decode_tok_s": B / t_dec}
    prompts = offline_prompts(cfg, 32)
    res["engine_tok_s"] = engine_run(model, prompts, 32)
    res["step_ms"] = step_split(model, prompts, 16)
    return res


def main(argv=None) -> None:
    ap = Parser(prog="python -m tools.gpu_check", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_report")
    ap.add_argument("--dry-run", action="store_true", help="small, on the CPU, to check the script")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: error: no CUDA device (use --dry-run on a CPU)")
    os.makedirs(args.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
              "torch": torch.__version__}
    steps = [("cuda_tests", cuda_tests),
             ("copies", lambda: copy_sweep(device, 64 if args.dry_run else 2048)),
             ("smollm", lambda: smollm_on_device(device)),
             ("llama3_8b_shape", lambda: big_model_speed(*(
                 (TINY, device, torch.float32, (1, 8)) if args.dry_run
                 else (LLAMA3_8B, device, torch.bfloat16, (1, 32, 128)))))]
    for name, fn in steps:
        t = time.perf_counter()
        try:
            report[name] = fn()
        except Exception as e:  # one failing part must not lose the others' results
            report[name] = {"error": repr(e)}
        print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(json.dumps(report, indent=1, default=str))
    brief = {k: v for k, v in report.items() if k != "smollm"}
    print(json.dumps(brief, indent=1, default=str)[:4000])


if __name__ == "__main__":
    main()
