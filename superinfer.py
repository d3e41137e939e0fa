"""SuperInfer engine: its one config, the step loop, the vLLM-style LLM / SamplingParams API and
the command line.

    now -> sched.schedule(now) -> StepPlan
        -> runner.execute(copies, chunks)       both directions in flight, then the forward
        -> sample -> sched.update(tokens)       streamed tokens, finished requests

A step is atomic with respect to errors: if it fails, the requests it ran are aborted with the
error, their blocks freed, and the engine serves everything else.

    python superinfer.py "Why is the sky blue?"       a reply from the embedded model
    python superinfer.py serve --port 8000            the OpenAI-compatible server (serving/)
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable

import torch
from tokenizers.decoders import DecodeStream

from kv import CACHING, Runner, pool_sizes
from model import ModelLoadError, Seq
from parallel.tp import TPRunner
from sched import Request, Scheduler, Status, make_policy
from weights.loader import dtype_name, load_model, resolve_device

GREEDY_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


# ---------------------------------------------------------------- the config

class ConfigError(ValueError):
    """A setting out of range or of the wrong type; the message names the setting."""


def check_int(name: str, value, lo: int | None = None, hi: int | None = None,
              allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be {bounds}, got {value}")


def check_float(name: str, value, lo: float = 0.0, hi: float = math.inf,
                lo_open: bool = True) -> None:
    """A finite real in (lo, hi] (or [lo, hi] when lo_open is False); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        left, right = "(" if lo_open else "[", "]" if math.isfinite(hi) else ")"
        raise ConfigError(f"{name} must be in {left}{lo:g}, {hi:g}{right}, got {value}")


def setting(default, help: str, kind: type = str, lo=None, hi=None, choices=None):
    """One engine setting, stated once: its default, its --help text, its type and bounds or
    choices (EngineConfig checks them; the CLI, the server and bench.py make their flags from
    them)."""
    return field(default=default, metadata={"help": help, "kind": kind, "lo": lo, "hi": hi,
                                            "choices": choices})


U64 = 2**64 - 1


