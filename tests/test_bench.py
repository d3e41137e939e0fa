"""bench.py: metric functions on hand-worked examples, the trace parser, a tiny end-to-end run."""
import json

import pytest

import bench
from workload import replay
from workload.metrics import harms, percentile, policy_of, summarize, verdict
from workload.trace import (DEFAULT_TRACE, Scaling, TraceError, read_trace, synthetic_workload,
                            trace_workload, with_rate)


def test_percentile_matches_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_summarize_hand_worked():
    # request A: arrives 0, tokens at 1.0, 1.1, 1.3 -> TTFT 1.0, gaps 0.1 0.2, TPOT 0.15
    # request B: arrives 0.5, one token at 3.5 -> TTFT 3.0, no gaps, TPOT 0 (one output token)
    recs = [(0.0, [1.0, 1.1, 1.3]), (0.5, [3.5])]
    s = summarize(recs, ttft_slo=2.0, tbt_slo=0.16)
    assert s["num_requests"] == 2
    assert s["ttft_mean_s"] == pytest.approx(2.0) and s["ttft_p50_s"] == pytest.approx(2.0)
    assert s["ttft_attainment"] == 0.5
    assert s["tbt_attainment"] == 0.5           # 0.1 ok, 0.2 not
    assert s["duration_s"] == pytest.approx(3.5)
    assert s["goodput_req_s"] == pytest.approx(1 / 3.5)   # only A meets TTFT and TPOT (0.15 <= 0.16)
    assert s["throughput_tok_s"] == pytest.approx(4 / 3.5)
    assert s["e2e_p99_s"] == pytest.approx(1.3 + 0.99 * 1.7)  # e2e 1.3 and 3.0
    tight = summarize(recs, ttft_slo=2.0, tbt_slo=0.16, tpot_slo=0.1)
    assert tight["goodput_req_s"] == 0.0


def write(tmp_path, text):
    p = tmp_path / "t.csv"
    p.write_text(text)
    return str(p)


def test_trace_parser_good(tmp_path):
    rows = read_trace(write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                      "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"))
    assert rows[0] == (0.0, 374, 44) and rows[1][0] == pytest.approx(4.314579, abs=1e-5)
    items = trace_workload(rows, 2, scaling=Scaling(prompt=0.5, output=0.5))
    assert [(i.prompt_len, i.output_len) for i in items] == [(187, 22), (198, 54)]
    capped = trace_workload(rows, 2, scaling=Scaling(0.1, 0.1, max_prompt=30, min_output=8))
    assert [(i.prompt_len, i.output_len) for i in capped] == [(30, 8), (30, 11)]
    assert with_rate(items, 2.0)[1].arrival == pytest.approx(0.5)


