"""Workloads the tools share: the Azure trace, gamma/Poisson arrivals, synthetic prompts, and
prompts that share prefixes (multi-turn conversations, a shared system prompt, traces of
per-block prefix hashes).

Pure Python (no torch): bench.py drives the real engine with these, sim.py the simulator.
"""
from __future__ import annotations

import csv
import json
import os
import random
import statistics
from dataclasses import dataclass, replace
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRACE = os.path.join(ROOT, "data", "azure_llm_2023_conv.csv")  # the repository's copy


@dataclass(slots=True)
class Item:
    arrival: float      # seconds from the start of the run
    prompt_len: int
    output_len: int
    # where prompts share prefixes: the prompt as pieces of `unit` tokens, each named by an id;
    # two prompts whose first k ids are equal have the same first k * unit tokens
    pieces: tuple[int, ...] = ()
    unit: int = 16


class TraceError(ValueError):
    """A malformed trace file; the message names the file and line."""


def read_trace(path: str) -> list[tuple[float, int, int]]:
    """Azure LLM trace rows (TIMESTAMP,ContextTokens,GeneratedTokens) as (seconds, in, out)."""
    if not os.path.isfile(path):
        raise TraceError(f"{path}: no such trace file")
    rows = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        if header is None or [h.strip() for h in header[:3]] != want:
            raise TraceError(f"{path}:1: expected header {','.join(want)}, got {header}")
        for line, row in enumerate(reader, start=2):
            if row:
                rows.append(parse_row(path, line, row))
    if not rows:
        raise TraceError(f"{path}: no requests")
    if any(b[0] < a[0] for a, b in zip(rows, rows[1:])):
        raise TraceError(f"{path}: timestamps are not in order")
    t0 = rows[0][0]
    return [(t - t0, c, g) for t, c, g in rows]


def parse_row(path: str, line: int, row: list[str]) -> tuple[float, int, int]:
    try:
        stamp, ctx, gen = row[0].strip(), int(row[1]), int(row[2])
        fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in stamp else "%Y-%m-%d %H:%M:%S"
        t = datetime.strptime(stamp[:26], fmt)
    except (ValueError, IndexError) as e:
        raise TraceError(f"{path}:{line}: cannot parse {','.join(row)!r} ({e})") from None
    if ctx < 1 or gen < 1:
        raise TraceError(f"{path}:{line}: token counts must be >= 1, got {ctx},{gen}")
    return t.timestamp(), ctx, gen


@dataclass(frozen=True)
class Scaling:
    """How a trace's lengths shrink to a small machine: prompts and outputs scale separately,
    so a short output keeps a decode phase; each is then capped."""
    prompt: float = 1.0
    output: float = 1.0
    max_prompt: int = 10**9
    max_output: int = 10**9
    min_output: int = 1

    def apply(self, ctx: int, gen: int) -> tuple[int, int]:
        p = max(1, min(self.max_prompt, round(ctx * self.prompt)))
        o = max(self.min_output, min(self.max_output, round(gen * self.output)))
        return p, o


def trace_workload(rows, num: int, offset: int = 0, scaling: Scaling = Scaling(),
                   rate: float | None = None, time_scale: float = 1.0) -> list[Item]:
    """A slice of a trace with lengths scaled; arrivals rescaled to `rate` if given (keeping the
    trace's burstiness), else stretched by time_scale."""
    part = rows[offset:offset + num]
    if len(part) < num or num < 1:
        raise ValueError(f"trace has {len(rows)} requests; cannot take {num} from offset {offset}")
    t0 = part[0][0]
    span = part[-1][0] - t0
    scale = (len(part) - 1) / span / rate if rate and span > 0 else time_scale
    return [Item((t - t0) * scale, *scaling.apply(c, g)) for t, c, g in part]