@dataclass
class EngineConfig:
    """Every engine setting, its one default and its validation: the engine, LLM, the CLI, the
    server, bench.py and the simulator all read their settings from here."""
    model: str | None = setting(None, "HF Llama checkpoint directory or .gguf file (default: "
                                "the embedded SmolLM2-135M-Instruct)")
    policy: str = setting("rotasched", "fcfs, priority, fcfs-swap, rotasched-lvf, rotasched, "
                          "rotasched-released; the paper's parameters as in "
                          "'rotasched:alpha=1,beta_f=0.3'")
    device: str | None = setting(None, "cpu, cuda or cuda:N (default: cuda if available)")
    dtype: object = setting(None, "float32, bfloat16 or float16 (default: float32 on CPU, "
                            "bfloat16 on GPU)")
    block_size: int = setting(16, "tokens per KV block", int, 1, 4096)
    num_device_blocks: int | None = setting(None, "KV blocks on the device (default: 80%% of "
                                            "free GPU memory, 256 MiB on a CPU)", int, 1, U64)
    num_host_blocks: int | None = setting(None, "KV blocks in host memory (default: twice the "
                                          "device pool, within a quarter of free RAM)", int, 0, U64)
    max_num_seqs: int = setting(32, "requests in one batch", int, 1)
    max_num_batched_tokens: int = setting(512, "tokens computed in one step", int, 1)
    xfer_budget: int = setting(2400, "B_xfer: KV blocks moved per step", int, 0)
    swap_watermark: int | None = setting(None, "rotasched-released: swap out when fewer blocks "
                                         "are free (their proactive_swap_budget; default: B_xfer)",
                                         int, 0, U64)
    ttft_slo: float = setting(5.0, "time-to-first-token SLO, seconds (per-request values "
                              "override it)", float, 0.0)
    tbt_slo: float = setting(0.1, "time-between-tokens SLO, seconds", float, 0.0)
    prefix_caching: str = setting("both", "reuse the KV of cached prompt prefixes: off, device, "
                                  "or both (the device, then the host pool)", choices=CACHING)
    host_admit_limit: float = setting(0.9, "hold new requests while host KV usage is above this "
                                      "fraction", float, 0.0, 1.0)
    swap_in_overlap: bool | None = setting(None, "on: a swapped-in request runs one step later, "
                                           "its copy under the forward; off: it runs at once and "
                                           "compute waits (default: on for CUDA)", bool)
    tensor_parallel_size: int = setting(1, "ranks to shard the model over", int, 1, 64)
    seed: int | None = setting(None, "engine seed for requests without their own", int,
                               -2**63, U64)
    log_path: str | None = setting(None, "write the JSON-lines schedule log here")

    def __post_init__(self):
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta["kind"] is int:
                check_int(f.name, value, meta["lo"], meta["hi"], allow_none=f.default is None)
            elif meta["kind"] is float:
                check_float(f.name, value, meta["lo"], meta["hi"] or math.inf)
            elif meta["kind"] is bool and value not in (None, True, False):
                raise ConfigError(f"{f.name} must be true, false or None, got {value!r}")
            elif meta["choices"] and value not in meta["choices"]:
                raise ConfigError(f"{f.name} must be one of {', '.join(meta['choices'])}, "
                                  f"got {value!r}")
        for name in ("model", "log_path"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a path or None, got {getattr(self, name)!r}")
        if not isinstance(self.policy, str):
            raise ConfigError(f"policy must be a name like 'rotasched', got {self.policy!r}")
        make_policy(self.policy)  # raises a ValueError naming what is wrong
        self.device = None if self.device is None else str(self.device)
        try:
            self.dtype = dtype_name(self.dtype)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                              f">= max_num_seqs ({self.max_num_seqs}): each sequence needs a token")

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        """Like EngineConfig(**kw) but an unknown keyword is a ConfigError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting {unknown[0]!r} "
                              f"(settings: {', '.join(sorted(known))})")
        return cls(**kw)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): what is wrong, and where to look."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


ON_OFF = {"on": True, "off": False}


def add_engine_flags(ap: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults) -> None:
    """--model, --policy, ... one flag per EngineConfig field; defaults are EngineConfig's."""
    group = ap.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        kind, text = f.metadata["kind"], f.metadata["help"]
        default = defaults.get(f.name, f.default)
        flag = "--log" if f.name == "log_path" else "--" + f.name.replace("_", "-")
        typed = {"choices": list(ON_OFF)} if kind is bool else {"type": kind}
        if f.metadata["choices"]:
            typed["choices"] = f.metadata["choices"]
        group.add_argument(flag, dest=f.name, default=default, **typed,
                           help=f"{text} (default: {default})" if default is not None else text)
    if "prefix_caching" not in skip:  # vLLM's spelling of "off"
        group.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const",
                           const="off", help="the same as --prefix-caching off")


