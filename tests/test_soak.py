"""The server under sustained mixed load, and `python superinfer.py serve` as a user runs it."""
import asyncio
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from model import ModelConfig
from serving.server import create_app
from superinfer import Engine, EngineConfig
from test_server import free_port, wait_idle
from weights.loader import random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RSS_BOUND_MB = 60   # growth after warm-up over the soak


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def one(port: int, kind: str, rng: random.Random) -> str:
    """One request of a kind; returns how it ended."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 0.8])}
    path = "/v1/completions"
    if kind in ("chat", "chat-stream", "hangup-plain"):
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "tell me something " * rng.randint(1, 20)}]
    else:
        body["prompt"] = [rng.randrange(1000, 40000) for _ in range(rng.randint(1, 200))]
    body["stream"] = kind in ("stream", "chat-stream", "hangup-stream")
    if kind.startswith("hangup"):
        body["max_tokens"], body["ignore_eos"] = 500, True
    if kind == "bad":
        body = rng.choice([{"prompt": [True]}, {"prompt": "x", "temperature": "hot"},
                           {"messages": []}, {"prompt": "x", "n": 3}, {"prompt": [10**9]}])
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        if kind == "hangup-plain":  # no answer comes before it is done: hang up before that
            time.sleep(rng.random() * 0.05)
            return "hung up"
        resp = conn.getresponse()
        if kind == "hangup-stream":
            resp.readline()
            return "hung up"
        data = resp.read()
        return f"{resp.status}" if resp.status != 200 or body["stream"] else \
            json.loads(data)["choices"][0]["finish_reason"]
    finally:
        conn.close()


@pytest.fixture(scope="module")
def tiny_server(smollm):
    """A tiny random model with SmolLM2's tokenizer (its vocabulary), so steps are quick."""
    _, tok = smollm
    cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, max_position_embeddings=2048, eos_token_ids=[2])
    engine = Engine(EngineConfig(block_size=8, num_device_blocks=160, num_host_blocks=2048,
                                 max_num_seqs=16, max_num_batched_tokens=512, seed=0),
                    random_model(cfg, "cpu", torch.float32), tok)
    port = free_port()
    app = create_app(engine, "tiny")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield port, engine, app
    server.should_exit = True
    thread.join(10)


def test_soak_mixed_requests_leave_nothing_behind(tiny_server):
    port, engine, app = tiny_server
    kinds = ["stream"] * 4 + ["plain", "chat", "chat-stream"] * 2 + ["bad"] * 2 + \
        ["hangup-stream", "hangup-plain"]
    rng = random.Random(0)
    jobs = [rng.choice(kinds) for _ in range(2400)]
    loop = app.state.client.loop

    async def count():
        return len(asyncio.all_tasks())
    tasks = lambda: asyncio.run_coroutine_threadsafe(count(), loop).result()
    run = lambda i: one(port, jobs[i], random.Random(i))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(300)))
        wait_idle(engine)
        base_rss, base_tasks = rss_mb(), tasks()
        results += list(pool.map(run, range(300, len(jobs))))
    wait_idle(engine)
    time.sleep(0.5)
    grown = rss_mb() - base_rss
    assert grown < RSS_BOUND_MB, f"RSS grew {grown:.0f} MB over the soak"
    assert all(r in ("stop", "length", "hung up", "200", "400") for r in results), set(results)
    assert results.count("400") == jobs.count("bad")
    engine.runner.synchronize()
    engine.bm.copies_done()
    assert not engine.seqs and not engine.sched.requests and not app.state.client.queues
    assert engine.bm.num_free == engine.bm.device.capacity
    assert engine.bm.host.num_free == engine.bm.host.capacity
    assert tasks() <= base_tasks
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    gauges = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name.startswith("superinfer_requests_") and not s.labels}
    assert gauges["superinfer_requests_running"] == 0 == gauges["superinfer_requests_waiting"]


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except OSError:
            continue
    return out


def test_serve_runs_the_engine_in_its_own_process_and_stops_on_ctrl_c():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "superinfer.py", "serve", "--port", str(port),
                             "--num-device-blocks", "64", "--max-num-seqs", "4"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.time() + 120
        while time.time() < end:
            try:
                urllib.request.urlopen(base + "/health")
                break
            except OSError:
                time.sleep(0.3)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=12,
                                             temperature=0, messages=[
                                                 {"role": "user",
                                                  "content": "What is the capital of France?"}])
        assert "Paris" in got.choices[0].message.content
        stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Bees are",
                                           max_tokens=8, temperature=0, stream=True)
        assert len([c for c in stream if c.choices and c.choices[0].text]) >= 4
        assert children(proc.pid), "the engine runs in a child process"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-2000:]
    assert "Traceback" not in out
