"""sim.py: the cost model on hand-computed cases, determinism, scheduler invariants under it."""
import pytest

from sched import Request, Scheduler
from superinfer import EngineConfig
from test_sched import check_step
from tools.sim import (MODELS, PROFILES, CostModel, Hardware, ModelSpec, main, requests_at,
                       run_policy, simulate)


def test_model_sizes():
    m = MODELS["llama-3-8b"]
    assert 7.9e9 < m.weight_bytes / 2 < 8.1e9                 # 8.03B parameters in bf16
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2        # 128 KiB per token
    assert 12.5e9 < MODELS["mixtral-8x7b"].active_flops_per_token() / 2 < 13.5e9  # ~12.9B active
    assert 0.26e9 < MODELS["smollm2-135m"].active_flops_per_token() < 0.28e9


def test_decode_at_batch_1_is_weight_bandwidth_bound():
    hw, m = PROFILES["gh200-96"], MODELS["llama-3-8b"]
    c = CostModel(m, hw)
    t = c.compute_time(tokens=1, ctx_tokens=100, attn_pairs=100)
    assert t == pytest.approx((m.weight_bytes + 101 * m.kv_bytes_per_token) / (hw.hbm_bw * hw.mbu))
    big = c.compute_time(tokens=8192, ctx_tokens=0, attn_pairs=8192 * 4096)
    assert big > 8192 * m.active_flops_per_token() / (hw.flops * hw.mfu)  # prefill is compute-bound


def test_merged_vs_per_layer_transfer():
    hw, m = PROFILES["gh200-96"], MODELS["llama-3-8b"]
    c = CostModel(m, hw)
    n = 100
    merged = c.transfer_time(n, 0, 1, 0, duplex=True)
    per_layer = c.transfer_time(n, 0, 2 * m.layers * n, 0, duplex=False)
    assert merged == pytest.approx(hw.copy_overhead + n * c.block_bytes / hw.link_bw)
    assert per_layer == pytest.approx(2 * m.layers * n * hw.copy_overhead + n * c.block_bytes / hw.link_bw)
    seg = c.block_bytes / (2 * m.layers)                       # 32 KiB per layer copy
    assert n * c.block_bytes / per_layer / 1e9 < 12            # ~10 GB/s, as measured for naive copies
    assert n * c.block_bytes / merged / 1e9 > 190              # ~200 GB/s merged
    both = c.transfer_time(n, n, 1, 1, duplex=True)
    assert both == pytest.approx(2 * n * c.block_bytes / hw.duplex_bw)  # capped by the duplex limit
    assert seg == 32 * 1024


def test_simulation_is_deterministic():
    c = CostModel(MODELS["llama-3-8b"], PROFILES["h100-pcie"])
    lengths = [(500, 100), (2000, 300), (100, 20)]
    reqs = requests_at(20.0, 10.0, lengths, seed=3)
    cfg = EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192)
    a = run_policy("rotasched", reqs, c, cfg)
    b = run_policy("rotasched", requests_at(20.0, 10.0, lengths, seed=3), c, cfg)
    assert a == b and a["num_requests"] == len(reqs)


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap", "rotasched", "rotasched-released"])
def test_invariants_hold_under_the_cost_model(policy):
    c = CostModel(MODELS["llama-3-8b"], PROFILES["gh200-96"])
    cfg = EngineConfig(policy=policy, max_num_seqs=64, max_num_batched_tokens=1024, ttft_slo=2.0,
                       xfer_budget=200)
    s = Scheduler.create(cfg, 400, 4000)               # a small pool so that rotation happens
    reqs = requests_at(40.0, 5.0, [(300, 200), (1500, 100), (50, 400)], seed=1)
    done, rejected = simulate(s, reqs, lambda plan: c.step_time(plan, s.policy.duplex),
                              on_step=lambda plan, now: check_step(s, plan))
    assert len(done) == len(reqs) and not rejected


@pytest.mark.parametrize("kw,match", [({"flops": 0}, "flops"), ({"mfu": 1.5}, "mfu"),
                                      ({"duplex_bw": 1.0}, "duplex_bw"), ({"copy_overhead": -1}, "overheads")])
def test_bad_hardware(kw, match):
    base = dict(name="x", flops=1e12, hbm_bw=1e12, hbm_bytes=8e9, host_bytes=8e9, link_bw=1e10, duplex_bw=2e10,
                copy_overhead=1e-6, step_overhead=1e-3)
    with pytest.raises(ValueError, match=match):
        Hardware(**(base | kw))


