"""Tensor parallelism on the CPU: two ranks over gloo, spawned by the engine."""
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_pair
from parallel.tp import split
from superinfer import Engine, EngineConfig, EngineError, LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMALL = dict(block_size=8, num_device_blocks=8, num_host_blocks=256, max_num_seqs=8,
             max_num_batched_tokens=64, ttft_slo=0.5, tbt_slo=0.1)


def generate(model, tok, prompts, tp, **kw):
    engine = Engine(EngineConfig(tensor_parallel_size=tp, **kw), model, tok)
    try:
        outs = LLM.from_engine(engine).generate(prompts, GREEDY)
        return [o.token_ids for o in outs], engine.stats()
    finally:
        engine.close()


def test_split_is_even_and_complete():
    assert [split(9, 2, r) for r in range(2)] == [(0, 5), (5, 9)]
    assert [split(3, 2, r) for r in range(2)] == [(0, 2), (2, 3)]


@pytest.mark.parametrize("policy", ["fcfs", "rotasched"])
def test_embedded_model_on_two_ranks_equals_one(smollm, policy):
    """SmolLM2's 3 KV heads go 2 + 1; greedy tokens equal the single process's, with a pool
    small enough that requests are preempted or rotated."""
    from conftest import share_weights
    model, tok = smollm
    prompts = [f"Tell me about {x}." for x in ("the moon", "bread", "chess", "rivers", "bees",
                                                "winter")]
    one, _ = generate(model, tok, prompts, 1, policy=policy, **SMALL)
    two, stats = generate(share_weights(model), tok, prompts, 2, policy=policy, **SMALL)
    assert two == one
    assert stats["rotations"] + stats["recomputes"] > 0


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_heads=st.sampled_from([2, 3, 4]), group=st.sampled_from([1, 2]), tied=st.booleans(),
       seed=st.integers(0, 1000))
def test_tiny_models_on_two_ranks_equal_one(kv_heads, group, tied, seed):
    make = lambda: tiny_pair(seed=seed, vocab=151, hidden=8 * kv_heads * group,
                             heads=kv_heads * group, kv_heads=kv_heads, tied=tied)[0]
    prompts = [[(7 * i + j) % 151 for j in range(3 + 4 * i)] for i in range(5)]
    one, _ = generate(make(), None, prompts, 1, policy="rotasched", **SMALL)
    two, stats = generate(make(), None, prompts, 2, policy="rotasched", **SMALL)
    assert two == one and stats["rotations"] > 0


def test_each_ranks_kv_shard_survives_a_rotation_bitwise():
    model = tiny_pair(seed=3, vocab=151, hidden=32, heads=4, kv_heads=2)[0]
    engine = Engine(EngineConfig(tensor_parallel_size=2, policy="rotasched", block_size=4,
                                 num_device_blocks=16, num_host_blocks=32), model, None)
    try:
        rid = engine.add_request(list(range(10, 23)), SamplingParams(max_tokens=8, temperature=0))
        engine.step()
        bm, runner = engine.bm, engine.runner
        before = runner.digests(bm.block_table(rid))
        runner.execute(bm.next_epoch(), bm.swap_out(rid), [], [])
        runner.execute(bm.next_epoch(), [], bm.swap_in(rid), [])
        after = runner.digests(bm.block_table(rid))
        assert after == before and len(set(before)) == 2   # two different shards, both intact
    finally:
        engine.close()


def test_a_dead_rank_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("SUPERINFER_TP_TIMEOUT", "10")
    model = tiny_pair(seed=4, vocab=151, hidden=32, heads=4, kv_heads=2)[0]
    engine = Engine(EngineConfig(tensor_parallel_size=2, num_device_blocks=16), model, None)
    try:
        engine.runner.procs[0].kill()
        engine.runner.procs[0].join(5)
        rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
        t = time.perf_counter()
        with pytest.raises(EngineError, match="rank 1"):
            engine.step()
        assert time.perf_counter() - t < 15
        assert engine.output(rid).finish_reason == "error"
    finally:
        engine.close()


def test_kv_heads_must_cover_the_ranks():
    model = tiny_pair(seed=1, vocab=101, hidden=32, heads=4, kv_heads=1)[0]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Engine(EngineConfig(tensor_parallel_size=2), model, None)
