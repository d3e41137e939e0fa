"""The OpenAI-compatible server, on 127.0.0.1, driven by the official openai client."""
import json
import socket
import threading
import time
import urllib.request

import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from serving.server import create_app
from superinfer import Engine, EngineConfig, LLM, SamplingParams

NAME = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(smollm):
    """A live server over a small device pool (so that rotation happens) on a free port."""
    model, tok = smollm
    engine = Engine(EngineConfig(policy="rotasched", block_size=8, num_device_blocks=40,
                                 num_host_blocks=512, max_num_seqs=8, max_num_batched_tokens=128,
                                 ttft_slo=0.5, tbt_slo=0.05), model, tok)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine, NAME), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield client, engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def reference(smollm):
    """Greedy outputs of LLM.generate (same engine code, in process) to compare with."""
    model, tok = smollm
    llm = LLM.from_engine(Engine(EngineConfig(num_device_blocks=256), model, tok))
    return llm


PROMPTS = ["The capital of France is", "Count from one to five:", "Bees are"]


def test_completions_equal_llm_generate(served, reference):
    client, _, _ = served
    want = reference.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0))
    for prompt, w in zip(PROMPTS, want):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == w.text and got.choices[0].finish_reason == w.finish_reason
        assert got.usage.completion_tokens == len(w.token_ids)
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == w.text
        assert chunks[-1].usage.completion_tokens == len(w.token_ids)


def test_chat_equals_llm_generate_with_the_template(served, reference):
    client, _, _ = served
    msg = "What is the capital of France?"
    want = reference.generate([reference.chat_prompt(msg)],
                              SamplingParams(max_tokens=20, temperature=0))[0]
    got = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": msg}],
                                         max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want.text and "Paris" in want.text
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": msg}],
                                            max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text


def test_sixteen_concurrent_streams_rotate_and_stay_correct(served, reference):
    client, engine, _ = served
    prompts = [f"Tell me a fact about the number {i}." for i in range(16)]
    want = [o.text for o in reference.generate(prompts, SamplingParams(max_tokens=24, temperature=0,
                                                                      ignore_eos=True))]
    got = [None] * 16
    rotations = engine.rotations

    def one(i):
        s = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=24, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        got[i] = "".join(c.choices[0].text for c in s if c.choices)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want
    assert engine.rotations > rotations, "a pool this small should have rotated requests"


