"""The engine end to end on the embedded SmolLM2: rotation is invisible, HF agreement, the API,
and nothing a user sends can wedge it."""
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import virtual_clock
from deferred import DeferredStreams
from superinfer import ConfigError, Engine, EngineConfig, EngineError, LLM, SamplingParams, sample

GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(smollm, streams=None, **kw):
    """An engine on the embedded model with a virtual clock; its pools are small unless a test
    sizes them (the engine's default 256 MiB + 512 MiB per engine adds up over a test run)."""
    model, tok = smollm
    kw.setdefault("num_device_blocks", 128)
    kw.setdefault("num_host_blocks", 256)
    return Engine(EngineConfig(**kw), model, tok, clock=virtual_clock(), streams=streams)


def run(engine, prompts, params, max_steps=10_000):
    rids = [engine.add_request(p, params) for p in prompts]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "did not finish"
    return [engine.output(r) for r in rids]


def assert_no_leaks(engine):
    engine.runner.synchronize()
    engine.bm.copies_done()
    assert engine.bm.num_free == engine.bm.device.capacity, "device blocks leaked"
    assert engine.bm.host.num_free == engine.bm.host.capacity, "host blocks leaked"


TOPICS = ["the moon", "a cat", "rain", "bread", "trains", "music", "chess", "the ocean",
          "winter", "coffee", "bees", "mountains", "a library", "rivers", "stars", "clocks"]


def mixed_prompts(tok, n=16):
    """Chat prompts of quite different lengths."""
    out = []
    for i, topic in enumerate(TOPICS[:n]):
        msg = f"Tell me about {topic}." + " Please be detailed and careful." * (i % 5) * 3
        out.append(tok.apply_chat_template([{"role": "user", "content": msg}],
                                           add_generation_prompt=True, return_dict=False))
    return out


@pytest.fixture(scope="module")
def reference_tokens(smollm):
    """Greedy tokens of the mixed prompts with an ample pool and no pressure: the baseline."""
    e = make_engine(smollm, policy="fcfs", block_size=8, num_device_blocks=512,
                    num_host_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    return [o.token_ids for o in run(e, mixed_prompts(smollm[1]), SamplingParams(max_tokens=24, **GREEDY))]


@pytest.mark.parametrize("policy,deferred,overlap", [
    ("fcfs", False, None), ("fcfs-swap", False, None), ("rotasched", False, None),
    ("rotasched-released", False, None), ("rotasched-lvf:alpha=1", False, None),
    ("rotasched", True, False), ("rotasched", True, True), ("fcfs-swap", True, None)])
def test_rotation_is_invisible(smollm, reference_tokens, policy, deferred, overlap):
    """Greedy fp32 tokens are the same for every policy with a pool so small that requests are
    rotated or preempted; with deferred streams, copies land as late as their waits allow, and
    swapped-in requests run in the step they come back or (overlap) the next."""
    streams = DeferredStreams(random.Random(1)) if deferred else None
    e = make_engine(smollm, streams, policy=policy, block_size=8, num_device_blocks=24,
                    num_host_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                    ttft_slo=0.5, tbt_slo=0.1, swap_watermark=8, swap_in_overlap=overlap)
    outs = run(e, mixed_prompts(smollm[1]), SamplingParams(max_tokens=24, **GREEDY))
    stats = e.stats()
    assert stats["rotations"] + stats["recomputes"] > 0, stats
    if policy != "fcfs":
        assert stats["rotations"] > 0, stats
    assert [o.token_ids for o in outs] == reference_tokens
    assert_no_leaks(e)


def test_engine_matches_hf_generate(smollm, smollm_hf):
    prompts = mixed_prompts(smollm[1])[:3]
    outs = run(make_engine(smollm), prompts, SamplingParams(max_tokens=20, **GREEDY))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = smollm_hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False,
                                     pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist()


def test_seed_reproduces_and_top_k_1_is_greedy(smollm):
    prompts = mixed_prompts(smollm[1])[:3]
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    a = [o.token_ids for o in run(make_engine(smollm), prompts, seeded)]
    b = [o.token_ids for o in run(make_engine(smollm, max_num_seqs=1, max_num_batched_tokens=16),
                                  prompts, seeded)]
    assert a == b  # same seed, different batching: same tokens
    greedy = [o.token_ids for o in run(make_engine(smollm), prompts,
                                       SamplingParams(max_tokens=12, **GREEDY))]
    topk1 = [o.token_ids for o in run(make_engine(smollm), prompts,
                                      SamplingParams(max_tokens=12, temperature=1.3, top_k=1,
                                                     ignore_eos=True))]
    assert topk1 == greedy
    other = [o.token_ids for o in run(make_engine(smollm), prompts,
                                      SamplingParams(max_tokens=12, temperature=0.9, seed=8,
                                                     ignore_eos=True))]
    assert other != a


def test_sample_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(top_p=0.7)], [g])[0] for _ in range(200)}
    assert seen == {0, 1}


