"""scheduler.py on a simulated clock: invariants, transactions, liveness, each policy's rules."""
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import sched
from sched import (POLICIES, Request, RotaSched, RotaSchedLVF, RotaSchedReleased, Scheduler,
                   Status, StepPlan, make_policy)
from kv import CACHING
from superinfer import EngineConfig
from tools import schedlog
from tools.sim import MODELS, CostModel, Hardware, run_policy, simulate
from workload.metrics import harms


def make_sched(policy, dev=64, host=256, bs=4, **kw):
    return Scheduler.create(EngineConfig(policy=policy, block_size=bs, **kw), dev, host)


def check_step(s: Scheduler, plan):
    """What must hold after every step, whatever the policy."""
    s.bm.check()
    cfg = s.cfg
    assert plan.num_tokens <= cfg.max_num_batched_tokens
    assert len(plan.chunks) <= cfg.max_num_seqs
    if s.policy.capped:
        assert plan.blocks_moved <= cfg.xfer_budget
    for r in s.running:
        assert r.status is Status.RUNNING and not s.bm.seqs[r.rid].on_host
        assert len(s.bm.block_table(r.rid)) >= s.bm.blocks_for(r.num_computed)
    for r in s.rotary:
        assert r.status is Status.ROTARY and s.bm.seqs[r.rid].on_host
    for r in s.waiting:
        assert r.status is Status.WAITING and r.num_computed == 0 and r.rid not in s.bm.seqs
    in_flight_src = {src for src, _ in plan.swap_out} if s.bm.duplex else set()
    assert not in_flight_src & {dst for _, dst in plan.swap_in}, "swap-in onto an in-flight source"
    assert not set(plan.rotated_out) & set(plan.rotated_in), "rotated out and in in one step"
    # transactional rotation: a proactive rotation out is for a candidate started in this step;
    # only the released scheduler's watermark rotates with no candidate (its design)
    started = set(plan.admitted + plan.resumed + plan.rotated_in)
    for victim in plan.proactive:
        if victim in plan.rotated_for:
            assert plan.rotated_for[victim] in started, (victim, plan)
        else:
            assert s.policy.name == "rotasched-released", (victim, plan)
    if s.overlap:  # a request swapped in this step computes from the next one, unless none of
        copied = {dst for _, dst in plan.swap_in}  # its blocks is being copied in (all kept)
        for rid in {r.rid for r in plan.chunks} & set(plan.rotated_in) & set(s.bm.seqs):
            assert not set(s.bm.block_table(rid)) & copied, (rid, plan)


workload = st.lists(st.tuples(st.floats(0, 2), st.integers(1, 40), st.integers(1, 20),
                              st.integers(0, 2)), min_size=1, max_size=25)
POLICY_SPECS = sorted(POLICIES) + ["rotasched-lvf:alpha=1,beta_f=0", "rotasched:beta_b=0.5"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICY_SPECS), reqs=workload, dev=st.integers(16, 48),
       host=st.integers(0, 80), bs=st.integers(1, 8), seqs=st.integers(1, 8),
       extra_tokens=st.integers(0, 64), xfer=st.integers(0, 40), step=st.floats(0.001, 0.2),
       overlap=st.booleans(), caching=st.sampled_from(CACHING))
def test_invariants_and_liveness(policy, reqs, dev, host, bs, seqs, extra_tokens, xfer, step,
                                 overlap, caching):
    """Any workload, pool and policy, with prompts that share prefixes (by priority class: the
    same first tokens, or the same first half) cached on neither, one or both tiers."""
    s = make_sched(policy, dev, host, bs, max_num_seqs=seqs, max_num_batched_tokens=seqs + extra_tokens,
                   xfer_budget=xfer, ttft_slo=0.5, tbt_slo=0.05, swap_in_overlap=overlap,
                   prefix_caching=caching)
    requests = [Request(f"r{i}", p, o, t, priority=pr, prompt=shared_prompt(i, p, pr))
                for i, (t, p, o, pr) in enumerate(reqs)]
    total = sum(r.num_prompt + r.max_tokens for r in requests)
    # every token is computed at most (1 + recomputes) times; a step computes or moves something
    done, rejected = simulate(s, requests, lambda plan: step, on_step=lambda plan, now: check_step(s, plan),
                              max_steps=20 * total + 100)
    assert len(done) + len(rejected) == len(requests)
    for r, err in rejected:
        assert s.bm.blocks_for(r.num_prompt + r.max_tokens) > dev and "device pool" in err
    for r in done:
        assert r.status is Status.FINISHED and len(r.output) == r.max_tokens
        assert r.token_times == sorted(r.token_times)
    s.bm.copies_done()
    assert s.bm.num_free == dev and s.bm.host.num_free == host, "blocks leaked"