def test_bad_model_and_fit():
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec("bad", 2, 64, 4, 3, 128, 100)
    with pytest.raises(ValueError, match="layers"):
        ModelSpec("bad", 0, 64, 4, 2, 128, 100)
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(MODELS["qwen2.5-32b"], Hardware("tiny", 1e12, 1e12, 16e9, 8e9, 1e10, 2e10, 1e-6, 1e-3))


def test_tensor_parallel_cost():
    """tp GPUs: per-GPU compute and weights shrink by tp, the pool grows, all-reduces cost time."""
    m, hw = MODELS["qwen2.5-32b"], PROFILES["h100-pcie"]
    one, two = CostModel(m, hw), CostModel(m, hw, tp=2)
    assert two.device_blocks > 2 * one.device_blocks     # half the weights per GPU: more room
    t1, t2 = one.compute_time(4096, 0, 4096 * 2048), two.compute_time(4096, 0, 4096 * 2048)
    ar = 2 * m.layers * (2 * 1 / 2 * 4096 * m.hidden * 2 / hw.p2p_bw + 2 * hw.p2p_latency)
    assert two.allreduce_time(4096) == pytest.approx(ar)
    assert t2 == pytest.approx(t1 / 2 + ar)
    with pytest.raises(ValueError, match="must divide"):
        CostModel(m, hw, tp=3)


@pytest.mark.parametrize("argv,match", [
    (["--rates", "-1"], "must be > 0"), (["--rates", "x"], "--rates"),
    (["--duration", "0"], "--duration must be > 0"), (["--hw", "tpu"], "invalid choice"),
    (["--policies", "fcfs,lifo"], "unknown policy 'lifo'"), (["--max-len", "1"], "--max-len"),
])
def test_bad_arguments_are_one_line_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_huge_rate_is_capped_and_zero_arrivals_are_skipped(capsys):
    main(["--rates", "1e-6", "--duration", "1", "--policies", "fcfs"])
    assert "no request arrives" in capsys.readouterr().out


def test_claim_sweep_writes_judged_files_and_reruns_one_policy(tmp_path, capsys):
    """tools.claim: one JSON file per (setting, workload) whose rows carry their settings; a
    rerun of one policy keeps the other policies' rows from the files already there."""
    import json
    from tools import claim
    args = ["--out", str(tmp_path), "--settings", "gh200-96:qwen2.5-32b", "--workloads", "conv",
            "--factors", "1.5", "--duration", "6", "--jobs", "1"]
    claim.main(args)
    path = tmp_path / "gh200-96_qwen2.5-32b_conv.json"
    rows = json.loads(path.read_text())
    assert sorted(r["policy"] for r in rows) == sorted(claim.POLICIES)
    assert all(r["ttft_slo_s"] == 5.0 and r["saturation_factor"] == 1.5 for r in rows)
    assert "gh200-96_qwen2.5-32b_conv: best TTFT gain" in capsys.readouterr().out
    before = {r["policy"]: r for r in rows}
    claim.main(args + ["--policies", "rotasched"])
    rerun = json.loads(path.read_text())
    again = {r["policy"]: r for r in rerun}
    assert len(rerun) == len(rows) and again["fcfs"] == before["fcfs"]
    with pytest.raises(SystemExit):
        claim.main(args + ["--policies", "nope"])
    capsys.readouterr()
    claim.main(args + ["--ablate", "rotasched-lvf;rotasched:alpha=1"])
    out = capsys.readouterr().out
    assert "_conv rotasched-lvf: best TTFT gain" in out and "rotasched:alpha=1: best" in out
    abl = json.loads((tmp_path / "ablation_conv.json").read_text())
    assert sorted(r["policy"] for r in abl) == ["rotasched-lvf", "rotasched:alpha=1"]
    assert {r["rate"] for r in abl} == {before["fcfs"]["rate"]}  # the sweep's arrivals
    with pytest.raises(SystemExit):
        claim.main(args + ["--ablate", "rotasched:nope=1"])
    capsys.readouterr()


# ---------------------------------------------------------------- shared prefixes