def engine_config(ap: argparse.ArgumentParser, args, **override) -> EngineConfig:
    """The EngineConfig the flags describe; a bad value is a one-line error, before any loading."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if isinstance(values.get("swap_in_overlap"), str):
        values["swap_in_overlap"] = ON_OFF[values["swap_in_overlap"]]
    if values.get("model") is not None and not os.path.exists(os.path.expanduser(values["model"])):
        ap.error(f"--model: no such file or directory: {values['model']}")
    try:
        cfg = EngineConfig(**(values | override))
        resolve_device(cfg.device)
        return cfg
    except ValueError as e:
        ap.error(str(e))


# ---------------------------------------------------------------- requests and sampling

# what the blocks copied between the tiers were for (Engine.stats, the server's /metrics):
# DuplexKV's eager write-backs to host mirrors, rotations' copies out and back in, and cached
# prefixes loaded from the host tier
KV_COPIES = ("written_back", "rotated_out", "rotated_in", "prefix_loaded")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0     # 0 (or < 1e-5) = greedy
    top_p: float = 1.0
    top_k: int = 0               # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)          # stop strings (not in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0.0, lo_open=False)
        check_float("top_p", self.top_p, 0.0, 1.0)
        check_int("top_k", self.top_k, -1)
        check_int("seed", self.seed, -2**63, 2**64 - 1, allow_none=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s
                                                               for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got "
                             f"{self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            check_int("stop_token_ids[]", t, 0)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")


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
    finish_reason: str | None    # "stop", "length", "abort", "error"; None while running
    metrics: RequestMetrics
    error: Exception | None = None  # why the request was rejected or failed; others still ran
    num_cached_tokens: int = 0      # prompt tokens whose KV a cached prefix gave

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class TokenEvent:
    """One streamed token (step() returns these); text is its decoded piece, maybe empty."""
    request_id: str
    token_id: int
    text: str
    finished: bool
    finish_reason: str | None


class EngineError(RuntimeError):
    """A step failed; its requests were aborted with the error and the engine serves on."""


@dataclass(slots=True, eq=False)
class Sequence:
    """The engine's record of one request: the scheduler's Request and how to sample it."""
    req: Request
    params: SamplingParams
    gen: torch.Generator
    prompt_text: str | None
    stream: DecodeStream | None
    text: str = ""
    error: Exception | None = None


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
           width: int = 4096) -> list[int | None]:
    """One token per row; None where the row's logits are not finite. Greedy rows take the
    argmax; the others draw in float64 by inverse CDF over the vocabulary in its own order,
    one uniform number from the request's own generator (a seed gives the same tokens whatever
    the batch), after top-k and top-p filtering (keep_likeliest)."""
    top, out = logits.max(-1)  # the first maximum, as argmax; NaN if the row holds one
    out, ok = out.tolist(), (top.isfinite() & logits.amin(-1).isfinite()).tolist()
    rows = [i for i, p in enumerate(params) if ok[i] and p.temperature >= GREEDY_EPS]
    if rows:
        q = [params[i] for i in rows]
        temps = torch.tensor([p.temperature for p in q], dtype=torch.float64, device=logits.device)
        probs = (logits[rows].double() / temps[:, None]).softmax(-1)
        probs = keep_likeliest(probs, [p.top_k for p in q], [p.top_p for p in q], width)
        cdf = probs.cumsum(-1)
        u = torch.stack([torch.rand((), dtype=torch.float64, generator=gens[i]) for i in rows])
        pick = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None])
        for i, tok in zip(rows, pick[:, 0].clamp(max=cdf.shape[-1] - 1).tolist()):
            out[i] = tok
    return [t if ok[i] else None for i, t in enumerate(out)]


def keep_likeliest(probs: torch.Tensor, top_k: list[int], top_p: list[float],
                   width: int) -> torch.Tensor:
    """Each row's probabilities zeroed outside its top k tokens and, within those (renormalised),
    outside the nucleus of top_p: every token as likely as the last one kept stays, ties too
    (as vLLM's top-k). Only rows that filter are touched. Their kept tokens are found among the
    `width` likeliest (torch.topk) when these hold them all, else by sorting the vocabulary
    (several times slower)."""
    dev, vocab = probs.device, probs.shape[-1]
    sub = [j for j, (k, p) in enumerate(zip(top_k, top_p)) if 0 < k < vocab or p < 1]
    if not sub:
        return probs
    col = lambda xs, **kw: torch.tensor(xs, device=dev, **kw)[:, None]
    ps, nucleus = probs[sub], col([top_p[j] for j in sub], dtype=torch.float64)
    k = col([top_k[j] if 0 < top_k[j] < vocab else vocab for j in sub])
    for w in (min(vocab, int(k.where(k < vocab, width).max())), vocab):  # w >= every k
        p = ps.topk(w, dim=-1).values.masked_fill(torch.arange(w, device=dev) >= k, 0)
        c = p.cumsum(-1)  # p: the w likeliest, most likely first, zero beyond k
        cut = nucleus * torch.where(k < vocab, c[:, -1:], ps.sum(-1, keepdim=True))
        if ((k <= w) | (c[:, -1:] > cut)).all():
            break  # every row's kept tokens are among these w
    least = p.masked_fill((c - p > cut) | (p == 0), math.inf).amin(-1, keepdim=True)
    probs[sub] = ps.masked_fill(ps < least, 0.0)
    return probs


class Engine:
    """Owns the scheduler and a runner (model, KV pools, copier); step() runs one iteration."""

    def __init__(self, cfg: EngineConfig | None = None, model=None, tokenizer=None,
                 clock: Callable[[], float] | None = None, streams=None, **settings):
        self.cfg = cfg = cfg or EngineConfig.from_kwargs(**settings)
        if cfg.tensor_parallel_size > 1:
            self.runner = TPRunner(cfg, model)
            model, tokenizer = self.runner.model, tokenizer or self.runner.tokenizer
        elif model is None:
            model, tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
        self.model, self.tokenizer = model, tokenizer
        if cfg.swap_in_overlap is None:  # overlap a swap-in with compute where copies are async
            overlap = next(model.parameters()).device.type == "cuda"
            self.cfg = cfg = replace(cfg, swap_in_overlap=overlap)
        self.clock = clock or time.perf_counter
        dev_blocks, host_blocks = pool_sizes(model, cfg, next(model.parameters()).device)
        self.sched = Scheduler.create(cfg, dev_blocks, host_blocks)
        self.bm = self.sched.bm
        if cfg.tensor_parallel_size > 1:
            self.runner.start(cfg, dev_blocks, host_blocks, self.sched.policy.duplex)
        else:
            self.runner = Runner(model, cfg, dev_blocks, host_blocks, self.sched.policy.duplex,
                                 streams)
        self.max_model_len = model.cfg.max_position_embeddings
        self.eos = set(model.cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos.add(tokenizer.eos_token_id)
        self.seqs: dict[str, Sequence] = {}
        # since start (requests are released on the way); blocks copied between the tiers
        self.rotations = self.recomputes = 0
        self.blocks = dict.fromkeys(KV_COPIES, 0)
        self.rng = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None
                                                 else secrets.randbits(63))
        self.ids = itertools.count()

    # ------------------------------------------------------------ requests
    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt (text or ids); ValueError for anything else."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            try:
                return self.tokenizer(prompt).input_ids
            except (TypeError, ValueError, UnicodeError) as e:
                raise ValueError(f"prompt: cannot tokenize this text ({e})") from None
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        vocab = self.model.cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)

    def add_request(self, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    request_id: str | None = None, ttft_slo: float | None = None,
                    tbt_slo: float | None = None) -> str:
        """Queue one request. Everything is checked first: a ValueError names what is wrong and
        leaves the engine as it was."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        check_int("priority", priority, -2**31, 2**31)
        for name, slo in (("ttft_slo", ttft_slo), ("tbt_slo", tbt_slo)):
            if slo is not None:
                check_float(name, slo)
        arrival = self.clock() if arrival_time is None else arrival_time
        check_float("arrival_time", arrival, -math.inf, lo_open=False)
        rid = str(next(self.ids)) if request_id is None else request_id
        if not isinstance(rid, str) or rid in self.seqs:
            raise ValueError(f"request_id must be a new string, got {rid!r}")
        ids = self.encode(prompt)
        if not ids or prompt == "":  # "" is empty even where the tokenizer would add a BOS
            raise ValueError(f"request {rid}: empty prompt")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"request {rid}: {len(ids)} prompt + {params.max_tokens} output "
                             f"tokens exceed the model's context of {self.max_model_len} tokens")
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)
        req = Request(rid, len(ids), params.max_tokens, arrival, prompt=ids, priority=priority,
                      ttft_slo=ttft_slo, tbt_slo=tbt_slo, stop_ids=frozenset(stop))
        self.sched.add(req)  # raises (changing nothing) if it can never fit the KV pool
        seed = params.seed if params.seed is not None else int(
            torch.randint(2**62, (), generator=self.rng))
        stream = DecodeStream(skip_special_tokens=True) if self.tokenizer is not None else None
        self.seqs[rid] = Sequence(req, params, torch.Generator().manual_seed(seed),
                                  prompt if isinstance(prompt, str) else None, stream)
        return rid

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    # ------------------------------------------------------------ one iteration
    def step(self) -> list[TokenEvent]:
        self.bm.copies_done(self.runner.completed_epoch())
        plan = self.sched.schedule(self.clock())
        seqs = [Seq(r.token_slice(r.num_computed, r.num_computed + n), r.num_computed,
                    self.bm.block_table(r.rid), r.num_computed + n == r.num_tokens)
                for r, n in plan.chunks.items()]
        try:
            logits = self.runner.execute(plan.epoch, plan.swap_out, plan.swap_in, seqs)
            sampled = self._sample(plan, seqs, logits)
        except BaseException as e:
            self._fail(plan, e)
        self.rotations += len(plan.rotated_out)
        self.recomputes += len(plan.preempted)
        self.blocks["written_back"] += plan.written_back
        self.blocks["rotated_out"] += len(plan.swap_out) - plan.written_back
        self.blocks["rotated_in"] += len(plan.swap_in) - plan.prefix_in
        self.blocks["prefix_loaded"] += plan.prefix_in
        finished = {r.rid for r in self.sched.update(plan, sampled, self.clock())}
        return [self._emit(rid, tok, rid in finished) for rid, tok in sampled.items()]

    def _sample(self, plan, seqs: list[Seq], logits) -> dict[str, int]:
        """One token for each chunk that wants logits (the logits' rows, in that order)."""
        wanting = [self.seqs[r.rid] for r, q in zip(plan.chunks, seqs) if q.wants_logits]
        if not wanting:
            return {}
        toks = sample(logits, [s.params for s in wanting], [s.gen for s in wanting])
        sampled = {}
        for s, tok in zip(wanting, toks):
            if tok is None:  # this request alone fails; the rest of the batch goes on
                s.error = EngineError(f"request {s.req.rid}: the model produced non-finite logits")
                self.sched.abort(s.req.rid, reason="error")
            else:
                sampled[s.req.rid] = tok
        return sampled

    def _emit(self, rid: str, tok: int, finished: bool) -> TokenEvent:
        """Decode the token's text incrementally (multi-byte characters are never split) and
        finish the request at a stop string, which is left out of the text."""
        s = self.seqs[rid]
        piece = ""
        if s.stream is not None:
            piece = s.stream.step(self.tokenizer.backend_tokenizer, tok) or ""
        if s.params.stop:
            text = s.text + piece
            hits = [i for i in (text.find(x, max(0, len(s.text) - len(x))) for x in s.params.stop)
                    if i >= 0]
            if hits:
                piece = text[:min(hits)][len(s.text):]
                if finished:
                    s.req.finish_reason = "stop"
                else:
                    self.sched.finish(rid, "stop")
                finished = True
        s.text += piece
        return TokenEvent(rid, tok, piece, finished, s.req.finish_reason)

    def _fail(self, plan, err: BaseException):
        """A step raised: abort the requests it touched (their KV is unknown), let in-flight
        copies land, and report. The engine keeps serving the others."""
        touched = {r.rid for r in plan.chunks} | set(plan.rotated_in) | set(plan.rotated_out)
        try:
            self.runner.synchronize()
        finally:
            for rid in touched:
                s = self.seqs.get(rid)
                if s is not None and s.req.status not in (Status.FINISHED, Status.ABORTED):
                    s.error = EngineError(f"request {rid}: the step running it failed: {err!r}")
                    self.sched.abort(rid, reason="error")
            self.bm.copies_done(self.runner.completed_epoch())
        if not isinstance(err, Exception):
            raise err  # KeyboardInterrupt, SystemExit: the caller's, after the cleanup
        raise EngineError(f"step failed ({err!r}); its {len(touched)} requests were aborted, "
                          "the engine serves on") from err

    # ------------------------------------------------------------ results
    def output(self, rid: str) -> RequestOutput:
        s = self.seqs[rid]
        r = s.req
        times = list(r.token_times)
        done = times[-1] if r.status is Status.FINISHED and times else None
        m = RequestMetrics(r.arrival, times[0] if times else None, times, done, r.rotations,
                           r.recomputes)
        return RequestOutput(rid, s.prompt_text, list(r.prompt or []), list(r.output), s.text,
                             r.finish_reason, m, s.error, r.num_cached)

    def release(self, rid: str) -> None:
        """Forget a finished request (long-running servers call this)."""
        self.seqs.pop(rid, None)
        self.sched.requests.pop(rid, None)

    def stats(self) -> dict:
        copier = self.runner.copier
        return {"steps": self.sched.num_steps, "rotations": self.rotations,
                "recomputes": self.recomputes, "blocks_moved": copier.blocks_moved,
                "bytes_moved": copier.blocks_moved * self.block_bytes, "copies": copier.copies,
                **{f"{k}_bytes": n * self.block_bytes for k, n in self.blocks.items()},
                "running": len(self.sched.running), "waiting": len(self.sched.waiting),
                "rotary": len(self.sched.rotary), "device_usage": self.bm.usage("device"),
                "prefix_cache_queries": self.sched.cache_queries,
                "prefix_cache_hits": self.sched.cache_hits,
                "prefix_cache_host_hits": self.sched.cache_host_hits,
                "host_usage": self.bm.usage("host")}

    @property
    def block_bytes(self) -> int:
        pool = self.runner.pools.device
        return pool[0].numel() * pool.element_size() * self.cfg.tensor_parallel_size

    def close(self) -> None:
        self.sched.close()
        self.runner.close()