def shared_prompt(i: int, n: int, kind: int) -> list[int]:
    base = list(range(100, 140))
    return base[:n] if kind == 0 else base[:n // 2] + [200 + i] * (n - n // 2)


def step_once(s, now, tokens=None):
    plan = s.schedule(now)
    s.update(plan, {r.rid: 0 for r in plan.chunks} | (tokens or {}), now + 0.01)
    s.bm.copies_done()
    return plan


# ---------------------------------------------------------------- head-of-line blocking

def hol_workload():
    """8 long decodes fill the pool; 8 short requests arrive just after."""
    longs = [Request(f"long{i}", 16, 400, 0.0) for i in range(8)]
    shorts = [Request(f"short{i}", 8, 4, 1.0 + 0.1 * i) for i in range(8)]
    return longs + shorts


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap", "rotasched", "rotasched-released"])
def test_head_of_line_blocking(policy):
    # each long needs up to (16 + 400) / 4 = 104 blocks; 8 of them fill 128 blocks within ~1 s
    slo = 3.0
    # the released policy preallocates 64 tokens (16 blocks here) a request: a watermark above it
    watermark = {"rotasched-released": {"xfer_budget": 48}}.get(policy, {})
    s = make_sched(policy, dev=128, host=2048, bs=4, max_num_seqs=16, max_num_batched_tokens=64,
                   ttft_slo=slo, tbt_slo=0.05, **watermark)
    done, _ = simulate(s, hol_workload(), lambda plan: 0.02)
    ttft = {r.rid: r.token_times[0] - r.arrival for r in done}
    shorts = [ttft[f"short{i}"] for i in range(8)]
    if policy == "fcfs":         # the shorts queue behind the longs, which hold the pool ~20 s
        assert min(shorts) > 5 * slo, shorts
    elif policy == "fcfs-swap":  # vLLM v0 (chunked) admits new prefills into the room its own
        assert len(done) == 16   # swap-outs leave, so the shorts get in; the longs pay for it
    else:                        # rotation lets every short request in within its TTFT SLO
        assert max(shorts) <= slo, shorts
        assert sum(r.rotations for r in done) > 0


# ---------------------------------------------------------------- RotaSched: lag and victims

def test_vlt_hand_worked():
    p = RotaSchedLVF(alpha=3, beta_f=0.5, beta_b=0, ttft_slo=5.0, tbt_slo=0.1)
    w = Request("w", 4, 4, arrival=10.0)
    assert p.vlt(w, 11.0) == 0.0 and p.lag(w, 11.0) == pytest.approx(-1.5)  # 1.5 s of slack
    assert p.lag(w, 12.5) == 0.0                                           # due from here
    assert p.vlt(w, 14.0) == pytest.approx(1.5)
    w.ttft_slo = 1.0                        # per-request SLO: lag starts after 0.5 s
    assert p.vlt(w, 14.0) == pytest.approx(3.5)
    rot = Request("rot", 4, 4, 0.0, status=Status.ROTARY, t_last_token=20.0)
    assert p.vlt(rot, 20.5) == pytest.approx(1.5)  # alpha * (0.5 - 0 * S_TBT)
    run = Request("run", 4, 4, 0.0, status=Status.RUNNING, t_admitted=18.0)
    assert p.vlt(run, 20.5) == pytest.approx(-2.5)
    order = sorted([w, rot, run], key=lambda r: p.rank(r, 20.5))
    assert [r.rid for r in order] == ["w", "rot", "run"]  # w: 20.5 - 10 - 0.5 = 10 > 1.5
    assert RotaSchedLVF(alpha=1, beta_b=1).vlt(rot, 20.5) == pytest.approx(0.4)  # 0.5 - 0.1


def test_lvf_ties_broken_by_arrival():
    p = RotaSchedLVF()
    a, b = Request("b", 4, 4, arrival=1.0), Request("a", 4, 4, arrival=2.0)
    assert [r.rid for r in sorted([b, a], key=lambda r: p.rank(r, 1.5))] == ["b", "a"]


def rotation_setup(policy="rotasched", arrival=0.0, prompt=20, **kw):
    """Three running decodes (7 tokens in the cache, first block written back) hold 6 of 10
    blocks; r1 has run longest. A new request of `prompt` tokens arrives; 20 need 5 blocks."""
    kw = dict(max_num_seqs=8, max_num_batched_tokens=64, ttft_slo=1.0, tbt_slo=0.1) | kw
    s = make_sched(policy, dev=10, host=64, bs=4, **kw)
    for i in range(3):
        s.add(Request(f"r{i}", 6, 16, 0.0))
    step_once(s, 0.0)
    step_once(s, 0.05)
    s.requests["r1"].t_admitted = -5.0
    s.add(Request("new", prompt, 4, arrival))
    return s


@pytest.fixture
def no_stall_budget(monkeypatch):
    monkeypatch.setattr(RotaSched, "STALLS", 1e9)


@pytest.mark.parametrize("policy", ["rotasched-lvf", "rotasched"])
def test_rotasched_rotates_the_longest_running_decode_for_a_new_request(policy):
    s = rotation_setup(policy)             # "new" need not be due: the ReLU'd lag admits it
    plan = s.schedule(0.3)                 # r1 frees its clean block: 4 + 1 = 5
    assert plan.rotated_out == ["r1"] and plan.rotated_for == {"r1": "new"}
    assert plan.admitted == ["new"] and s.requests["r1"] not in plan.chunks
    assert len(s.bm.fenced) == 1          # r1's dirty block waits for its copy to land


@pytest.mark.parametrize("policy", ["rotasched-lvf", "rotasched"])
def test_a_seat_is_rotated_for_only_by_the_default(policy):
    """With every seat taken (3 of 3), a short prompt whose KV fits in the 4 free blocks waits
    for a seat only: the default rotates for it, LVF only for KV room; a 20-token prompt
    (5 blocks) needs KV room and is rotated for either way."""
    for prompt, rotates in ((4, policy == "rotasched"), (20, True)):
        s = rotation_setup(policy, prompt=prompt)
        s.cfg.max_num_seqs = 3
        plan = s.schedule(0.3)
        assert (plan.rotated_out == ["r1"]) is rotates and bool(plan.admitted) is rotates
        assert len(s.running) == 3


@pytest.mark.parametrize("policy,arrival,first", [
    ("rotasched-lvf", -5.0, "new"), ("rotasched", -5.0, "fresh"), ("rotasched", -9.0, "new")])
def test_the_default_serves_requests_that_can_still_meet_their_ttft_slo_first(
        policy, arrival, first, no_stall_budget):
    """"new" is past its 1 s TTFT SLO; "fresh", as long, arrived 0.1 s ago. Room for one (r1
    rotated out): LVF takes the largest lag, the default the one that can still make it,
    unless the late one has waited PATIENCE (8) TTFT SLOs."""
    s = rotation_setup(policy, arrival=arrival)
    s.add(Request("fresh", 20, 4, 0.2))
    plan = s.schedule(0.3)
    assert plan.admitted == [first] and plan.rotated_for == {"r1": first}


def test_backfill_lets_a_short_request_pass_a_head_that_cannot_start():
    """B_xfer is 1 block, so no 2-block decode may be rotated out and "new" (5 blocks, 4 free)
    cannot start. A prompt of at most 0.75 of the step's token budget that fits whole in free
    room may pass it (the default); LVF's queue is strict."""
    for policy, prompt, budget, started in (("rotasched-lvf", 12, 64, []),
                                            ("rotasched", 12, 64, ["short"]),
                                            ("rotasched", 16, 20, [])):   # 16 > 0.75 x 20
        s = rotation_setup(policy, xfer_budget=1, max_num_batched_tokens=budget)
        s.add(Request("short", prompt, 4, 0.1))
        plan = s.schedule(0.3)
        assert plan.admitted == started and not plan.rotated_out, (policy, prompt, plan)
    s = rotation_setup()                   # new can rotate r1 out: no pass
    s.add(Request("short", 4, 4, 0.1))
    plan = s.schedule(0.3)
    assert plan.admitted[0] == "new" and plan.rotated_for["r1"] == "new"


def test_a_passed_request_starts_only_whole_and_only_while_it_is_not_yet_due():
    """Behind a passed-over head: a first chunk that fits is not enough (the rest would need
    room that others wait for), and a request already due (waited beta_f x S_TTFT = 0.5 s
    here) does not pass: it may rotate others out once it is the head."""
    s = rotation_setup()
    mid, short = Request("mid", 20, 4, 0.1), Request("short", 8, 4, 0.1)
    s.add(mid)                             # 5 blocks whole, 4 free
    s.add(short)                           # 2 blocks whole
    assert not s.policy.may_pass(s, mid, 0.3)
    assert s.policy.may_pass(s, short, 0.3) and s.policy.may_pass(s, short, 0.59)
    assert not s.policy.may_pass(s, short, 0.61)
    s.rotary.append(s.requests["r0"])      # a rotated-out request returns in its own queue
    s.requests["r0"].status = Status.ROTARY
    assert not s.policy.may_pass(s, s.requests["r0"], 0.3)


def test_stall_budget_caps_long_gaps_per_token():
    """No rotation for a candidate once the stalls (rotated-out requests that came back after
    more than STALL TBT SLOs, and every one still out) reach STALLS of the tokens generated
    or owed: 6 + 3 x 14 = 48 here."""
    s = rotation_setup()                   # 0.0075 x 48 = 0.36 stalls allowed: one rotation
    assert s.policy.tokens(s) == 6 + 3 * 14
    assert s.schedule(0.3).rotated_out == ["r1"]
    s = rotation_setup()
    s.num_stalls = 1                       # one came back after a stall
    plan = s.schedule(0.3)
    assert not plan.rotated_out and not plan.admitted
    s = rotation_setup(prompt=24)          # 24 tokens need two victims; the budget has one
    assert not s.schedule(0.3).rotated_out
    r1 = s.requests["r1"]
    assert not s.policy.stalled(r1, r1.t_last_token + 0.4)  # out > 4 x 0.1 s is a stall
    assert s.policy.stalled(r1, r1.t_last_token + 0.41)


def test_stall_budget_counts_each_victim_of_one_candidate(monkeypatch):
    """A candidate that needs several victims takes no more than the stall budget has left:
    each rotation counts as it is made."""
    for stalls, prompt, out in ((0.03, 24, ["r1", "r0"]), (0.02, 24, []), (0.02, 20, ["r1"])):
        monkeypatch.setattr(RotaSched, "STALLS", stalls)   # x 48 tokens: 1.44 or 0.96
        s = rotation_setup(prompt=prompt)
        plan = s.schedule(0.3)             # a victim frees 1 block now, 24 tokens need two
        assert plan.rotated_out == out
        assert plan.admitted == (["new"] if out else [])


def test_the_stall_budget_counts_recent_history_only(monkeypatch):
    """The tokens and stalls the budget is a share of are halved together whenever the tokens
    reach sched.WINDOW, so a server's calm past does not pay for stalls now."""
    monkeypatch.setattr(sched, "WINDOW", 16, raising=False)
    monkeypatch.setattr(RotaSched, "STALLS", 0.2)
    s = rotation_setup()
    s.abort("new")
    s.num_generated, s.num_stalls = 1000, 40                      # a long, calm past
    for k in range(10):
        step_once(s, 0.1 + 0.01 * k)                              # 3 tokens a step
    assert s.num_generated < 16 and s.num_stalls == 0


def test_a_stall_is_counted_when_a_rotated_out_request_comes_back_late():
    s = rotation_setup()
    assert step_once(s, 0.6).rotated_out == ["r1"]
    s.abort("new")
    r1 = s.requests["r1"]
    step_once(s, r1.t_last_token + 0.3)                     # back within 4 TBT SLOs
    assert s.num_stalls == 0 and r1.status is Status.RUNNING
    s = rotation_setup()
    assert step_once(s, 0.6).rotated_out == ["r1"]
    s.abort("new")
    step_once(s, s.requests["r1"].t_last_token + 0.5)       # back after 5
    assert s.num_stalls == 1


@pytest.mark.parametrize("policy", ["rotasched-lvf", "rotasched"])
def test_reactive_preemption_victim(policy):
    """A running request that needs a block preempts the longest-running decode (LVF: the tail
    of its order) or the last admitted (the default, as vLLM)."""
    s = make_sched(policy, dev=6, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64,
                   ttft_slo=1.0, tbt_slo=0.1)
    for i in range(3):
        s.add(Request(f"r{i}", 7, 16, 0.0))       # 2 blocks each: the pool is full
    step_once(s, 0.0)
    step_once(s, 0.05)                            # every one needs its third block now
    s.requests["r1"].t_admitted = -5.0            # r1 has run longest
    plan = step_once(s, 0.1)
    assert plan.rotated_out == (["r2"] if policy == "rotasched" else ["r1"])
    assert not plan.proactive


def test_rotation_is_all_or_nothing():
    """Victims that cannot make room for the candidate are not rotated out at all."""
    s = rotation_setup("rotasched-lvf", prompt=30)  # 8 blocks: 4 free + 1 clean a victim = 7
    plan = s.schedule(0.9)
    assert not plan.rotated_out and not plan.admitted and s.bm.num_free == 4


def test_rotation_respects_host_room_and_transfer_budget():
    s = rotation_setup(xfer_budget=1)      # a 2-block victim could not come back in one step
    assert not s.schedule(0.9).rotated_out
    s = rotation_setup()
    s.bm.host.allocate("someone", s.bm.host.num_free)  # no host room left for a victim
    assert not s.schedule(0.9).rotated_out


def test_a_request_is_rotated_out_at_most_once_by_the_default(no_stall_budget):
    s = rotation_setup()
    s.requests["r1"].rotations = 1             # r1 has had its one rotation: r0 goes instead
    plan = s.schedule(0.9)
    assert plan.rotated_out and "r1" not in plan.rotated_out
    s = rotation_setup()
    for r in s.running:
        r.rotations = 1
    assert not s.schedule(0.9).rotated_out     # nobody may go: the new request waits
    s = rotation_setup("rotasched-lvf")        # LVF: no limit
    s.requests["r1"].rotations = 9
    assert s.schedule(0.9).rotated_out == ["r1"]


@pytest.mark.parametrize("policy", ["rotasched-lvf", "rotasched"])
def test_a_parked_request_comes_back_by_rotation_or_into_free_room(policy):
    """LVF: a rotated-out request ranks with the new ones by lag and may rotate running ones
    out like them; the default: it comes back into free room only."""
    s = rotation_setup(policy)
    assert step_once(s, 0.6).rotated_out == ["r1"]         # for "new"
    r1 = s.requests["r1"]
    assert s.policy.may_rotate_for(s, r1, 0.7) == (policy == "rotasched-lvf")
    s.abort("new")                                          # room again: r1 simply comes back
    plan = step_once(s, 0.7)
    assert plan.rotated_in == ["r1"] and not plan.rotated_out


def test_the_default_returns_rotated_out_requests_oldest_first_ahead_of_new_ones():
    """The oldest rotary request comes back first although the younger has been out longer
    (lag order, LVF's, would be round robin); while it does not fit it holds the younger one
    back, and a new request that fits is admitted from its own queue."""
    s = make_sched("rotasched", dev=10, host=64, bs=4, max_num_seqs=8,
                   max_num_batched_tokens=64, ttft_slo=1.0, tbt_slo=0.1)
    old, young = Request("old", 34, 4, 0.0), Request("young", 2, 4, 1.0)
    new = Request("new", 2, 4, 2.0)
    for r in (old, young, new):
        s.add(r)
    s.waiting.clear()
    for r, out_since in ((old, 2.5), (young, 1.5)):
        r.status, r.t_last_token, r.num_computed = Status.ROTARY, out_since, r.num_prompt
        s.bm.append(r.rid, r.num_prompt)
        s.bm.swap_out(r.rid)
        s.rotary.append(r)
    s.waiting.append(new)
    lvf = make_policy("rotasched-lvf", 1.0, 0.1)
    assert lvf.queues(s, StepPlan(0, 3.0), 3.0)[0][0].rid == "young"
    assert [[r.rid for r in q] for q in s.policy.queues(s, StepPlan(0, 3.0), 3.0)] == [
        ["old", "young"], ["new"]]
    assert not s.policy.may_pass(s, young, 3.0) and not s.policy.may_rotate_for(s, old, 3.0)


@pytest.mark.parametrize("overlap", [False, True])
def test_rotary_request_comes_back(overlap):
    """It computes in the step it is swapped back in; with swap_in_overlap, one step later."""
    s = rotation_setup(swap_in_overlap=overlap)
    assert step_once(s, 0.6).rotated_out == ["r1"]
    s.requests["new"].max_tokens = 1            # leaves after its first token
    for t in (0.7, 0.8, 0.9, 1.0, 1.1):
        plan = step_once(s, t)
        if "r1" in plan.rotated_in:
            break
    assert "r1" in plan.rotated_in
    assert (s.requests["r1"] in plan.chunks) is not overlap
    assert s.requests["r1"] in step_once(s, 1.2).chunks


# ---------------------------------------------------------------- vLLM v1 baselines
# Scenarios after vLLM's tests/v1/core/test_scheduler.py (priority order, preemption victim,
# resumption, token budget, chunked prefill), in this scheduler's terms.

def test_priority_admission_order():
    s = make_sched("priority", dev=64, bs=16, max_num_seqs=8, max_num_batched_tokens=512)
    for i, (prio, arrival) in enumerate(zip([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0])):
        s.add(Request(str(i), 10, 4, arrival, priority=prio))
    assert s.schedule(5.0).admitted == ["3", "2", "1", "0"]


def test_fcfs_token_budget_and_chunked_prefill():
    s = make_sched("fcfs", dev=256, bs=16, max_num_seqs=8, max_num_batched_tokens=1000)
    for i in range(3):
        s.add(Request(str(i), 800, 4, float(i)))
    plan = s.schedule(3.0)
    assert {r.rid: n for r, n in plan.chunks.items()} == {"0": 800, "1": 200}
    s.update(plan, {"0": 7}, 3.1)
    plan = s.schedule(3.2)   # the decode first, then the rest of "1", then "2"'s first chunk
    assert {r.rid: n for r, n in plan.chunks.items()} == {"0": 1, "1": 600, "2": 399}


def preemption_setup(policy):
    """Three requests of 16 prompt tokens admitted in one step fill 12 of 13 blocks; each decode
    then needs a fifth block."""
    s = make_sched(policy, dev=13, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        s.add(Request(f"r{i}", 16, 8, float(i)))
    assert step_once(s, 2.0).admitted == ["r0", "r1", "r2"]
    return s


def test_fcfs_preempts_the_last_admitted_and_admits_nobody():
    s = preemption_setup("fcfs")
    s.add(Request("late", 2, 2, 3.0))
    plan = s.schedule(3.5)    # r0 takes the free block; r1 needs one: r2 goes
    assert plan.preempted == ["r2"] and not plan.admitted
    assert {r.rid for r in plan.chunks} == {"r0", "r1"}
    s.update(plan, {"r0": 1, "r1": 1}, 3.6)
    assert [r.rid for r in sorted(s.waiting, key=lambda r: s.policy.rank(r, 4.0))] == ["r2", "late"]


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    """lo (priority 2) was admitted first and is scheduled first; hi (priority 0) then needs a
    block: lo is taken back out of the step and preempted; hi runs."""
    s = make_sched("priority", dev=9, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64)
    s.add(Request("lo", 16, 8, 0.0, priority=2))
    step_once(s, 0.0)
    s.add(Request("hi", 16, 8, 1.0, priority=0))
    step_once(s, 1.0)                          # lo decodes (5th block), hi prefills: pool full
    plan = s.schedule(2.0)
    assert plan.preempted == ["lo"] and list(plan.chunks) == [s.requests["hi"]]
    assert s.requests["lo"].status is Status.WAITING and s.bm.num_free == 4


def test_preempted_request_resumes_before_later_arrivals():
    """After a recompute-preemption the request is admitted again ahead of a later arrival, and
    the plan says it resumed rather than arrived."""
    s = preemption_setup("fcfs")
    step_once(s, 3.5)                          # r2 preempted
    s.add(Request("late", 2, 2, 3.7))
    for rid in ("r0", "r1"):
        s.abort(rid)
    plan = s.schedule(4.0)
    assert plan.resumed == ["r2"] and plan.admitted == ["late"]


def test_fcfs_swap_resumes_swapped_before_new_prefills():
    s = preemption_setup("fcfs-swap")
    plan = step_once(s, 3.5)
    assert plan.rotated_out == ["r2"] and not plan.rotated_in
    s.add(Request("late", 2, 2, 3.7))
    for rid in ("r0", "r1"):
        s.abort(rid)
    plan = s.schedule(4.0)
    assert plan.rotated_in == ["r2"] and plan.admitted == ["late"]
    assert [r.rid for r in plan.chunks] == ["r2", "late"]   # v0: same step, compute waits


# ---------------------------------------------------------------- the released scheduler

def test_released_swaps_longest_running_decodes_under_the_watermark(monkeypatch):
    monkeypatch.setattr(RotaSchedReleased, "prealloc_tokens", 0)  # exact counts, no spares
    s = preemption_setup("rotasched-released")
    s.cfg.xfer_budget = 8                       # watermark: act below 8 free blocks
    s.requests["r1"].t_admitted = 1.0           # r1 has run longest, then r0 and r2
    s.add(Request("late", 20, 2, 3.0))          # not everyone fits
    plan = s.schedule(3.5)
    # r1 holds 4 blocks (4 < 8); r0 would make 8, not under the watermark
    assert plan.proactive == ["r1"] and plan.rotated_out == ["r1"] and not plan.rotated_for


def test_released_fifo_by_time_in_queue_and_host_hold():
    p = make_policy("rotasched-released")
    a, b = Request("a", 4, 4, 0.0, t_queued=5.0), Request("b", 4, 4, 1.0, t_queued=2.0)
    assert sorted([a, b], key=lambda r: p.rank(r, 6.0)) == [b, a]
    s = make_sched("rotasched-released", dev=8, host=10, bs=4)
    s.bm.host.allocate("someone", 10)
    s.add(Request("new", 4, 2, 0.0))
    assert not s.schedule(0.0).chunks          # host above 90%: new requests wait
    s.bm.host.release("someone", list(range(10)))
    assert s.schedule(0.1).admitted == ["new"]


# ---------------------------------------------------------------- API, log, errors

@pytest.mark.parametrize("policy", ["fcfs", "priority", "fcfs-swap", "rotasched", "rotasched-lvf",
                                    "rotasched-released"])
def test_schedule_log_replays_exactly_and_diff_finds_the_first_difference(tmp_path, policy):
    path = tmp_path / "run.jsonl"
    s = make_sched(policy, dev=128, host=2048, bs=4, max_num_seqs=16, max_num_batched_tokens=64,
                   ttft_slo=3.0, tbt_slo=0.05, swap_watermark=16, log_path=str(path))
    simulate(s, hol_workload(), lambda plan: 0.02)
    s.close()
    steps, why = schedlog.replay(str(path))
    assert why is None and steps == s.num_steps
    lines = path.read_text().splitlines()
    i = next(k for k, line in enumerate(lines) if '"step": 40,' in line)
    rec = json.loads(lines[i])
    rec["tokens"]["long0"] = 99                       # tamper with one decision
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("\n".join(lines[:i] + [json.dumps(rec)] + lines[i + 1:]) + "\n")
    steps, why = schedlog.replay(str(tampered))
    assert steps == 40 and "step 40" in why and "request long0" in why
    step, why = schedlog.diff(str(path), str(tampered))
    assert step == 40 and "request long0 computes" in why and "vs 99 tokens" in why


def test_schedule_log_speed_sees_a_slower_machine_not_another_schedule(tmp_path):
    """schedlog.speed: runs of different policies on one machine score alike, whatever work each
    chose; a run on a machine 10% slower scores about 10% above the other."""
    def run(policy, slow):
        path = tmp_path / f"{policy}.{slow}.jsonl"
        s = make_sched(policy, dev=128, host=2048, bs=4, max_num_seqs=16,
                       max_num_batched_tokens=64, ttft_slo=3.0, tbt_slo=0.05, log_path=str(path))
        ctx = {}

        def step_time(plan):   # linear in the work, as the fit assumes: fixed, tokens, KV, copies
            for r, n in plan.chunks.items():
                ctx[r.rid] = r.num_computed + n
            kv = sum(ctx[r.rid] for r in plan.chunks)
            return slow * (0.004 + 2e-4 * plan.num_tokens + 1e-5 * kv + 5e-4 * plan.blocks_moved)
        simulate(s, hol_workload(), step_time)
        s.close()
        return schedlog.read(str(path))
    fcfs, rota = run("fcfs", 1.0), run("rotasched", 1.0)
    assert sum(w[1][5] for w in schedlog.step_work(rota)) > 0   # rotasched copied blocks
    even = schedlog.speed({"fcfs": fcfs, "rotasched": rota})
    assert even == pytest.approx({"fcfs": 1.0, "rotasched": 1.0}, abs=1e-6)
    uneven = schedlog.speed({"fcfs": fcfs, "rotasched": run("rotasched", 1.1)})
    assert 1.08 < uneven["rotasched"] / uneven["fcfs"] < 1.12
    assert schedlog.speed({"fcfs": fcfs}) == {}   # one run: nothing to compare


def test_schedule_log_is_deterministic(tmp_path):
    logs = []
    for k in range(2):
        path = tmp_path / f"log{k}.jsonl"
        s = make_sched("rotasched", dev=128, host=2048, bs=4, max_num_seqs=16,
                       max_num_batched_tokens=64, ttft_slo=3.0, tbt_slo=0.05, log_path=str(path))
        simulate(s, hol_workload(), lambda plan: 0.02)
        s.close()
        logs.append(path.read_text())
    assert logs[0] == logs[1]
    records = [json.loads(line) for line in logs[0].splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert any(r["rotated_out"] for r in steps) and all("tokens" in r for r in steps)


def test_oversized_request_rejected_others_continue():
    s = make_sched("rotasched", dev=8, host=8, bs=4)
    reqs = [Request("ok1", 4, 4, 0.0), Request("huge", 40, 4, 0.0), Request("ok2", 4, 4, 0.0)]
    done, rejected = simulate(s, reqs, lambda plan: 0.01)
    assert sorted(r.rid for r in done) == ["ok1", "ok2"]
    assert rejected[0][0].rid == "huge" and "more than the whole device pool" in rejected[0][1]


def test_full_host_holds_new_requests_back():
    s = make_sched("rotasched", dev=8, host=10, bs=4)
    s.bm.host.allocate("someone", 10)  # host pool full
    s.add(Request("new", 4, 2, 0.0))
    plan = s.schedule(0.0)
    assert not plan.chunks and s.requests["new"].status is Status.WAITING
    s.bm.host.release("someone", list(range(10)))
    assert s.schedule(0.1).admitted == ["new"]


def test_abort_frees_both_tiers():
    s = rotation_setup()
    plan = step_once(s, 0.6)
    assert plan.rotated_out
    for rid in list(s.requests):
        s.abort(rid)
    assert s.requests[plan.rotated_out[0]].status is Status.ABORTED and not s.has_unfinished()
    s.bm.copies_done()
    assert s.bm.num_free == 10 and s.bm.host.num_free == 64


def test_invalid_policy_params():
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        make_policy("rotasched:alpha=-1")
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        make_policy("rotasched:alpha=nan")
    with pytest.raises(ValueError, match="cannot read 'rotations=2'"):
        make_policy("rotasched:rotations=2")    # only the paper's parameters are settable
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="fcfs takes nothing"):
        make_policy("fcfs:alpha=2")


def test_duplicate_and_empty_requests():
    s = make_sched("fcfs")
    s.add(Request("a", 4, 4, 0.0))
    with pytest.raises(ValueError, match="already in use"):
        s.add(Request("a", 4, 4, 0.0))
    with pytest.raises(ValueError, match="non-empty prompt"):
        s.add(Request("b", 0, 4, 0.0))


def test_policy_spec_parameters():
    p = make_policy("rotasched-lvf:alpha=1,beta_f=0.25,beta_b=2", ttft_slo=2.0, tbt_slo=0.2)
    assert (p.alpha, p.beta_f, p.beta_b, p.ttft_slo, p.tbt_slo) == (1.0, 0.25, 2.0, 2.0, 0.2)
    assert type(make_policy("rotasched:alpha=1")) is RotaSched
    with pytest.raises(ValueError, match="cannot read 'gamma=1'"):
        make_policy("rotasched:gamma=1")
    with pytest.raises(ValueError, match="rotasched-released takes nothing"):
        make_policy("rotasched-released:alpha=1")


# ---------------------------------------------------------------- doing no harm

HW = Hardware("cpu-like", 150e9, 28e9, 4e9, 8e9, 14e9, 14e9, 2e-6, 4e-3, mfu=0.5, mbu=0.6,
              gemm_half=16)


def simulated(policy, lengths, rate, n, dev, ttft_slo, tbt_slo):
    rng = random.Random(0)
    t, reqs = 0.0, []
    for i in range(n):
        reqs.append(Request(f"r{i}", *rng.choice(lengths), t))
        t += rng.expovariate(rate)
    cost = CostModel(MODELS["smollm2-135m"], HW, 16, device_blocks=dev, host_blocks=4096)
    cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=256, ttft_slo=ttft_slo,
                       tbt_slo=tbt_slo)
    return run_policy(policy, reqs, cost, cfg)


@pytest.mark.parametrize("name,lengths,rate,dev,slos,gain", [
    ("calm", [(60, 30), (100, 40)], 0.5, 200, (1.5, 0.24), 0.0),
    ("prefill-heavy", [(300, 3), (350, 4), (250, 2), (200, 6)], 0.45, 48, (2.0, 0.214), 0.0),
    ("prefill-heavy, busier", [(300, 3), (350, 4), (250, 2), (200, 6)], 0.6, 48, (2.0, 0.214), 0.0),
    ("kv-bound", [(94, 35), (40, 80), (200, 20)], 0.75, 48, (1.7, 0.24), 0.15)])
def test_rotasched_does_no_harm(name, lengths, rate, dev, slos, gain):
    """Against fcfs and fcfs-swap on the same arrivals (simulated on a CPU-like machine): the
    claim's do-no-harm rules (metrics.harms); where the pool binds, a real TTFT gain."""
    base = simulated("fcfs", lengths, rate, 60, dev, *slos)
    swap = simulated("fcfs-swap", lengths, rate, 60, dev, *slos)
    ours = simulated("rotasched", lengths, rate, 60, dev, *slos) | {"tbt_slo_s": slos[1]}
    assert harms(base, ours, swap) == [], name
    assert ours["ttft_attainment"] >= base["ttft_attainment"] + gain, name