@pytest.mark.parametrize("text,match", [
    ("a,b,c\n", r"t.csv:1: expected header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.00,x,1\n",
     r"t.csv:3: cannot parse"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,0,44\n", r"t.csv:2: token counts"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", r"t.csv:2: cannot parse"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
])
def test_trace_parser_errors(tmp_path, text, match):
    with pytest.raises(TraceError, match=match):
        read_trace(write(tmp_path, text))


def test_real_trace_and_synthetic_arrivals():
    rows = read_trace(DEFAULT_TRACE)
    assert len(rows) == 19366
    items = synthetic_workload(2000, rate=4.0, burstiness=1.0, prompt_lens=[8], output_lens=[4], seed=1)
    rate = (len(items) - 1) / items[-1].arrival
    assert 3.6 < rate < 4.4  # Poisson at 4 req/s
    bursty = synthetic_workload(2000, rate=4.0, burstiness=0.25, prompt_lens=[8], output_lens=[4], seed=1)
    gaps = [b.arrival - a.arrival for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv > 1.5  # gamma shape 0.25 has CV 2


@pytest.mark.parametrize("clock", ["wall", "own"])
def test_tiny_end_to_end_json(tmp_path, clock):
    out, log = tmp_path / "r.json", tmp_path / "s.jsonl"
    bench.main(["--clock", clock, "--trace", "none", "--num-requests", "4",
                "--input-lens", "8,16", "--output-lens", "3",
                "--rates", "8", "--policies", "fcfs,rotasched,fcfs",  # fcfs named twice
                "--num-device-blocks", "4",
                "--block-size", "8", "--max-num-seqs", "2", "--max-num-batched-tokens", "32",
                "--json", str(out), "--log", str(log)])
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["fcfs", "rotasched", "fcfs#2"]   # so it runs twice
    for r in rows:
        assert set(bench.JSON_KEYS) <= set(r) and r["num_requests"] == 4 and r["rate"] == 8.0
        assert r["clock"] == clock
        assert 0 <= r["ttft_attainment"] <= 1 and r["throughput_tok_s"] > 0
    logs = sorted(tmp_path.glob("s.*.jsonl"))
    assert [p.name for p in logs] == ["s.fcfs#2.8.jsonl", "s.fcfs.8.jsonl", "s.rotasched.8.jsonl"]
    again = [json.loads(line) for line in logs[0].read_text().splitlines()]
    assert again[0]["settings"]["policy"] == "fcfs"
    records = [json.loads(line) for line in logs[1].read_text().splitlines()]
    assert records[0]["event"] == "config" and [r["event"] for r in records].count("add") == 4
    assert all(r["step"] >= 0 for r in records if r["event"] == "step")


@pytest.mark.parametrize("argv,match", [
    (["--rates", "0"], "must be > 0"), (["--rates", "-1"], "must be > 0"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--block-size", "0"], "block_size"), (["--policies", "fcfs,lifo"], "unknown policy 'lifo'"),
    (["--trace", "/nope.csv"], "no such trace file"), (["--num-requests", "30000"], "exceeds the trace"),
    (["--run-seconds", "0"], "--run-seconds must be > 0"), (["--model", "/nope"], "no such file"),
])
def test_bad_arguments_are_one_line_errors_before_loading(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and match in err and len(err.strip().splitlines()) == 1


def row(policy, ttft, tbt, p99, tok, rot=0, pre=0):
    return {"policy": policy, "rate": 1.0, "ttft_attainment": ttft, "tbt_attainment": tbt,
            "tbt_p99_s": p99, "throughput_tok_s": tok, "rotations": rot, "recomputes": pre}


def test_verdict_judges_each_rule_in_words():
    rows = [row("fcfs", 0.3, 0.9, 0.5, 30, pre=5), row("rotasched", 0.6, 0.88, 0.6, 31, rot=9),
            row("rotasched-lvf", 0.8, 0.9, 1.2, 30, rot=4)]
    lines = verdict(rows)
    assert "rotasched vs fcfs: TTFT attainment raised: held: 60.0% vs 30.0%, +30.0 points" \
        in lines[0]
    assert "rotasched vs fcfs: TBT comparable: held" in lines[1]
    assert "rotasched vs fcfs: throughput comparable: held: 1.03x" in lines[2]
    assert "rotasched-lvf vs fcfs: TBT comparable: fell short" in lines[4] and "p99 2.40x" in lines[4]
    worse = verdict([row("fcfs", 0.3, 0.9, 0.5, 30, pre=5), row("rotasched", 0.29, 0.9, 0.5, 27)])
    assert "TTFT attainment raised: fell short" in worse[0]
    assert "throughput comparable: fell short: 0.90x" in worse[2]
    calm = verdict([row("fcfs", 1.0, 0.95, 0.2, 30), row("rotasched", 1.0, 0.95, 0.2, 30)])
    assert any("no KV pressure" in x for x in calm)
    assert harms(row("fcfs", 0.95, 0.9, 0.2, 30), row("rotasched", 0.85, 0.9, 0.2, 27)) == [
        "throughput -10.0%", "TTFT attainment -10.0 points vs fcfs"]
    ours = row("rotasched", 0.9, 0.8, 0.5, 30) | {"tbt_slo_s": 0.6}   # a pause within the SLO
    assert harms(row("fcfs", 0.9, 0.9, 0.2, 30), ours, row("fcfs-swap", 0.95, 0.9, 0.2, 30)) == [
        "TBT attainment -10.0 points", "TTFT attainment -5.0 points vs fcfs-swap"]
    level = [row("fcfs", 0.3, 0.9, 0.5, 30, pre=5) | {"speed": 1.01},
             row("rotasched", 0.6, 0.88, 0.6, 31) | {"speed": 0.99}]
    assert not any("NOT LEVEL" in x for x in verdict(level))
    uneven = verdict([level[0] | {"speed": 1.04}, level[1]])
    assert "NOT LEVEL: the machine ran fcfs 5.1% slower than rotasched" in uneven[0]
    assert "rerun" in uneven[0] and "TTFT attainment raised: held" in uneven[1]


def test_a_policy_named_twice_runs_twice_and_the_verdict_gives_the_a_a_gap():
    assert bench.label_repeats(["fcfs", "rotasched", "fcfs", "rotasched", "fcfs"]) == [
        "fcfs", "rotasched", "fcfs#2", "rotasched#2", "fcfs#3"]
    assert policy_of("rotasched:alpha=3#2") == "rotasched:alpha=3"
    rows = [row("fcfs", 0.3, 0.9, 0.5, 30, pre=5) | {"speed": 1.0},
            row("rotasched", 0.6, 0.9, 0.5, 30, rot=3) | {"speed": 1.0},
            row("fcfs#2", 0.5, 0.9, 0.5, 30) | {"speed": 1.01},
            row("rotasched#2", 0.9, 0.9, 0.5, 30, rot=3) | {"speed": 1.0}]
    lines = verdict(rows)
    aa = [x for x in lines if "A/A" in x]
    assert len(aa) == 2 and "fcfs#2 repeats fcfs" in aa[0] and "20.0 points apart" in aa[0]
    assert "machine speed 1.000 and 1.010" in aa[0] and "30.0 points apart" in aa[1]
    # the repeat is the noise floor, not a second chance: the verdict is the first run's
    assert any("rotasched vs fcfs: TTFT attainment raised: held: 60.0%" in x for x in lines)
    assert not any("rotasched#2 vs" in x for x in lines)


def test_own_clock_runs_only_while_its_engine_steps(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(replay.time, "perf_counter", lambda: now[0])
    c = replay.OwnClock()
    now[0] += 5          # another run's step: this clock stands still
    assert c() == 0.0
    c.run()
    now[0] += 0.25       # its own step
    assert c() == 0.25
    c.pause()
    now[0] += 3
    assert c() == 0.25
    c.wait_until(2.0)    # idle until the next arrival: a jump, not a sleep
    c.wait_until(1.0)    # never back
    assert c() == 2.0


def test_interleaved_runs_share_the_machine_each_on_its_own_clock():
    from conftest import tiny_pair
    from superinfer import Engine, EngineConfig
    model, _ = tiny_pair(seed=3, vocab=101, hidden=32, heads=4, kv_heads=2)
    items = [replay.Item(0.0, 6 + i, 12) for i in range(6)]
    prompts = [[(5 * i + j) % 101 for j in range(it.prompt_len)] for i, it in enumerate(items)]
    clocks = [replay.OwnClock() for _ in range(2)]
    engines = [Engine(EngineConfig(policy=p, block_size=4, num_device_blocks=12,
                                   num_host_blocks=64, max_num_seqs=4, max_num_batched_tokens=16),
                      model, None, clock=c) for p, c in zip(("fcfs", "rotasched"), clocks)]
    replays = [replay.Replay(e, items, prompts, 60.0, c) for e, c in zip(engines, clocks)]
    order = []   # who steps when, and where each run's clock stood then

    def tracked(step, k):
        return lambda: order.append((k, [c() - r.t0 for c, r in zip(clocks, replays)])) or step()
    for k, e in enumerate(engines):
        e.step = tracked(e.step, k)
    t = replay.time.perf_counter()
    (ra, sa), (rb, sb) = replay.serve_interleaved(replays, "test")
    wall = replay.time.perf_counter() - t
    assert sa["unfinished"] == sb["unfinished"] == 0 and sa["steps"] > 5 and sb["steps"] > 5
    for recs in (ra, rb):
        assert all(len(times) == 12 and times[0] >= arrival for arrival, times in recs)
    # each run's timeline is its own steps only: together no longer than the wall time; the
    # one whose clock is behind steps next (while the other still has steps to take), so
    # neither is starved, however unevenly the machine runs their steps
    spans = [max(t[-1] for _, t in recs) - min(a for a, _ in recs) for recs in (ra, rb)]
    assert sum(spans) <= wall and min(spans) > 0.25 * wall
    last = {k: i for i, (k, _) in enumerate(order)}
    both = [(k, at) for i, (k, at) in enumerate(order) if last[1 - k] > i]
    assert len(both) > 5 and all(at[k] <= at[1 - k] + 1e-3 for k, at in both)
    assert {k for k, _ in both} == {0, 1}
    for e in engines:
        e.close()


def test_calibration_takes_the_median_of_three_unloaded_runs(capsys):
    """One slow unloaded run (a cold first step) must not set the SLOs: the median does."""
    from argparse import Namespace
    from workload.trace import Item
    unloaded = iter([(0.0, [0.8, 1.0, 1.2]), (0.0, [0.1, 0.15, 0.2]), (0.0, [0.12, 0.16, 0.2])])

    def run(items, prompts, label, deadline):
        if label == "unloaded latency":
            return [next(unloaded)], None
        return [(0.0, [0.1 * (k + 1)]) for k in range(len(items))], None   # warm-up, bulk
    args = Namespace(run_seconds=10, ttft_slo=None, tbt_slo=None, ttft_slo_factor=10,
                     tbt_slo_factor=5, model="tiny", policies="fcfs")
    cfg = Namespace(max_num_seqs=2)
    ttft, tbt, sat = bench.calibrate(run, [Item(0.0, 8, 4)] * 4, [[1] * 8] * 4, cfg, args)
    assert ttft == pytest.approx(1.2) and tbt == pytest.approx(0.25)   # 10 x 0.12 s, 5 x 50 ms
    assert sat == pytest.approx(4 / 0.4)
    assert "median of 3" in capsys.readouterr().out


def test_a_profile_trace_is_split_by_operator_kind_in_self_time(tmp_path):
    """speed_compare --profile (tools/profiles.py): an operator's time less that of the operators
    it calls, per kind; threads apart; events that are not operators ignored. And on a real
    torch trace."""
    import torch

    from tools.profiles import trace_ops
    op = lambda name, tid, ts, dur: {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid,
                                     "ts": ts, "dur": dur}
    events = [op("_C::onednn_mm", 1, 0, 10_000), op("aten::empty", 1, 1_000, 2_000),
              op("aten::add", 2, 500, 5_000), op("aten::index_select", 1, 20_000, 3_000),
              {"ph": "X", "cat": "user_annotation", "name": "step", "tid": 1, "ts": 0,
               "dur": 50_000}]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": events}))
    got = trace_ops(str(tmp_path / "t.json"))
    assert got == pytest.approx({"GEMMs": 0.008, "other ops": 0.007, "KV gather": 0.003})
    with torch.profiler.profile() as prof:
        torch.index_select(torch.ones(64, 8), 0, torch.arange(32))
    prof.export_chrome_trace(str(tmp_path / "real.json"))
    assert trace_ops(str(tmp_path / "real.json"))["KV gather"] > 0