PARAMS = st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                   top_k=st.sampled_from([-1, 0, 1, 3, 8, 50]),
                   top_p=st.sampled_from([1.0, 0.9, 0.5, 0.1]))


@settings(max_examples=60, deadline=None)
@given(st.lists(PARAMS, min_size=1, max_size=6), st.integers(0, 2**31),
       st.sampled_from([1, 3, 8, 40]))
def test_a_row_draws_the_same_token_alone_or_in_any_batch(params, seed, width):
    """A row's token depends on its logits, its parameters and its own generator only: not on
    which other rows (greedy, filtering or not) share the batch, nor on whether the batch's
    filtering found the kept tokens among the `width` likeliest or had to sort."""
    logits = torch.randn(len(params), 40, generator=torch.Generator().manual_seed(seed)) * 2
    gens = lambda: [torch.Generator().manual_seed(seed + i) for i in range(len(params))]
    together = sample(logits, params, gens(), width)
    alone = [sample(logits[i:i + 1], [p], [g], width)[0]
             for i, (p, g) in enumerate(zip(params, gens()))]
    assert together == alone


@pytest.mark.parametrize("width", [2, 4096])
@pytest.mark.parametrize("kw", [{}, {"top_k": 3}, {"top_p": 0.8}, {"top_k": 4, "top_p": 0.78},
                                {"top_k": 9}])
def test_sample_draws_by_probability(kw, width):
    """Frequencies over 6,000 draws within 5 sigma of softmax(logits / T), restricted to the
    kept tokens and renormalised, whether a filtering row's threshold came from the `width`
    likeliest tokens (4,096) or from a sort of them all (2 is too few for most of these)."""
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.2, 0.0, 1.9]])
    probs = (logits[0].double() / 0.8).softmax(-1)
    order = probs.argsort(descending=True)
    keep = min(kw.get("top_k", 6), 6)  # the top k, renormalised; then the nucleus within them:
    top = probs[order[:keep]] / probs[order[:keep]].sum()  # until the mass before exceeds top_p
    keep = int(((top.cumsum(0) - top) <= kw.get("top_p", 1.0)).sum())
    want = torch.zeros_like(probs)
    want[order[:keep]] = probs[order[:keep]] / probs[order[:keep]].sum()
    g, n = torch.Generator().manual_seed(3), 6000
    draws = [sample(logits, [SamplingParams(temperature=0.8, **kw)], [g], width)[0]
             for _ in range(n)]
    freq = torch.bincount(torch.tensor(draws), minlength=6).double() / n
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-9).all(), (freq, want)


def test_top_k_keeps_the_tokens_tied_with_the_last_one_kept():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, [SamplingParams(top_k=1)], [g])[0] for _ in range(100)} == {1, 2}


def test_sample_tiny_temperature_is_greedy_and_nan_rows_fail_alone():
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 0.0], [0.0, -math.inf, 1.0],
                           [math.inf, 0.0, 1.0], [0.0, 3.0, 3.0]])
    params = [SamplingParams(temperature=1e-38), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=0)]
    gens = [torch.Generator().manual_seed(0) for _ in params]
    assert sample(logits, params, gens) == [1, None, None, None, 1]  # ties: the first maximum



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampling_draws_the_same_tokens_as_on_cpu():
    """Logits on the GPU are filtered there; seeded draws give the CPU's tokens."""
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    logits[5, 3] = float("nan")
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in
              [(0, 0, 1.0), (0.8, 0, 1.0), (1.0, 40, 1.0), (1.2, 0, 0.9), (0.5, 10, 0.5),
               (1.0, 0, 1.0)]]
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(params))]
    assert sample(logits.cuda(), params, gens()) == sample(logits, params, gens())