def test_multi_turn_conversations_resend_their_history():
    """Each turn's pieces start with the previous turn's and a reply's stand-in; every prompt
    fits the context; the think time puts turns of one conversation apart."""
    from workload.trace import THINK, TURNS, random_arrivals, with_sharing
    items = with_sharing(random_arrivals(1.0, 200, [(200, 40), (90, 12)], 3), "multi-turn", 400)
    assert items == sorted(items, key=lambda i: i.arrival)
    assert all(i.prompt_len + i.output_len <= 400 and i.prompt_len == 16 * len(i.pieces)
               for i in items)
    system = items[0].pieces[:4]
    assert all(i.pieces[:4] == system for i in items)
    later = [(a, b) for a in items for b in items
             if len(b.pieces) > len(a.pieces) and b.pieces[:len(a.pieces)] == a.pieces]
    assert later and all(b.arrival - a.arrival >= THINK * 0.5 for a, b in later)
    assert all(b.pieces[len(a.pieces):][:-(-a.output_len // 16)] for a, b in later)
    conversations = len({i.pieces[4] for i in items})  # by their first message
    assert len(items) / TURNS <= conversations < len(items)


def test_shared_pieces_are_shared_tokens_and_shared_block_hashes():
    from tools.sim import piece_hashes
    from workload.trace import Item, synthetic_prompts
    a, b = Item(0.0, 40, 4, (7, 8, 9), 16), Item(1.0, 40, 4, (7, 8, 5), 16)
    pa, pb = synthetic_prompts([a, b], 5000, 0)
    assert pa[:32] == pb[:32] and pa[32:] != pb[32:] and len(pa) == len(pb) == 40
    ha, hb = piece_hashes(a, 8), piece_hashes(b, 8)
    assert len(ha) == 5 and ha[:4] == hb[:4] and ha[4] != hb[4]
    assert piece_hashes(Item(0.0, 40, 4), 8) == []  # no pieces: nothing shared


def test_a_hash_trace_is_read_and_a_bad_line_named(tmp_path):
    from workload.trace import TraceError, read_hash_trace
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 1000, "input_length": 700, "output_length": 9, '
                    '"hash_ids": [1, 2]}\n{"timestamp": 1500, "input_length": 300, '
                    '"output_length": 5, "hash_ids": [1]}\n')
    items = read_hash_trace(str(good))
    assert [(i.arrival, i.prompt_len, i.pieces) for i in items] == [(0.0, 700, (1, 2)),
                                                                     (0.5, 300, (1,))]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 900, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: .*cover"):
        read_hash_trace(str(bad))


def test_the_host_tier_keeps_prefixes_the_device_evicted_in_simulation():
    """Multi-turn arrivals over a device pool too small to keep a conversation between turns:
    both tiers find more of the prompts cached than the device alone, and neither changes the
    number of requests served."""
    cfg = EngineConfig(policy="rotasched", max_num_seqs=256, max_num_batched_tokens=4096)
    cost = CostModel(MODELS["llama-3-8b"], PROFILES["gh200-96"], 16, device_blocks=500)
    reqs = requests_at(4.0, 20, [(600, 40), (300, 80)], 0, 8192, sharing="multi-turn")
    hits = {}
    for caching in ("off", "device", "both"):
        s = Scheduler.create(EngineConfig(**vars(cfg) | {"prefix_caching": caching}),
                             cost.device_blocks, cost.host_blocks)
        fresh = [Request(r.rid, r.num_prompt, r.max_tokens, r.arrival, hashes=r.hashes)
                 for r in reqs]
        done, rejected = simulate(s, fresh, lambda plan: cost.step_time(plan, True, s.overlap))
        s.bm.check()
        assert len(done) == len(reqs) and not rejected
        hits[caching] = s.cache_hits
    assert hits["off"] == 0 < hits["device"] < hits["both"]


def test_saturation_is_calibrated_on_the_requests_the_runs_replay(tmp_path):
    """Capped at max_len as the runs are (a long-context trace calibrated uncut priced a load
    its runs never saw), and a hash trace with its shared prefixes: what makes it cheaper to
    serve than its lengths alone."""
    import json
    from tools.sim import deep_queue, saturation_rate, trace_queue
    from workload.trace import read_hash_trace
    lengths = [(12000, 300), (500, 40)]
    runs = {(r.num_prompt, r.max_tokens) for r in requests_at(5.0, 60, lengths, 0, 8192)}
    queue = {(r.num_prompt, r.max_tokens) for r in deep_queue(lengths, 0, 8192, n=50)}
    assert queue == runs == {(8191, 1), (500, 40)}
    path = tmp_path / "t.jsonl"
    doc = list(range(12))  # a 6,144-token document every request reads, then its own question
    path.write_text("".join(json.dumps({"timestamp": 100 * i, "input_length": 6600,
                                        "output_length": 50, "hash_ids": doc + [100 + i]}) + "\n"
                            for i in range(200)))
    items = read_hash_trace(str(path))
    cost = CostModel(MODELS["llama-3-8b"], PROFILES["gh200-96"])
    cfg = EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192)
    shared = trace_queue(items, cfg.block_size)
    assert shared[0].hashes and all(r.arrival == 0.0 for r in shared)
    alone = deep_queue([(6600, 50)], 0, None, n=200)
    assert saturation_rate(cost, shared, cfg) > 2 * saturation_rate(cost, alone, cfg)
