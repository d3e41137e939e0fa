"""SuperInfer engine: the step loop, the vLLM-style LLM / SamplingParams API, and the CLI.

    now -> sched.schedule(now) -> StepPlan
        -> copier.submit(swap_out, swap_in)      both directions in flight together
        -> model(batch, kv pool)                 waits only for this step's swap-ins
        -> sample -> sched.update(tokens, now)   streamed tokens, finished requests

    python superinfer.py "Why is the sky blue?"
"""
from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kv import BlockManager, DuplexCopier, KVPools, block_bytes, blocks_for_budget
from model import Llama, load_model, make_batch, resolve_dtype
from sched import Request, Scheduler, Status, make_policy

SCHEDULER_PARAMS = ("xfer_budget", "ttft_slo", "tbt_slo", "host_admit_limit", "log_path")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 (or -1) = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    rotations: int = 0
    recomputes: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    error: ValueError | None = None   # set when the request was rejected; others still ran

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenEvent:
    """One streamed token (step() returns these)."""
    request_id: str
    token_id: int
    finished: bool
    finish_reason: str | None


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """One token per row; greedy rows are one argmax, the rest temperature / top-k / top-p."""
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.temperature == 0:
            continue
        row = logits[i].cpu() / p.temperature  # per-request CPU generators: same draws on any device
        if p.top_k > 0:
            kth = torch.topk(row, min(p.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, idx = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p   # keep the smallest prefix reaching top_p
            row = row.scatter(0, idx[drop], float("-inf"))
        out[i] = int(torch.multinomial(row.softmax(-1), 1, generator=gens[i]))
    return out


class Engine:
    """Owns the model, the KV pools, the copier and the scheduler; step() runs one iteration."""

    def __init__(self, model: Llama, tokenizer=None, *, policy: str = "rotasched", block_size: int = 16,
                 num_device_blocks: int | None = None, num_host_blocks: int | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                 clock: Callable[[], float] | None = None, **params):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.clock = clock or time.perf_counter
        sched_params = {k: params.pop(k) for k in SCHEDULER_PARAMS if k in params}
        pol = make_policy(policy, **params)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        shape = model.kv_block_shape(block_size)
        if num_device_blocks is None:  # a GPU gets most of its free memory; a CPU 256 MiB
            num_device_blocks = blocks_for_budget(0.8 if self.device.type == "cuda" else 2**28, shape,
                                                  self.dtype, self.device)
        if num_host_blocks is None:  # twice the device pool, within a quarter of the free host memory
            num_host_blocks = min(2 * num_device_blocks, blocks_for_budget(0.25, shape, self.dtype, torch.device("cpu")))
        self.pools = KVPools(num_device_blocks, num_host_blocks, shape, self.dtype, self.device)
        self.block_bytes = block_bytes(shape, self.dtype)
        self.bm = BlockManager(num_device_blocks, num_host_blocks, block_size, duplex=pol.duplex)
        self.copier = DuplexCopier(self.pools, duplex=pol.duplex)
        self.sched = Scheduler(self.bm, pol, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, **sched_params)
        self.max_model_len = model.cfg.max_position_embeddings
        self.eos = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.params: dict[str, SamplingParams] = {}
        self.gens: dict[str, torch.Generator] = {}
        self.texts: dict[str, str | None] = {}
        self.rng = torch.Generator().manual_seed(torch.seed() & 0xFFFF_FFFF)
        self.ids = itertools.count()
        self.steps = 0

    # ------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer(prompt).input_ids if prompt else []
        if not all(isinstance(t, int) and 0 <= t < self.model.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {self.model.cfg.vocab_size})")
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, request_id: str | None = None) -> str:
        """Queue one request; a ValueError names what is wrong with it and leaves the others untouched."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        rid = request_id if request_id is not None else str(next(self.ids))
        if not ids:
            raise ValueError(f"request {rid}: empty prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"request {rid}: {len(ids)} prompt + {params.max_tokens} output tokens exceed "
                             f"the model's context of {self.max_model_len} tokens")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        req = Request(rid, len(ids), params.max_tokens, self.clock() if arrival_time is None else arrival_time,
                      prompt=ids, priority=priority, stop_ids=frozenset(stop))
        self.sched.add(req)  # raises if it can never fit the KV pool
        self.params[rid] = params
        self.gens[rid] = torch.Generator().manual_seed(
            params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self.rng)))
        self.texts[rid] = prompt if isinstance(prompt, str) else None
        return rid

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    # ------------------------------------------------------------ one iteration
    def step(self) -> list[TokenEvent]:
        self.bm.copies_done(self.copier.completed_epoch())
        plan = self.sched.schedule(self.clock())
        self.copier.submit(plan.epoch, plan.swap_out, plan.swap_in)
        sampled: dict[str, int] = {}
        if plan.chunks:
            seqs, samplers = [], []
            for r, n in plan.chunks:
                last = r.num_computed + n == r.num_tokens
                seqs.append((r.token_slice(r.num_computed, r.num_computed + n), r.num_computed,
                             self.bm.block_table(r.rid), last))
                if last:
                    samplers.append(r.rid)
            batch = make_batch(seqs, self.bm.block_size, self.device)
            self.copier.wait_inputs()
            logits = self.model(batch, self.pools.device)
            toks = sample(logits, [self.params[rid] for rid in samplers], [self.gens[rid] for rid in samplers])
            sampled = dict(zip(samplers, toks))
        now = self.clock()
        finished = {r.rid for r in self.sched.update(plan, sampled, now)}
        self.steps += 1
        return [TokenEvent(rid, tok, rid in finished, self.sched.requests[rid].finish_reason)
                for rid, tok in sampled.items()]

    # ------------------------------------------------------------ results
    def output(self, rid: str) -> RequestOutput:
        r = self.sched.requests[rid]
        text = self.tokenizer.decode(r.output, skip_special_tokens=True) if self.tokenizer else ""
        m = RequestMetrics(r.arrival, r.token_times[0] if r.token_times else None, list(r.token_times),
                           r.token_times[-1] if r.status is Status.FINISHED else None, r.rotations, r.recomputes)
        return RequestOutput(rid, self.texts.get(rid), list(r.prompt or []), list(r.output), text,
                             r.finish_reason, m)

    def release(self, rid: str) -> None:
        """Forget a finished request's bookkeeping (long-running servers call this)."""
        for d in (self.params, self.gens, self.texts, self.sched.requests):
            d.pop(rid, None)

    def stats(self) -> dict:
        reqs = self.sched.requests.values()
        return {"steps": self.steps, "rotations": sum(r.rotations for r in reqs),
                "recomputes": sum(r.recomputes for r in reqs), "blocks_moved": self.copier.blocks_moved,
                "bytes_moved": self.copier.blocks_moved * self.block_bytes, "copies": self.copier.copies}


class LLM:
    """Offline inference, vLLM-style: LLM(model).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, *, policy: str = "rotasched", device=None, dtype=None,
                 block_size: int = 16, num_device_blocks: int | None = None, num_host_blocks: int | None = None,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, **policy_params):
        if device is not None:
            device = torch.device(device)
        if dtype is not None:
            dtype = resolve_dtype(dtype, device or torch.device("cpu"))
        m, tok = load_model(model, device, dtype)
        self.engine = Engine(m, tok, policy=policy, block_size=block_size, num_device_blocks=num_device_blocks,
                             num_host_blocks=num_host_blocks, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, **policy_params)
        self.tokenizer = tok

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (str or token-id lists) to completion; outputs in input order. A bad prompt gets
        an output with .error set (a ValueError naming the problem) and the others still complete."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        e = self.engine
        slots: list[str | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                slots.append(e.add_request(prompt, p))
            except ValueError as err:
                ids = prompt if isinstance(prompt, list) else []
                slots.append(RequestOutput("rejected", prompt if isinstance(prompt, str) else None, ids, [], "",
                                           "error", RequestMetrics(e.clock()), error=err))
        while e.has_unfinished():
            e.step()
        outs = []
        for s in slots:
            if isinstance(s, str):
                outs.append(e.output(s))
                e.release(s)
            else:
                outs.append(s)
        return outs

    def chat_prompt(self, message: str) -> str | list[int]:
        """The user message wrapped in the model's chat template, when it has one."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                      add_generation_prompt=True, return_dict=False)
        return message


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Generate a reply with SuperInfer (the embedded SmolLM2-135M-Instruct "
                                             "unless --model is given).")
    ap.add_argument("prompt", help="the user message")
    ap.add_argument("--model", default=None, help="HF Llama checkpoint directory or .gguf file (default: embedded)")
    ap.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--policy", default="rotasched",
                    help="scheduling policy: fcfs, fcfs-swap, priority, rotasched, rotasched-released")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU, bf16 on GPU)")
    ap.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    args = ap.parse_args(argv)
    llm = LLM(args.model, policy=args.policy, device=args.device, dtype=args.dtype)
    prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
    out = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                top_p=args.top_p, top_k=args.top_k, seed=args.seed))[0]
    if out.error:
        raise SystemExit(f"error: {out.error}")
    print(out.text)


if __name__ == "__main__":
    main()