def test_abort_mid_decode_frees_both_tiers(smollm):
    e = make_engine(smollm, policy="rotasched", block_size=8, num_device_blocks=24,
                    num_host_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, ttft_slo=0.5)
    rids = [e.add_request(p, SamplingParams(max_tokens=40, **GREEDY))
            for p in mixed_prompts(smollm[1])[:6]]
    for _ in range(500):
        if e.stats()["rotations"]:
            break
        e.step()
    assert e.stats()["rotations"] > 0
    for r in rids:
        e.abort(r)
    assert not e.has_unfinished()
    assert all(e.output(r).finish_reason == "abort" for r in rids)
    assert_no_leaks(e)


def test_streaming_events_text_and_eos(smollm):
    _, tok = smollm
    e = make_engine(smollm)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_dict=False)
    rid = e.add_request(prompt, SamplingParams(max_tokens=64, temperature=0))
    events = []
    while e.has_unfinished():
        events += e.step()
    out = e.output(rid)
    assert [ev.token_id for ev in events] == out.token_ids
    assert "".join(ev.text for ev in events) == out.text
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert events[-1].finished and out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert len(out.metrics.token_times) == len(out.token_ids) and "Paris" in out.text


def test_stop_strings_end_the_text_before_them(smollm):
    _, tok = smollm
    e = make_engine(smollm)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_dict=False)
    out = run(e, [prompt], SamplingParams(max_tokens=64, temperature=0, stop=["Paris"]))[0]
    assert out.finish_reason == "stop" and "Paris" not in out.text and out.text


@pytest.mark.parametrize("kw,match", [({"max_tokens": 0}, "max_tokens"),
                                      ({"temperature": -1}, "temperature"),
                                      ({"temperature": math.inf}, "temperature"),
                                      ({"top_p": 0}, "top_p"), ({"top_p": math.nan}, "top_p"),
                                      ({"top_k": -3}, "top_k"), ({"seed": 2**64}, "seed"),
                                      ({"seed": -2**70}, "seed"), ({"seed": True}, "seed"),
                                      ({"stop_token_ids": None}, "stop_token_ids"),
                                      ({"stop": [""]}, "stop"), ({"max_tokens": 2.5}, "max_tokens")])
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


# ---------------------------------------------------------------- nothing wedges the engine

class Boom(Exception):
    pass


def failing_forward(model, fail_on_call, exc):
    """Make the model's forward raise `exc` on its fail_on_call-th call."""
    real, calls = model.forward, [0]

    def forward(*args):
        calls[0] += 1
        if calls[0] == fail_on_call:
            raise exc
        return real(*args)
    return forward


@pytest.mark.parametrize("exc", [Boom("injected"), KeyboardInterrupt()])
def test_a_failed_step_aborts_its_requests_and_the_engine_serves_on(smollm, exc, monkeypatch):
    model, tok = smollm
    prompts = mixed_prompts(tok)[:4]
    params = SamplingParams(max_tokens=8, **GREEDY)
    clean = [o.token_ids for o in run(make_engine(smollm), prompts, params)]
    e = make_engine(smollm, max_num_seqs=2)
    rids = [e.add_request(p, params) for p in prompts]
    monkeypatch.setattr(model, "forward", failing_forward(model, 3, exc))
    with pytest.raises(type(exc) if isinstance(exc, KeyboardInterrupt) else EngineError):
        for _ in range(100):
            e.step()
    monkeypatch.undo()
    while e.has_unfinished():
        e.step()
    outs = [e.output(r) for r in rids]
    failed = [o for o in outs if o.finish_reason == "error"]
    assert len(failed) == 2 and all(o.error for o in failed)   # the step's two requests
    for o, want in zip(outs, clean):
        if o.finish_reason != "error":
            assert o.token_ids == want                         # the rest are untouched
    assert [o.token_ids for o in run(e, prompts[:1], params)] == clean[:1]
    assert_no_leaks(e)


