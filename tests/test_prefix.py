"""Automatic prefix caching on both tiers: whatever is cached where, whatever rotates, and
whenever requests arrive or are aborted, greedy tokens never change, and the pools' reference
counts and hash index stay consistent after every step."""
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import virtual_clock
from deferred import DeferredStreams
from superinfer import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SYSTEM = "You are a careful assistant. Answer plainly, in one short paragraph, and stay on topic."
QUESTIONS = ["What is a comet?", "Why is the sky blue?", "How do bees find flowers?",
             "What makes bread rise?"]
FOLLOW_UPS = ["And how big can it get?", "Say it more simply.", "Give one example.",
              "Why does that matter?"]
POLICIES = ("fcfs", "fcfs-swap", "rotasched", "rotasched-released")


def make_engine(smollm, streams=None, **kw):
    model, tok = smollm
    cfg = dict(block_size=8, num_device_blocks=256, num_host_blocks=256, max_num_seqs=8,
               max_num_batched_tokens=64, ttft_slo=0.5, tbt_slo=0.1) | kw
    return Engine(EngineConfig(**cfg), model, tok, clock=virtual_clock(), streams=streams)


def finish(engine, rids, max_steps=5_000):
    """Step to the end, checking the pools after every step."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.bm.check()
    assert not engine.has_unfinished(), "did not finish"
    return [engine.output(r).token_ids for r in rids]


def no_leaks(engine):
    engine.runner.synchronize()
    engine.bm.copies_done()
    engine.bm.check()
    assert engine.bm.num_free == engine.bm.device.capacity, "device blocks held"
    assert engine.bm.host.num_free == engine.bm.host.capacity, "host blocks held"


@pytest.fixture(scope="module")
def conversations(smollm):
    """A shared system prompt, four first turns, and their second turns (each resends the first
    turn's prompt and answer, token for token, as a chat client does); the greedy answers to all
    eight with caching off and room for everything."""
    tok = smollm[1]

    def chat(*messages):
        return tok.apply_chat_template(list(messages), add_generation_prompt=True,
                                       return_dict=False)
    system = {"role": "system", "content": SYSTEM}
    first = [chat(system, {"role": "user", "content": q}) for q in QUESTIONS]
    e = make_engine(smollm, prefix_caching="off")
    answers = finish(e, [e.add_request(p, GREEDY) for p in first])
    turn_end = tok("<|im_end|>\n").input_ids
    second = [p + a + turn_end + chat({"role": "user", "content": f})[len(chat()):]
              for p, a, f in zip(first, answers, FOLLOW_UPS)]
    prompts = first + second
    e = make_engine(smollm, prefix_caching="off")
    return prompts, finish(e, [e.add_request(p, GREEDY) for p in prompts])


def test_second_turns_resend_the_first_token_for_token(conversations):
    prompts, answers = conversations
    for i in range(4):
        assert prompts[4 + i][:len(prompts[i]) + 16] == prompts[i] + answers[i]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(caching=st.sampled_from(["device", "both"]), policy=st.sampled_from(POLICIES),
       blocks=st.integers(28, 48), deferred=st.booleans(),
       gaps=st.lists(st.integers(0, 12), min_size=8, max_size=8), seed=st.integers(0, 99))
def test_cached_prefixes_never_change_the_tokens(smollm, conversations, caching, policy, blocks,
                                                 deferred, gaps, seed):
    """Requests arrive between steps (gaps), in a random order, over a device pool small enough
    that requests rotate or are preempted while others share their cached blocks; copies land
    as late as their waits allow when deferred."""
    prompts, answers = conversations
    streams = DeferredStreams(random.Random(seed)) if deferred else None
    e = make_engine(smollm, streams, policy=policy, num_device_blocks=blocks,
                    prefix_caching=caching, swap_watermark=4)
    order = random.Random(seed).sample(range(8), 8)
    rids = {}
    for i, gap in zip(order, gaps):
        rids[i] = e.add_request(prompts[i], GREEDY)
        for _ in range(gap):
            e.step()
            e.bm.check()
    got = finish(e, [rids[i] for i in range(8)])
    assert got == answers
    assert e.stats()["prefix_cache_hits"] > 0
    no_leaks(e)


def test_the_host_tier_serves_what_the_device_tier_evicted(smollm, conversations):
    """First turns, then other traffic that fills the device pool, then the second turns: with
    both tiers the history comes back from host memory; on the device alone it is recomputed."""
    prompts, answers = conversations
    other = [[2000 + 31 * i + j for j in range(60)] for i in range(6)]
    hits = {}
    for caching in ("off", "device", "both"):
        e = make_engine(smollm, num_device_blocks=48, prefix_caching=caching)
        first = finish(e, [e.add_request(p, GREEDY) for p in prompts[:4]])
        finish(e, [e.add_request(p, GREEDY) for p in other])
        second = finish(e, [e.add_request(p, GREEDY) for p in prompts[4:]])
        assert first + second == answers
        s = e.stats()
        hits[caching] = (s["prefix_cache_hits"], s["prefix_cache_host_hits"],
                         s["prefix_loaded_bytes"])
        no_leaks(e)
    assert hits["off"] == (0, 0, 0)
    assert hits["device"][1] == hits["device"][2] == 0
    assert hits["both"][1] > 0 and hits["both"][2] > 0
    assert hits["both"][0] > hits["device"][0]


def test_an_aborted_request_leaves_its_prefix_cached_and_intact(smollm, conversations):
    """Aborted mid-prefill and mid-decode, a request's full blocks stay cached: the same prompt
    sent again finds them and gets the same tokens."""
    prompts, answers = conversations
    e = make_engine(smollm)
    for steps in (1, 4):  # the 64-token budget: mid-prefill, then mid-decode
        rid = e.add_request(prompts[4], GREEDY)
        for _ in range(steps):
            e.step()
        e.abort(rid)
        e.bm.check()
        again = e.add_request(prompts[4], GREEDY)
        assert finish(e, [again]) == [answers[4]]
        assert e.output(again).num_cached_tokens > 0
    no_leaks(e)


def test_a_cached_second_turn_matches_hf(smollm, smollm_hf, conversations):
    prompts, _ = conversations
    e = make_engine(smollm)
    finish(e, [e.add_request(prompts[0], GREEDY)])
    rid = e.add_request(prompts[4], GREEDY)
    got = finish(e, [rid])[0]
    assert e.output(rid).num_cached_tokens >= len(prompts[0]) // 8 * 8
    with torch.no_grad():
        ref = smollm_hf.generate(torch.tensor([prompts[4]]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=0)[0, len(prompts[4]):]
    assert got == ref.tolist()
