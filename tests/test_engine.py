"""The engine end to end on the embedded SmolLM2: rotation is invisible, HF agreement, API, errors."""
import itertools

import pytest
import torch

from model import embedded_gguf_path, hf_reference, read_gguf
from superinfer import LLM, Engine, SamplingParams, sample


def virtual_clock(dt=0.05):
    ticks = itertools.count()
    return lambda: next(ticks) * dt


def make_engine(smollm, **kw):
    model, tok = smollm
    kw.setdefault("clock", virtual_clock())
    return Engine(model, tok, **kw)


def run(engine, prompts, params):
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.output(r) for r in rids]


TOPICS = ["the moon", "a cat", "rain", "bread", "trains", "music", "chess", "the ocean",
          "winter", "coffee", "bees", "mountains", "a library", "rivers", "stars", "clocks"]


def mixed_prompts(tok):
    """16 chat prompts of quite different lengths."""
    out = []
    for i, topic in enumerate(TOPICS):
        msg = f"Tell me about {topic}." + " Please be detailed and careful." * (i % 5) * 3
        out.append(tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                           return_dict=False))
    return out


def test_rotation_is_invisible(smollm):
    """Greedy fp32 tokens are identical for every policy, with a pool so small that requests are
    rotated and preempted, and with an unconstrained one."""
    _, tok = smollm
    prompts = mixed_prompts(tok)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = None
    for policy, blocks in [("fcfs", 512), ("fcfs", 24), ("fcfs-swap", 24), ("rotasched", 24),
                           ("rotasched-released", 24)]:
        e = make_engine(smollm, policy=policy, block_size=8, num_device_blocks=blocks, num_host_blocks=256,
                        max_num_seqs=8, max_num_batched_tokens=64, ttft_slo=0.5, tbt_slo=0.1)
        outs = run(e, prompts, params)
        tokens = [o.token_ids for o in outs]
        stats = e.stats()
        if blocks == 24:
            assert stats["rotations"] + stats["recomputes"] > 0, (policy, stats)
            if policy != "fcfs":
                assert stats["rotations"] > 0, (policy, stats)
        assert all(len(t) == 24 for t in tokens)
        if ref is None:
            ref = tokens
        else:
            assert tokens == ref, policy
        e.bm.copies_done()
        assert e.bm.device.num_free == blocks and e.bm.host.num_free == 256


def test_engine_matches_hf_generate(smollm):
    _, tok = smollm
    cfg, tensors = read_gguf(embedded_gguf_path())
    hf = hf_reference(cfg, tensors)
    hf.generation_config.eos_token_id = None
    prompts = mixed_prompts(tok)[:3]
    outs = run(make_engine(smollm, policy="rotasched"), prompts, SamplingParams(max_tokens=20, temperature=0,
                                                                                ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(p):]
        assert o.token_ids == ref.tolist()


def test_seed_reproduces_and_top_k_1_is_greedy(smollm):
    _, tok = smollm
    prompts = mixed_prompts(tok)[:3]
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    a = [o.token_ids for o in run(make_engine(smollm), prompts, seeded)]
    b = [o.token_ids for o in run(make_engine(smollm, max_num_seqs=1, max_num_batched_tokens=16), prompts, seeded)]
    assert a == b  # same seed, different batching: same tokens
    greedy = [o.token_ids for o in run(make_engine(smollm), prompts,
                                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    topk1 = [o.token_ids for o in run(make_engine(smollm), prompts,
                                      SamplingParams(max_tokens=12, temperature=1.3, top_k=1, ignore_eos=True))]
    assert topk1 == greedy
    other = [o.token_ids for o in run(make_engine(smollm), prompts,
                                      SamplingParams(max_tokens=12, temperature=0.9, seed=8, ignore_eos=True))]
    assert other != a


def test_sample_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, [SamplingParams(top_p=0.7)], [g])[0] for _ in range(200)}
    assert seen == {0, 1}


def test_abort_mid_decode_frees_both_tiers(smollm):
    _, tok = smollm
    e = make_engine(smollm, policy="rotasched", block_size=8, num_device_blocks=24, num_host_blocks=64,
                    max_num_seqs=8, max_num_batched_tokens=64, ttft_slo=0.5)
    rids = [e.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
            for p in mixed_prompts(tok)[:6]]
    while e.stats()["rotations"] == 0:
        e.step()
    for r in rids:
        e.abort(r)
    assert not e.has_unfinished()
    assert all(e.output(r).finish_reason == "abort" for r in rids)
    e.bm.copies_done()
    assert e.bm.device.num_free == 24 and e.bm.host.num_free == 64


def test_streaming_events_and_eos(smollm):
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
    assert events[-1].finished and out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id
    assert len(out.metrics.token_times) == len(out.token_ids) and "Paris" in out.text


@pytest.mark.parametrize("kw,match", [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                                      ({"top_p": 0}, "top_p"), ({"top_k": -3}, "top_k")])
def test_invalid_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size=16, num_device_blocks=64, num_host_blocks=128, dtype="float32", device="cpu")


def test_llm_generate_bad_requests_alone(llm):
    prompts = ["Hello", "", list(range(5000)), [1, 2, 3], [10**9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0))
    assert [o.error is None for o in outs] == [True, False, False, True, False]
    assert "empty prompt" in str(outs[1].error)
    assert "more than the whole device pool" in str(outs[2].error)
    assert "token ids" in str(outs[4].error)
    assert len(outs[0].token_ids) == 4 and outs[0].text and len(outs[3].token_ids) == 4
    assert outs[0].metrics.first_token_time >= outs[0].metrics.arrival_time


def test_llm_generate_api_shape(llm):
    outs = llm.generate(["What is 2+2?", "Name a color."],
                        [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                         SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)])
    assert [len(o.token_ids) for o in outs] == [3, 5]
    assert outs[0].prompt == "What is 2+2?" and outs[0].prompt_token_ids == llm.tokenizer("What is 2+2?").input_ids
    assert outs[0].finish_reason == "length" and outs[0].request_id != outs[1].request_id


def test_context_length_error(llm):
    out = llm.generate([[1] * 10], SamplingParams(max_tokens=9000))[0]
    assert "context" in str(out.error)


def test_unknown_policy(smollm):
    with pytest.raises(ValueError, match="unknown policy"):
        make_engine(smollm, policy="nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rotation_is_invisible():
    """On a GPU: pinned host pool, two copy streams, events; greedy tokens as with an ample pool."""
    from conftest import tiny_pair
    model, _ = tiny_pair(seed=5, vocab=301, hidden=64, heads=4, kv_heads=2)
    model = model.to("cuda")
    prompts = [[(7 * i + j) % 301 for j in range(5 + 3 * i)] for i in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = {}
    for policy, blocks in [("fcfs", 256), ("rotasched", 24), ("fcfs-swap", 24)]:
        e = Engine(model, None, policy=policy, block_size=4, num_device_blocks=blocks, num_host_blocks=256,
                   max_num_seqs=6, max_num_batched_tokens=32, clock=virtual_clock(), ttft_slo=0.3, tbt_slo=0.02)
        assert e.pools.host.is_pinned()
        outs[policy] = [o.token_ids for o in run(e, prompts, params)]
        if blocks == 24:
            assert e.stats()["rotations"] > 0
    assert outs["rotasched"] == outs["fcfs"] and outs["fcfs-swap"] == outs["fcfs"]
