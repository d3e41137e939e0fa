"""A streaming client of any OpenAI-compatible server, for bench.py --policies openai.

Each request is sent at its arrival time on its own thread (POST /v1/completions, stream: true,
prompt as token ids); every streamed chunk that carries a token is timed on arrival here (not the
final chunk that only says why it finished, nor the usage chunk). So TTFT and every token gap
are measured on the client side, the same way for our server, vLLM or SGLang. The server's
/metrics, read before and after a run, give its rotations, recomputes and bytes moved where it
exposes them (ours, and vLLM's preemptions). Each run sends its prompts with a first token of
its own (the same lengths), so a server that stays up through several runs (the calibration,
each rate, each repeat) does not find one run's prompts in its prefix cache from another, while
the prompts of one run that share a prefix (multi-turn, a system prompt) still share it: replayed
prompts made vLLM's TTFT look up to 2x better.
"""
from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.parse
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from workload.metrics import progress
from workload.trace import Item


RUNS = itertools.count()  # serve() calls so far: each marks its prompts with its own first token
FIRST = 1000              # the first of those tokens: an ordinary token id of any vocabulary


def marked(prompt: list[int], run: int) -> list[int]:
    """The prompt with its first token replaced by the run's own."""
    return [FIRST + run] + prompt[1:]


def complete(base_url: str, model: str | None, prompt: list[int], max_tokens: int,
             timeout: float) -> list[float]:
    """Stream one greedy completion; the wall-clock time of each token as it arrived."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    times = []
    try:
        conn.request("POST", url.path.rstrip("/") + "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(300).decode(errors='replace')}")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            if carries_token(json.loads(data)):
                times.append(time.perf_counter())
    finally:
        conn.close()
    return times


def carries_token(chunk: dict) -> bool:
    """A token's chunk: text, or an empty piece of an unfinished multi-byte character; not the
    last chunk that only gives the finish reason, nor the usage chunk (no choices)."""
    choices = chunk.get("choices") or []
    return bool(choices) and (choices[0].get("text") != "" or choices[0].get("finish_reason")
                              is None)


COUNTERS = {"rotations": ("superinfer_rotations",),
            "bytes_moved": tuple(f"superinfer_kv_{name}_bytes" for name in
                                 ("written_back", "rotated_out", "rotated_in")),
            "recomputes": ("superinfer_recomputes", "vllm:num_preemptions"),
            "cached_tokens": ("vllm:prefix_cache_hits",),
            "prompt_tokens": ("vllm:prefix_cache_queries",)}


def server_counters(base_url: str) -> dict[str, float]:
    """The server's counters that bench rows report, from its /metrics (empty if it has none)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (OSError, ValueError):
        return {}
    found = {}
    for family in text_string_to_metric_families(text):
        for key, names in COUNTERS.items():
            if family.name in names:
                found[key] = found.get(key, 0) + sum(s.value for s in family.samples
                                                     if s.name.endswith("_total"))
    return found


def serve(base_url: str, model: str | None, items: list[Item], prompts: list[list[int]],
          label: str, deadline: float) -> tuple[list, dict]:
    """The arrivals against the server, online; records as bench.serve returns them."""
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
    before = server_counters(base_url)
    run = next(RUNS)
    prompts = [marked(p, run) for p in prompts]
    t0 = time.perf_counter() + 0.05
    records: list = [None] * len(items)
    errors: list[str] = []
    bar = progress(len(items), label)

    def one(i):
        arrival = t0 + items[i].arrival
        try:
            left = max(1.0, t0 + deadline - time.perf_counter())
            records[i] = (arrival, complete(base_url, model, prompts[i], items[i].output_len, left))
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as e:
            records[i] = (arrival, [])
            errors.append(str(e))
        bar.update(1)

    threads = []
    for i in order:
        time.sleep(max(0.0, t0 + items[i].arrival - time.perf_counter()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(max(0.0, t0 + deadline - time.perf_counter()) + 5)
    bar.close()
    if errors:
        print(f"  {len(errors)} requests failed, e.g. {errors[0]}")
    records = [r if r is not None else (t0 + items[i].arrival, []) for i, r in enumerate(records)]
    unfinished = sum(len(t) < items[i].output_len for i, (_, t) in enumerate(records))
    after = server_counters(base_url)
    moved = {k: int(after[k] - before.get(k, 0)) for k in after}
    return records, moved | {"unfinished": unfinished}