class LLM:
    """Offline inference, vLLM-style: LLM(model, **settings).generate(prompts, SamplingParams()).
    Settings are EngineConfig's fields."""

    def __init__(self, model: str | None = None, **settings):
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **settings))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        """An LLM over an engine built elsewhere (a model already in memory, a test's clock)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (text or token-id lists) to completion; outputs in input order. A prompt
        that cannot run gets an output with .error set and the others still complete."""
        if isinstance(prompts, (str, bytes)) or (isinstance(prompts, list) and prompts and all(
                isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # one prompt: text, or a list of token ids
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of prompts, got "
                             f"{type(prompts).__name__}")
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        e = self.engine
        slots: list[str | RequestOutput] = []
        for prompt, p in zip(prompts, params):
            try:
                slots.append(e.add_request(prompt, p))
            except Exception as err:  # any per-prompt failure is that prompt's error
                slots.append(RequestOutput("rejected", prompt if isinstance(prompt, str) else None,
                                           [], [], "", "error", RequestMetrics(e.clock()), err))
        ours = [s for s in slots if isinstance(s, str)]
        try:
            while any(e.seqs[rid].req.finish_reason is None for rid in ours):
                try:
                    e.step()
                except EngineError:
                    pass  # the failed step's requests carry the error; the rest go on
        except BaseException:
            for rid in ours:
                e.abort(rid)
            raise
        outs = [e.output(s) if isinstance(s, str) else s for s in slots]
        for rid in ours:
            e.release(rid)
        return outs

    def chat_prompt(self, message: str) -> str | list[int]:
        """The user message wrapped in the model's chat template, when it has one."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                                      add_generation_prompt=True, return_dict=False)
        return message

    def close(self) -> None:
        self.engine.close()


# ---------------------------------------------------------------- the command line

def generate_parser() -> Parser:
    ap = Parser(prog="superinfer", description="Generate a reply with SuperInfer. "
                "`python superinfer.py serve --help` for the server.")
    ap.add_argument("prompt", help="the user message")
    ap.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (128)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--request-seed", type=int, default=None, help="seed of this request")
    ap.add_argument("--no-chat", action="store_true", help="the prompt as is, no chat template")
    add_engine_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    """python superinfer.py PROMPT [flags]: arguments are checked before anything loads."""
    ap = generate_parser()
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.prompt:  # empty as everywhere else: no text (whitespace is text)
        ap.error("prompt: empty; give the message to answer")
    cfg = engine_config(ap, args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.request_seed)
    except ValueError as e:
        ap.error(str(e))
    try:
        llm = LLM(**vars(cfg))
    except (ModelLoadError, ValueError) as e:
        sys.exit(f"superinfer: error: {e}")
    try:
        prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
        out = llm.generate([prompt], params)[0]
    except KeyboardInterrupt:
        sys.exit("superinfer: interrupted")
    finally:
        llm.close()
    if out.error:
        sys.exit(f"superinfer: error: {out.error}")
    print(out.text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:  # the server sits above the engine: its own entry point
        root = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        os.execve(sys.executable, [sys.executable, "-m", "serving.server", *sys.argv[2:]], env)
    main()
