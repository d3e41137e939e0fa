"""A streaming client of any OpenAI-compatible server, for bench.py --policies openai.

Each request is sent at its arrival time on its own thread (POST /v1/completions, stream: true,
prompt as token ids); every streamed chunk is one token, timed on arrival here. So TTFT and every
token gap are measured on the client side, the same way for our server, vLLM or SGLang.
"""
from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse

from workload.metrics import progress
from workload.trace import Item


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
            if json.loads(data).get("choices"):
                times.append(time.perf_counter())
    finally:
        conn.close()
    return times


def serve(base_url: str, model: str | None, items: list[Item], prompts: list[list[int]],
          label: str, deadline: float) -> tuple[list, dict]:
    """The arrivals against the server, online; records as bench.serve returns them."""
    order = sorted(range(len(items)), key=lambda i: items[i].arrival)
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
    return records, {"unfinished": unfinished}