def describe_scaling(rows, items: list[Item], offset: int, scaling: Scaling) -> str:
    """One line saying what the scaling did to the slice's lengths."""
    part = rows[offset:offset + len(items)]
    def stats(xs):
        return f"mean {statistics.mean(xs):.0f}, range {min(xs)}-{max(xs)}"
    return (f"prompts x{scaling.prompt:g} (cap {scaling.max_prompt}): "
            f"{stats([c for _, c, _ in part])} -> {stats([i.prompt_len for i in items])}; "
            f"outputs x{scaling.output:g} (cap {scaling.max_output}, floor {scaling.min_output}): "
            f"{stats([g for _, _, g in part])} -> {stats([i.output_len for i in items])}")


def synthetic_workload(num: int, rate: float, burstiness: float, prompt_lens, output_lens,
                       seed: int) -> list[Item]:
    """Gamma inter-arrivals (burstiness 1.0 = Poisson) and lengths drawn from the given lists."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(Item(t, rng.choice(prompt_lens), rng.choice(output_lens)))
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


WORKLOADS = {  # name -> (prompt x, output x): the trace's lengths reshaped into a class
    "conv": (1.0, 1.0),             # the conversation trace as it is
    "prefill-heavy": (4.0, 0.1),    # long prompts, a few output tokens
    "decode-heavy": (0.1, 4.0),     # short prompts, long outputs
    "multi-turn": (1.0, 1.0),       # the trace's lengths as conversations (with_sharing)
    "shared-prefix": (1.0, 1.0),    # the trace's lengths behind one system prompt
}


def reshape(lengths: list[tuple[int, int]], workload: str) -> list[tuple[int, int]]:
    """The (prompt, output) lengths of a workload class (WORKLOADS) drawn from a trace's."""
    fp, fo = WORKLOADS[workload]
    return [(max(1, round(p * fp)), max(1, round(o * fo))) for p, o in lengths]


def capped(prompt: int, output: int, max_len: int | None) -> tuple[int, int]:
    """A request's (prompt, output) lengths within max_len tokens in all, one of each at least."""
    if not max_len:
        return prompt, output
    prompt = min(prompt, max_len - 1)
    return prompt, max(1, min(output, max_len - prompt))


def random_arrivals(rate: float, duration: float, lengths: list[tuple[int, int]], seed: int,
                    max_len: int | None = None, max_requests: int = 10**6,
                    burstiness: float = 1.0) -> list[Item]:
    """Gamma inter-arrivals (burstiness = the gamma shape: 1 is Poisson, 1/CV^2 below it) over
    `duration` seconds, (prompt, output) lengths drawn from `lengths`, each request capped to
    max_len tokens in all."""
    rng = random.Random(seed)
    gap = lambda: rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    t, out = gap(), []
    while t < duration and len(out) < max_requests:
        out.append(Item(t, *capped(*rng.choice(lengths), max_len)))
        t += gap()
    return out


def with_rate(items: list[Item], rate: float) -> list[Item]:
    """The same requests and arrival pattern, time-scaled to an average of `rate` requests/s."""
    span = items[-1].arrival - items[0].arrival
    scale = (len(items) - 1) / span / rate if span > 0 else 1.0
    return [replace(i, arrival=(i.arrival - items[0].arrival) * scale) for i in items]