def wait_idle(engine, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        if not engine.has_unfinished() and not engine.seqs:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not go idle")


def test_a_disconnected_stream_frees_its_blocks(served):
    client, engine, base = served
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": 200,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as resp:
        for _ in range(3):
            resp.readline()                    # a few events, then hang up
    wait_idle(engine)
    engine.runner.synchronize()
    engine.bm.copies_done()
    assert engine.bm.num_free == engine.bm.device.capacity
    assert engine.bm.host.num_free == engine.bm.host.capacity


@pytest.mark.parametrize("body,status,field", [
    ({"model": "other", "prompt": "hi"}, 404, "model"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
    ({"model": NAME, "prompt": [1] * 5000, "max_tokens": 4}, 400, "prompt"),
    ({"model": NAME, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "hi", "top_p": 7}, 400, "top_p"),
    ({"model": NAME, "prompt": "hi", "n": 2}, 400, "n"),
    ({"model": NAME, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": NAME}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors_while_a_stream_goes_on(served, body, status, field):
    client, _, base = served
    result = {}

    def good():
        s = client.completions.create(model=NAME, prompt="Hello there", max_tokens=16,
                                      temperature=0, stream=True)
        result["text"] = "".join(c.choices[0].text for c in s if c.choices)
    t = threading.Thread(target=good)
    t.start()
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == status and field in (err["param"] or "") + err["message"]
    t.join(60)
    assert result.get("text")


def test_malformed_json_is_a_clear_error(served):
    _, _, base = served
    req = urllib.request.Request(base + "/v1/completions", b"{not json",
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == 400 and "not valid JSON" in err["message"] and err["param"] is None


def test_models_health_and_metrics(served):
    client, _, base = served
    assert [m.id for m in client.models.list()] == [NAME]
    assert json.loads(urllib.request.urlopen(base + "/health").read()) == {"status": "ok"}
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    for want in ("superinfer_requests_running", "superinfer_requests_waiting",
                 "superinfer_requests_rotary", "superinfer_kv_usage", "superinfer_rotations",
                 "superinfer_kv_written_back_bytes", "superinfer_kv_rotated_out_bytes",
                 "superinfer_kv_rotated_in_bytes", "superinfer_time_to_first_token_seconds",
                 "superinfer_inter_token_seconds"):
        assert want in names, want


def test_cached_prompt_tokens_are_reported_like_openai(served):
    """A prompt sent twice: the second finds its full blocks cached (the last token is always
    computed, for its logits), in usage and in vLLM's /metrics counters."""
    client, engine, base = served
    prompt = " ".join(["a long shared system prompt"] * 9)  # several full 8-token blocks
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 8 * 8 > 0
    assert second.choices[0].text == first.choices[0].text
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["vllm:prefix_cache_hits_total"] >= (n - 1) // 8 * 8
    assert got["vllm:prefix_cache_queries_total"] >= 2 * n


def post(base, path, body, raw=False):
    """(status, parsed JSON) of a POST; body is an object, or bytes when raw."""
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_content_may_be_text_parts(served, reference):
    client, _, base = served
    msg = "What is the capital of France?"
    want = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": msg}])
    parts = [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": " of France?"}]
    got = client.chat.completions.create(model=NAME, max_tokens=12, temperature=0,
                                         messages=[{"role": "user", "content": parts}])
    assert got.choices[0].message.content == want.choices[0].message.content
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": image}])
    assert e.value.body["param"] == "messages.0.content.0.type"


@pytest.mark.parametrize("body,param", [
    ({"prompt": [[False]]}, "prompt.0.0"), ({"prompt": [True]}, "prompt.0"),
    ({"prompt": [1.5]}, "prompt.0"), ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"), ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias"), ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "echo": True}, "echo"), ({"prompt": "hi", "color": "blue"}, "color"),
    ({"prompt": [5, -1]}, "prompt.1"), ({"prompt": []}, "prompt"),
    ({"prompt": "hi", "stop": [""]}, "stop.0"), ({"prompt": "hi", "stop": ""}, "stop"),
    ({"prompt": ""}, "prompt"), ({"prompt": [[5, 49152]]}, "prompt"),
])
def test_completion_inputs_are_strict(served, body, param):
    _, _, base = served
    status, out = post(base, "/v1/completions", {"model": NAME, "max_tokens": 2} | body)
    assert status == 400 and out["error"]["param"] == param, out


def test_integers_are_json_schema_integers(served):
    """JSON has one number type and the schema says "integer": 5.0 is 5 (schemathesis found the
    server refusing a schema-valid [[1359.0, 633.0]]), while 5.5, "5" and true stay 400s."""
    _, _, base = served
    ask = lambda **kw: post(base, "/v1/completions", {"model": NAME, "temperature": 0} | kw)
    want = ask(prompt=[[1359, 633, 9060]], max_tokens=3)
    got = ask(prompt=[[1359.0, 633.0, 9060.0]], max_tokens=3.0)
    assert want[0] == got[0] == 200
    assert got[1]["choices"][0]["text"] == want[1]["choices"][0]["text"]
    for bad in (3.5, "3", True):
        status, out = ask(prompt="hi", max_tokens=bad)
        assert status == 400 and out["error"]["param"] == "max_tokens", out
    # any integer seed, modulo 2**64 (a bound near 2**64 is not exact in the float-typed schema)
    texts = [ask(prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=s)
             for s in (7, 7 + 2**64, 7 - 2**64, 7.0)]
    assert all(t[0] == 200 for t in texts), texts
    assert len({t[1]["choices"][0]["text"] for t in texts}) == 1


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"), ({"messages": [{"role": "bogus", "content": "x"}]},
                                     "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_chat_inputs_are_strict(served, body, param):
    _, _, base = served
    status, out = post(base, "/v1/chat/completions", {"model": NAME} | body)
    assert status == 400 and out["error"]["param"] == param, out


def test_no_op_values_of_unsupported_parameters_are_accepted(served):
    _, _, base = served
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
            "n": 1, "user": "me", "response_format": {"type": "text"}, "tools": []}
    status, out = post(base, "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length")


def test_every_error_is_an_openai_error_object(served):
    _, _, base = served
    checks = [post(base, "/v1/nowhere", {}), post(base, "/v1/completions", b"\xff\xfe", raw=True),
              post(base, "/v1/completions", b"[" * 100000 + b"]" * 100000, raw=True),
              post(base, "/v1/completions", b'{"prompt": "x", ' + b" " * (1 << 20) + b"}", raw=True)]
    assert [c[0] for c in checks] == [404, 400, 400, 413]
    for _, out in checks:
        assert set(out) == {"error"} and set(out["error"]) == {"message", "type", "param", "code"}
    req = urllib.request.Request(base + "/v1/completions", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    assert e.value.code == 405 and "error" in json.loads(e.value.read())


def test_context_errors_name_the_numbers(served):
    _, engine, base = served
    n = engine.max_model_len
    status, out = post(base, "/v1/completions", {"prompt": [7] * (n - 4), "max_tokens": 10})
    assert status == 400 and out["error"]["param"] == "max_tokens"
    assert f"{n - 4} tokens" in out["error"]["message"] and f"context is {n} tokens" in \
        out["error"]["message"]
    long_chat = {"messages": [{"role": "user", "content": "word " * (n + 50)}]}
    status, out = post(base, "/v1/chat/completions", long_chat)
    assert status == 400 and out["error"]["param"] == "messages"
    assert out["error"]["code"] == "context_length_exceeded" and f"{n} tokens" in \
        out["error"]["message"]


def test_a_hung_up_plain_request_stops_and_gauges_follow(served):
    """A non-streaming request whose client hangs up frees its slot and blocks within a step,
    and the running gauge says so."""
    _, engine, base = served
    body = json.dumps({"model": NAME, "prompt": "Once upon a time", "max_tokens": 400,
                       "temperature": 0, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    end = time.time() + 30
    while not engine.sched.running and time.time() < end:
        time.sleep(0.01)
    steps = engine.sched.num_steps
    sock.close()
    wait_idle(engine)
    assert engine.sched.num_steps - steps < 40      # not the 400 tokens it asked for
    time.sleep(0.2)
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    running = [s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "superinfer_requests_running"]
    assert running == [0.0]


def test_the_openapi_document_lists_what_the_server_sends(served):
    _, _, base = served
    doc = json.loads(urllib.request.urlopen(base + "/openapi.json").read())
    post_ = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "503"} <= set(post_) and "422" not in post_
    event = post_["200"]["content"]["text/event-stream"]["schema"]  # OpenAPI 3.1: one event
    assert event["type"] == "object" and event["properties"]["data"]["type"] == "string"
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    chat = doc["components"]["schemas"]["ChatBody"]["properties"]["messages"]
    assert chat["minItems"] == 1
    body = doc["components"]["schemas"]["CompletionBody"]["properties"]
    assert body["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}
    assert body["best_of"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 1}
    keys = lambda x: (set(x) | set().union(*map(keys, x.values())) if isinstance(x, dict) else
                      set().union(*map(keys, x)) if isinstance(x, list) else set())
    assert not {"ge", "le", "gt", "lt"} & keys(doc["components"])  # JSON Schema's words only


def test_the_bench_client_counts_tokens_and_reads_the_servers_counters(served):
    from serving import client as bench_client
    from workload.trace import Item
    assert not bench_client.carries_token({"choices": [{"text": "", "finish_reason": "length"}]})
    assert bench_client.carries_token({"choices": [{"text": "", "finish_reason": None}]})
    assert not bench_client.carries_token({"choices": [], "usage": {}})
    _, engine, base = served
    items = [Item(0.05 * i, 20, 6 + i) for i in range(6)]
    prompts = [[1000 + 7 * i + j for j in range(20)] for i in range(6)]
    records, stats = bench_client.serve(base, NAME, items, prompts, "test", 60.0)
    assert [len(times) for _, times in records] == [it.output_len for it in items]
    assert {"rotations", "bytes_moved", "recomputes"} <= set(stats)
    assert stats["rotations"] >= 0 and stats["unfinished"] == 0


def test_the_bench_client_never_replays_a_prompt_a_prefix_cache_could_reuse(monkeypatch):
    """Runs against one server (calibration, each rate, each repeat) send the same arrivals: each
    run marks its prompts with a first token of its own, so no run starts a prompt as an earlier
    one did, while every prompt keeps its length and its other tokens, and the prompts of one run
    that share a prefix (a conversation's turns) still share it."""
    from serving import client as bench_client
    from workload.trace import Item
    sent = []
    monkeypatch.setattr(bench_client, "complete",
                        lambda url, model, prompt, n, timeout: sent.append(prompt) or [0.0] * n)
    monkeypatch.setattr(bench_client, "server_counters", lambda url: {})
    items = [Item(0.0, 40, 2), Item(0.0, 40, 2), Item(1.0, 45, 2)]
    prompts = [[1000 + 50 * i + j for j in range(40)] for i in range(2)]
    prompts.append(prompts[1] + [7, 8, 9, 10, 11])  # the next turn of the second conversation
    for _ in range(4):
        records, _ = bench_client.serve("http://127.0.0.1:9", None, items, prompts, "t", 5.0)
        assert [len(t) for _, t in records] == [2, 2, 2]
    assert len(sent) == 12
    runs = [sent[k:k + 3] for k in range(0, 12, 3)]  # arrival order: prompts 0 and 1, then 2
    for run in runs:
        assert sorted(p[1:] for p in run) == sorted(q[1:] for q in prompts)
        *first_turns, next_turn = sorted(run, key=len)
        assert next_turn[:40] in first_turns  # it still starts as its conversation did
    starts = [{tuple(p[:16]) for p in run} for run in runs]
    assert all(not starts[a] & starts[b] for a in range(4) for b in range(a))


def test_an_empty_prompt_is_refused_as_everywhere_and_the_schema_says_so(served):
    """"" is no prompt, in a completion or as a chat message (the CLI and LLM.generate refuse it
    too); whitespace is text. The document bounds token ids by the model's vocabulary."""
    _, _, base = served
    for content in ("", [{"type": "text", "text": ""}]):
        status, out = post(base, "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": content}]})
        assert status == 400 and out["error"]["param"].startswith("messages.0.content"), out
    status, _ = post(base, "/v1/completions", {"prompt": " ", "max_tokens": 1})
    assert status == 200
    doc = json.loads(urllib.request.urlopen(base + "/openapi.json").read())
    prompt = json.dumps(doc["components"]["schemas"]["CompletionBody"]["properties"]["prompt"])
    assert prompt.count('"maximum": 49151') == 2 and '"minLength": 1' in prompt