def test_rejected_requests_leave_nothing_queued(smollm):
    e = make_engine(smollm)
    bad = [("hi", SamplingParams(max_tokens=4, temperature=0)), ("", SamplingParams()),
           (b"bytes", SamplingParams()), (None, SamplingParams()), ([1, -1], SamplingParams()),
           ("\ud800", SamplingParams()), ([1] * 10, SamplingParams(max_tokens=10**6))]
    ok = e.add_request(*bad[0])
    for prompt, params in bad[1:]:
        with pytest.raises(ValueError):
            e.add_request(prompt, params)
    params = SamplingParams(max_tokens=4, temperature=0)
    params.seed = 2**64                          # mutated after construction: checked again
    with pytest.raises(ValueError, match="seed"):
        e.add_request("hi", params)
    with pytest.raises(ValueError, match="priority"):
        e.add_request("hi", priority=True)
    assert list(e.seqs) == [ok] and len(e.sched.waiting) == 1
    while e.has_unfinished():
        e.step()
    assert len(e.output(ok).token_ids) == 4


@pytest.fixture(scope="module")
def llm(smollm):
    return LLM.from_engine(make_engine(smollm, num_device_blocks=64, num_host_blocks=128))


def test_llm_generate_bad_prompts_alone(llm):
    prompts = ["Hello", "", list(range(5000)), [1, 2, 3], [10**9], None, 5, "\ud800", b"abc"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert [o.error is None for o in outs] == [True, False, False, True] + [False] * 5
    assert "empty prompt" in str(outs[1].error)
    assert "more than the whole device pool" in str(outs[2].error)
    assert "token ids" in str(outs[4].error) and "bytes" in str(outs[8].error)
    assert len(outs[0].token_ids) == 4 and outs[0].text and len(outs[3].token_ids) == 4
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time
    assert not llm.engine.has_unfinished() and not llm.engine.seqs


def test_llm_generate_api_shape(llm):
    outs = llm.generate(["What is 2+2?", "Name a color."],
                        [SamplingParams(max_tokens=3, **GREEDY), SamplingParams(max_tokens=5, **GREEDY)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[0].prompt == "What is 2+2?"
    assert outs[0].prompt_token_ids == llm.tokenizer("What is 2+2?").input_ids
    assert outs[0].finish_reason == "length" and outs[0].request_id != outs[1].request_id
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None)


def test_context_length_error(llm):
    out = llm.generate([[1] * 10], SamplingParams(max_tokens=9000))[0]
    assert "context" in str(out.error)


POISON = st.one_of(
    st.sampled_from(["", None, 7, b"x", "\ud800", [-1], [10**9], [True], [1] * 5000]).map(
        lambda p: (p, None)),
    st.tuples(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed",
                               "stop_token_ids", "stop", "ignore_eos"]),
              st.sampled_from([None, -1, math.nan, math.inf, 2**64, True, "x", [None], 0])).map(
        lambda kv: ("Hello", kv)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(poison=st.lists(POISON, min_size=1, max_size=4), where=st.randoms(use_true_random=False))
def test_poison_never_touches_good_requests(llm, poison, where):
    """Invalid prompts and SamplingParams thrown into a batch of valid ones: the valid ones
    finish with the tokens of a clean run, the others carry errors, nothing leaks."""
    good = ["Hello", "Name a color.", [5, 6, 7, 8]]
    params = SamplingParams(max_tokens=5, **GREEDY)
    clean = [o.token_ids for o in llm.generate(good, params)]
    batch = [(p, params) for p in good]
    for prompt, field_value in poison:
        p = SamplingParams(max_tokens=5, **GREEDY)
        if field_value is not None:
            setattr(p, *field_value)
        batch.insert(where.randint(0, len(batch)), (prompt, p))
    outs = llm.generate([b[0] for b in batch], [b[1] for b in batch])
    got = [o.token_ids for (prompt, p), o in zip(batch, outs) if o.error is None]
    valid = [o for (prompt, p), o in zip(batch, outs) if p is params]
    assert [o.token_ids for o in valid] == clean and all(o.error is None for o in valid)
    assert len(got) >= len(clean)
    assert not llm.engine.has_unfinished()
    assert_no_leaks(llm.engine)


@pytest.mark.parametrize("kw,match", [({"dtype": "int32"}, "dtype"), ({"dtype": 123}, "dtype"),
                                      ({"dtype": torch.int32}, "dtype"), ({"policy": "lifo"}, "lifo"),
                                      ({"max_num_seqs": True}, "max_num_seqs"),
                                      ({"ttft_slo": math.nan}, "ttft_slo"),
                                      ({"block_size": 0}, "block_size"), ({"nope": 1}, "nope")])
def test_bad_engine_settings_are_named_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(**kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rotation_is_invisible():
    """On a GPU: pinned host pool, two copy streams, events; greedy tokens as with an ample pool."""
    from conftest import tiny_pair
    model, _ = tiny_pair(seed=5, vocab=301, hidden=64, heads=4, kv_heads=2)
    model = model.to("cuda")
    prompts = [[(7 * i + j) % 301 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    outs = {}
    for policy, blocks in [("fcfs", 256), ("rotasched", 24), ("fcfs-swap", 24)]:
        e = Engine(EngineConfig(policy=policy, block_size=4, num_device_blocks=blocks,
                                num_host_blocks=256, max_num_seqs=6, max_num_batched_tokens=32,
                                ttft_slo=0.3, tbt_slo=0.02), model, None, clock=virtual_clock())
        assert e.runner.pools.host.is_pinned()
        outs[policy] = [o.token_ids for o in run(e, prompts, params)]
        if blocks == 24:
            assert e.stats()["rotations"] > 0
    assert outs["rotasched"] == outs["fcfs"] and outs["fcfs-swap"] == outs["fcfs"]


def test_an_engine_runs_schedule_log_replays_exactly(smollm, tmp_path):
    """The engine's log (real model, rotations, an abort, EOS and stop-string finishes) is
    re-decided step for step by the scheduler alone on the logged clock."""
    from tools import schedlog
    path = tmp_path / "engine.jsonl"
    e = make_engine(smollm, policy="rotasched", block_size=8, num_device_blocks=24,
                    num_host_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, ttft_slo=0.5,
                    tbt_slo=0.1, log_path=str(path))
    prompts = mixed_prompts(smollm[1])[:8]
    rids = [e.add_request(p, SamplingParams(max_tokens=20, temperature=0, stop=["."] if i % 3 else []))
            for i, p in enumerate(prompts)]
    for _ in range(6):
        e.step()
    e.abort(rids[1])
    while e.has_unfinished():
        e.step()
    e.close()
    assert e.stats()["rotations"] > 0
    steps, why = schedlog.replay(str(path))
    assert why is None and steps == e.sched.num_steps


def test_copies_between_the_tiers_are_counted_by_purpose(smollm):
    """Write-backs and rotations are counted apart: with room for everything, DuplexKV writes
    full blocks back and nothing rotates; with a pool too small, rotations copy out and back in.
    Every copied block is counted once (their sum is the copier's)."""
    prompts = [[1000 + 17 * i + j for j in range(40)] for i in range(6)]
    params = SamplingParams(max_tokens=24, **GREEDY)
    roomy = make_engine(smollm, policy="rotasched", block_size=8)
    run(roomy, prompts, params)
    stats = roomy.stats()
    assert stats["written_back_bytes"] > 0 and stats["rotations"] == 0
    assert stats["rotated_out_bytes"] == stats["rotated_in_bytes"] == 0
    tight = make_engine(smollm, policy="fcfs-swap", block_size=8, num_device_blocks=20,
                        max_num_seqs=6)
    run(tight, prompts, params)
    stats = tight.stats()
    assert stats["rotations"] > 0 and stats["rotated_out_bytes"] > 0
    assert stats["rotated_in_bytes"] > 0 and stats["written_back_bytes"] == 0
    for s in (roomy.stats(), stats):
        assert s["bytes_moved"] == sum(s[f"{k}_bytes"] for k in
                                       ("written_back", "rotated_out", "rotated_in"))