def synthetic_prompts(items: list[Item], vocab: int, seed: int) -> list[list[int]]:
    """Prompt token ids of exactly the requested lengths (ordinary tokens, no specials); an
    item with pieces gets each piece's tokens from the piece's id, so shared pieces are shared
    tokens."""
    rng = random.Random(seed)
    lo = min(1000, vocab // 4)

    def piece(i: int, unit: int) -> list[int]:
        r = random.Random(f"{seed}:{i}")
        return [r.randrange(lo, vocab) for _ in range(unit)]
    return [[t for i in it.pieces for t in piece(i, it.unit)][:it.prompt_len] if it.pieces else
            [rng.randrange(lo, vocab) for _ in range(it.prompt_len)] for it in items]


# ---------------------------------------------------------------- shared prefixes

SHARING = {  # workload classes whose prompts share prefixes (with_sharing)
    "multi-turn": "conversations of 4 turns, each resending the history (a shared system "
                  "prompt, the earlier messages and stand-ins for the replies)",
    "shared-prefix": "one system prompt of 128 tokens before every prompt",
}
# turns a conversation, tokens of the system prompt, tokens a piece; the think time between
# turns, in mean gaps between requests: enough other requests arrive meanwhile that a small
# device pool has moved on from a conversation when its next turn comes
TURNS, SYSTEM, UNIT, THINK = 4, 64, 16, 24


def with_sharing(items: list[Item], kind: str, max_len: int) -> list[Item]:
    """Items of a sharing class (SHARING) made from a workload's lengths and arrivals.

    multi-turn: each run of TURNS items is one conversation; turn k arrives THINK mean gaps
    after turn k - 1 and its prompt is the SYSTEM-token system prompt, every
    earlier user message and reply, and its own message (a quarter of the item's prompt). An
    open-loop replay cannot know the model's replies, so the history holds stand-ins of the
    replies' lengths: the earlier prompts are shared, the replies are computed again."""
    ids = iter(range(1, 10**9))
    up = lambda n: max(1, -(-n // UNIT))  # pieces for n tokens
    if kind == "shared-prefix":
        system = tuple(range(10**9, 10**9 + 128 // UNIT))
        out = [replace(it, pieces=system + tuple(next(ids) for _ in range(up(it.prompt_len))))
               for it in items]
        out = [replace(o, prompt_len=min(len(o.pieces) * UNIT, max_len - o.output_len))
               for o in out]
        return out
    gap = (items[-1].arrival - items[0].arrival) / max(1, len(items) - 1)
    system, out = tuple(range(10**9, 10**9 + SYSTEM // UNIT)), []
    for c in range(0, len(items), TURNS):
        history = system
        for k, it in enumerate(items[c:c + TURNS]):
            history += tuple(next(ids) for _ in range(up(it.prompt_len // TURNS)))
            if len(history) * UNIT + it.output_len > max_len:
                break  # the conversation outgrew the context
            out.append(Item(items[c].arrival + k * THINK * gap, len(history) * UNIT,
                            it.output_len, history, UNIT))
            history += tuple(next(ids) for _ in range(up(it.output_len)))
    return sorted(out, key=lambda i: i.arrival)


def read_hash_trace(path: str, unit: int = 512) -> list[Item]:
    """A trace of JSON lines with timestamp (ms), input_length, output_length and hash_ids (one
    id per `unit` prompt tokens, equal ids for equal prefixes), as production traces with
    prefix sharing are published."""
    if not os.path.isfile(path):
        raise TraceError(f"{path}: no such trace file")
    items = []
    with open(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                rec = json.loads(text)
                it = Item(rec["timestamp"] / 1e3, int(rec["input_length"]),
                          int(rec["output_length"]), tuple(rec["hash_ids"]), unit)
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{line}: not a hash-trace record ({e!r})") from None
            if it.prompt_len < 1 or it.output_len < 1 or len(it.pieces) * unit < it.prompt_len:
                raise TraceError(f"{path}:{line}: lengths must be >= 1 and hash_ids must cover "
                                 f"the prompt ({len(it.pieces)} x {unit} < {it.prompt_len})")
            items.append(it)
    if not items:
        raise TraceError(f"{path}: no requests")
    t0 = items[0].arrival
    return sorted((replace(i, arrival=i.arrival - t0) for i in items), key=lambda i: i.arrival)


# ---------------------------------------------------------------- a benchmark's workload

def add_workload_flags(ap) -> None:
    """The flags that choose a benchmark's requests (bench.py, tools/serve_compare.py)."""
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help="Azure-format trace CSV, a .jsonl trace of prefix hashes "
                         "(read_hash_trace), or 'none'")
    ap.add_argument("--trace-offset", type=int, default=0, help="first request of the trace slice")
    ap.add_argument("--num-requests", type=int, default=48, help="most requests a run")
    ap.add_argument("--prompt-scale", type=float, default=0.15, help="trace prompt lengths x this")
    ap.add_argument("--output-scale", type=float, default=0.3, help="trace output lengths x this")
    ap.add_argument("--min-output", type=int, default=8, help="shortest scaled output (tokens)")
    ap.add_argument("--max-len", type=int, default=384, help="cap on scaled prompts and outputs")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="replay the trace's own timing stretched by this factor (not calibrated)")
    ap.add_argument("--workload", default="conv", choices=list(WORKLOADS),
                    help="conv: the trace's lengths; prefill-heavy: prompts x4, outputs x0.1; "
                         "decode-heavy: prompts x0.1, outputs x4 (before the scales below); "
                         + "; ".join(f"{k}: {v}" for k, v in SHARING.items()))
    ap.add_argument("--burstiness", type=float, default=None,
                    help="gamma shape of the arrivals (1 = Poisson, 0.1 = bursty, CV 3.2); "
                         "default: the trace's own timing, Poisson for synthetic")
    ap.add_argument("--input-lens", default="64,128,256", help="synthetic prompt lengths")
    ap.add_argument("--output-lens", default="32,64,128", help="synthetic output lengths")
    ap.add_argument("--seed", type=int, default=0)


def build_workload(args, vocab: int, repeat: int = 0):
    """(items, prompts, description) the workload flags choose; repeat k takes seed + k and,
    from a trace, the k-th next slice of it, so each repeat has fresh arrivals and prompts."""
    seed, offset = args.seed + repeat, args.trace_offset + repeat * args.num_requests
    burst = args.burstiness or 1.0
    if args.trace == "none":
        items = synthetic_workload(args.num_requests, 1.0, burst, args.input_lens,
                                   args.output_lens, seed)
        text = f"synthetic: prompt lengths {args.input_lens}, output lengths {args.output_lens}"
    elif args.trace.endswith(".jsonl"):
        items, text = hash_trace_workload(args, offset)
    else:
        rows = read_trace(args.trace)
        fp, fo = WORKLOADS[args.workload]
        scaling = Scaling(args.prompt_scale * fp, args.output_scale * fo, args.max_len,
                          args.max_len, args.min_output)
        items = trace_workload(rows, args.num_requests, offset, scaling,
                               time_scale=args.time_scale or 1.0)
        text = (f"{args.workload}: trace {os.path.basename(args.trace)} requests [{offset}, "
                f"{offset + args.num_requests}); " + describe_scaling(rows, items, offset, scaling))
        if args.burstiness is not None:  # the trace's lengths, gamma arrivals of that shape
            gamma = synthetic_workload(len(items), 1.0, burst, [1], [1], seed)
            items = [Item(g.arrival, i.prompt_len, i.output_len) for g, i in zip(gamma, items)]
    if args.burstiness is not None:
        text += f"; gamma arrivals, shape {burst:g} (CV {burst ** -0.5:.1f})"
    if args.workload in SHARING:
        items = with_sharing(items, args.workload, args.max_len)
        text += f"; {SHARING[args.workload]}"
    return items, synthetic_prompts(items, vocab, seed), text


def count_requests(path: str) -> int:
    """Requests in a trace of either format (TraceError if it is malformed)."""
    return len(read_hash_trace(path) if path.endswith(".jsonl") else read_trace(path))


def hash_trace_workload(args, offset: int) -> tuple[list[Item], str]:
    """A slice of a trace of prefix hashes, its prompts scaled by shrinking each hashed piece
    (so the sharing is kept) and capped to whole pieces."""
    part = read_hash_trace(args.trace)[offset:offset + args.num_requests]
    if len(part) < args.num_requests:
        raise TraceError(f"{args.trace}: fewer than {offset + args.num_requests} requests")
    unit = max(1, round(part[0].unit * args.prompt_scale))
    out = []
    for it in part:
        n = min(args.max_len - 1, round(it.prompt_len * args.prompt_scale))
        o = max(args.min_output, min(args.max_len - n, round(it.output_len * args.output_scale)))
        out.append(Item(it.arrival * (args.time_scale or 1.0), max(1, n), o,
                        it.pieces[:-(-n // unit)], unit))
    t0 = out[0].arrival
    return [replace(i, arrival=i.arrival - t0) for i in out], \
        f"{os.path.basename(args.trace)} requests [{offset}, {offset + len(out)}), pieces of " \
        f"{unit} tokens"
