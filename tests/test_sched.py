"""scheduler.py on a simulated clock: invariants, transactions, liveness, each policy's rules."""
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import sched
from sched import POLICIES, Request, RotaSched, Scheduler, Status, StepPlan, make_policy
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
    if s.policy.xfer_cap == "all":
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
POLICY_SPECS = sorted(POLICIES) + ["rotasched:quantum=0.1", "rotasched:alpha_on=waiting",
                                   "rotasched:per-layer", "rotasched-released:per-layer",
                                   "rotasched:backfill=0", "rotasched:back=free",
                                   "rotasched:seats=0", "rotasched:order=lag",
                                   "rotasched:order=viable,patience=0",
                                   "rotasched:order=viable,patience=2"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICY_SPECS), reqs=workload, dev=st.integers(16, 48),
       host=st.integers(0, 80), bs=st.integers(1, 8), seqs=st.integers(1, 8),
       extra_tokens=st.integers(0, 64), xfer=st.integers(0, 40), step=st.floats(0.001, 0.2),
       overlap=st.booleans())
def test_invariants_and_liveness(policy, reqs, dev, host, bs, seqs, extra_tokens, xfer, step,
                                 overlap):
    s = make_sched(policy, dev, host, bs, max_num_seqs=seqs, max_num_batched_tokens=seqs + extra_tokens,
                   xfer_budget=xfer, ttft_slo=0.5, tbt_slo=0.05, swap_in_overlap=overlap)
    requests = [Request(f"r{i}", p, o, t, priority=pr) for i, (t, p, o, pr) in enumerate(reqs)]
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
    p = RotaSched(alpha=3, beta_f=0.5, beta_b=0, ttft_slo=5.0, tbt_slo=0.1)
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
    waiting_alpha = RotaSched(alpha=3, alpha_on="waiting", ttft_slo=5.0, tbt_slo=0.1)
    assert waiting_alpha.vlt(w, 14.0) == pytest.approx(10.5)  # alpha on the waiting lag
    assert waiting_alpha.vlt(rot, 20.5) == pytest.approx(0.5)


def test_lvf_ties_broken_by_arrival():
    p = RotaSched()
    a, b = Request("b", 4, 4, arrival=1.0), Request("a", 4, 4, arrival=2.0)
    assert [r.rid for r in sorted([b, a], key=lambda r: p.rank(r, 1.5))] == ["b", "a"]


def rotation_setup(policy="rotasched", arrival=0.0, prompt=20, **kw):
    """Three running decodes (7 tokens in the cache, first block written back) hold 6 of 10
    blocks; r1 has run longest. A new request of `prompt` tokens arrives; 20 need 5 blocks."""
    s = make_sched(policy, dev=10, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64,
                   ttft_slo=1.0, tbt_slo=0.1, **kw)
    for i in range(3):
        s.add(Request(f"r{i}", 6, 16, 0.0))
    step_once(s, 0.0)
    step_once(s, 0.05)
    s.requests["r1"].t_admitted = -5.0
    s.add(Request("new", prompt, 4, arrival))
    return s


def test_rotasched_rotates_the_longest_running_decode_for_a_new_request():
    s = rotation_setup(policy="rotasched:gate=due")  # "new" is due at 0.5 s (beta_f * S_TTFT)
    plan = s.schedule(0.3)
    assert not plan.rotated_out and not plan.admitted      # not due: no rotation for it
    s = rotation_setup()                   # gate=any (the default): it need not be due
    plan = s.schedule(0.3)                 # r1 frees its clean block: 4 + 1 = 5
    assert plan.rotated_out == ["r1"] and plan.rotated_for == {"r1": "new"}
    assert plan.admitted == ["new"] and s.requests["r1"] not in plan.chunks
    assert len(s.bm.fenced) == 1          # r1's dirty block waits for its copy to land


@pytest.mark.parametrize("seats", [0, 1])
def test_seats_0_rotates_only_for_kv_room(seats):
    """With every seat taken (3 of 3), a short prompt whose KV fits in the 4 free blocks is
    waiting for a seat only: seats=1 rotates for it, seats=0 does not; a 20-token prompt
    (5 blocks) needs KV room and is rotated for either way."""
    for prompt, rotates in ((4, bool(seats)), (20, True)):
        s = rotation_setup(policy=f"rotasched:seats={seats}", prompt=prompt)
        s.cfg.max_num_seqs = 3
        plan = s.schedule(0.3)
        assert (plan.rotated_out == ["r1"]) is rotates and bool(plan.admitted) is rotates
        assert len(s.running) == 3


@pytest.mark.parametrize("order,first", [("order=lag", "new"), ("order=viable,patience=0", "fresh"),
                                         ("order=viable,patience=10", "fresh"),
                                         ("order=viable,patience=4", "new"),
                                         ("", "fresh")])  # the default: viable, patience 8
def test_order_viable_serves_requests_that_can_still_meet_their_ttft_slo_first(order, first):
    """"new" arrived 5.3 s ago (past its 1 s TTFT SLO); "fresh", as long, 0.1 s ago. Room for one
    (r1 rotated out): the paper's LVF takes the largest lag, order=viable the one that can still
    make it, unless the late one has waited `patience` TTFT SLOs."""
    s = rotation_setup(policy=f"rotasched:stalls=0,{order}", arrival=-5.0)
    s.add(Request("fresh", 20, 4, 0.2))
    plan = s.schedule(0.3)
    assert plan.admitted == [first] and plan.rotated_for == {"r1": first}


def test_order_sjf_starts_the_shortest_prompt_first():
    """"new" (24 tokens, 6 blocks) waits longer than "short" (12, 3 blocks; 4 are free): by lag
    "new" starts first and rotates two decodes out for it; order=sjf starts "short" in the free
    room and rotates no one."""
    for spec, first, out in (("rotasched:stalls=0", "new", ["r1", "r0"]),
                             ("rotasched:stalls=0,order=sjf", "short", [])):
        s = rotation_setup(policy=spec, prompt=24)
        s.add(Request("short", 12, 4, 0.2))
        plan = s.schedule(0.3)
        assert plan.admitted == [first] and plan.rotated_out == out, (spec, plan)


def test_backfill_lets_a_short_request_pass_a_head_that_cannot_start():
    """quantum=100: nobody may be rotated out, so "new" (5 blocks, 4 free) cannot start. The
    step's budget is 64 tokens: a passed prompt of 12 may start with backfill >= 12 / 64."""
    for spec, started in (("rotasched:quantum=100,backfill=0", []),
                          ("rotasched:quantum=100,backfill=0.125", []),  # at most 8 tokens
                          ("rotasched:quantum=100,backfill=0.1875", ["short"]),  # 12
                          ("rotasched:quantum=100", ["short"])):   # the default, 0.75: 48
        s = rotation_setup(policy=spec)
        s.add(Request("short", 12, 4, 0.1))
        plan = s.schedule(0.3)
        assert plan.admitted == started and not plan.rotated_out, (spec, plan)
    s = rotation_setup(policy="rotasched:stalls=0")  # new can rotate r1 out: no pass
    s.add(Request("short", 4, 4, 0.1))
    plan = s.schedule(0.3)
    assert plan.admitted[0] == "new" and plan.rotated_for["r1"] == "new"
    # "new" is past its TTFT SLO, so gate=viable rotates no one out for it; "mid" could rotate
    # r1 out, but behind a passed-over head only free room may be used: "short" fits in it
    # (order=lag keeps the late "new" at the head; order=viable would put "mid" first)
    for spec, started in (("rotasched:gate=viable,stalls=0,backfill=0,order=lag", []),
                          ("rotasched:gate=viable,stalls=0,order=lag", ["short"])):
        s = rotation_setup(policy=spec, arrival=-5.0)
        s.add(Request("mid", 20, 4, 0.1))
        s.add(Request("short", 4, 4, 0.2))
        plan = s.schedule(0.3)
        assert plan.admitted == started and not plan.rotated_out, (spec, plan)


def test_finish_holds_a_rotation_while_a_running_prompt_finishes():
    """Three seats: two decodes and "long", whose 24-token prompt takes two steps of a 16-token
    budget. "new" needs a seat, which a rotation could give it in the step that computes the
    rest of long's prompt; finish=1 waits until that first token is out, and so does finish=2
    while long can still meet its TTFT SLO (not with an SLO of 0.05 s, already missed)."""
    for spec, slo, first in (("rotasched", None, 0.15), ("rotasched:finish=1", None, 0.2),
                             ("rotasched:finish=2", None, 0.2),
                             ("rotasched:finish=2", 0.05, 0.15)):
        s = make_sched(spec, dev=32, max_num_seqs=3, max_num_batched_tokens=16, ttft_slo=1.0,
                       tbt_slo=0.1)
        for i in range(2):
            s.add(Request(f"r{i}", 6, 16, 0.0))
        step_once(s, 0.0)
        step_once(s, 0.05)
        s.add(Request("long", 24, 4, 0.06, ttft_slo=slo))
        assert step_once(s, 0.1).chunks[s.requests["long"]] == 14
        s.add(Request("new", 4, 4, 0.12))
        for now in (0.15, 0.2):
            plan = step_once(s, now)
            assert (plan.admitted == ["new"]) == (now == first), (spec, now, plan)
            assert bool(plan.rotated_out) == (now == first)
            if now == 0.15:  # the rest of long's prompt, either way
                assert plan.chunks[s.requests["long"]] == 10


def test_a_passed_request_starts_only_whole_and_only_while_it_is_not_yet_due():
    """Behind a passed-over head: a first chunk that fits is not enough (the rest would need
    room that others wait for), and a request already due (waited beta_f x S_TTFT = 0.5 s
    here) does not pass: it may rotate others out once it is the head."""
    s = rotation_setup()
    s._budget = 5                        # 5 tokens left this step: 2 blocks of the 4 free
    s.add(Request("mid", 20, 4, 0.1))    # 5 blocks whole
    s.add(Request("short", 8, 4, 0.1))   # 2 blocks whole
    plan, (mid, short) = StepPlan(s.bm.epoch, 0.3), (s.requests["mid"], s.requests["short"])
    assert s._victims_for(plan, mid, 0.3) == [] and s._victims_for(plan, short, 0.3) == []
    assert s._victims_for(plan, mid, 0.3, passed=True) is None
    assert s._victims_for(plan, short, 0.3, passed=True) == []
    assert s._victims_for(plan, short, 0.59, passed=True) == []
    assert s._victims_for(plan, short, 0.61, passed=True) is None
    # the due limit is for new requests: a rotated-out one (back=free ranks it with them) whose
    # lag is never negative may still come back behind a passed-over head, if it fits whole
    s = rotation_setup(policy="rotasched:back=free")
    assert step_once(s, 0.6).rotated_out == ["r1"]
    s.abort("new")
    r1 = s.requests["r1"]
    assert s.policy.lag(r1, 0.7) > 0
    assert s._victims_for(StepPlan(s.bm.epoch, 0.7), r1, 0.7, passed=True) == []


def test_gate_viable_rotates_only_for_a_request_that_can_still_meet_its_ttft_slo():
    """S_TTFT is 1 s here: at 0.9 s "new" can still make it, at 1.2 s it cannot."""
    assert rotation_setup(policy="rotasched:gate=viable").schedule(0.9).rotated_out == ["r1"]
    plan = rotation_setup(policy="rotasched:gate=viable").schedule(1.2)
    assert not plan.rotated_out and not plan.admitted
    assert rotation_setup().schedule(1.2).rotated_out == ["r1"]     # gate=any still does


def test_rotation_budget_caps_rotations_per_generated_token():
    s = rotation_setup(policy="rotasched:budget=0.1")   # 6 tokens so far: 0.6 rotations
    assert s.num_generated == 6 and s.schedule(0.3).rotated_out == ["r1"]
    s = rotation_setup(policy="rotasched:budget=0.1")
    s.num_rotated = 1                                   # the budget is spent
    plan = s.schedule(0.3)
    assert not plan.rotated_out and not plan.admitted


def test_stall_budget_caps_long_gaps_per_generated_token():
    """stalls: no rotation for a candidate once rotated-out requests that were, or are, out
    longer than `stall` TBT SLOs reach that share of the tokens so far (of=generated: 6 here)."""
    s = rotation_setup(policy="rotasched:stalls=0.2,of=generated")  # 1.2 stalls allowed
    assert s.schedule(0.3).rotated_out == ["r1"]
    s = rotation_setup(policy="rotasched:stalls=0.2,of=generated")
    s.num_stalls = 2                                        # two came back after a stall
    plan = s.schedule(0.3)
    assert not plan.rotated_out and not plan.admitted
    s = rotation_setup(policy="rotasched:stalls=0.2,stall=4,of=generated,out=stalled")
    s.num_stalls = 1
    assert step_once(s, 0.3).rotated_out == ["r1"]          # 1 + r1 out now: 2 >= 1.2 ...
    r1 = s.requests["r1"]
    assert not s.policy.stalled(r1, r1.t_last_token + 0.4)  # ... once r1 is out > 4 x 0.1 s
    assert s.policy.stalled(r1, r1.t_last_token + 0.41)
    assert s.policy.victims(s, None, r1.t_last_token + 0.3)  # 1 stall + r1 not yet: 1 < 1.2
    assert s.policy.victims(s, None, r1.t_last_token + 0.5) == []   # 1 + r1 stalled: 2
    s.policy.out = "all"                                     # out=all (the default): r1 counts
    assert s.policy.victims(s, None, r1.t_last_token + 0.3) == []   # from the moment it left
    s.num_stalls = 0
    assert s.policy.victims(s, None, r1.t_last_token + 0.3)  # 0 + r1: 1 < 1.2
    s = rotation_setup(policy="rotasched:stalls=0")          # 0 = no limit
    s.num_stalls = 99
    assert s.schedule(0.3).rotated_out == ["r1"]


def test_stall_budget_counts_each_victim_of_one_candidate():
    """A candidate that needs several victims takes no more than the stall budget has left:
    each rotation counts as it is made (a burst's long prompt once rotated five decodes out
    for itself while the budget had room for two)."""
    for stalls, prompt, out in ((0.2, 24, ["r1", "r0"]), (0.1, 24, []), (0.1, 20, ["r1"])):
        s = rotation_setup(policy=f"rotasched:stalls={stalls},of=generated", prompt=prompt)
        plan = s.schedule(0.3)              # 6 tokens: 1.2 or 0.6 stalls allowed; a victim
        assert plan.rotated_out == out      # frees 1 block now, 24 tokens need two victims
        assert plan.admitted == (["new"] if out else [])


def test_stall_budget_of_admitted_counts_the_tokens_still_owed():
    """of=admitted (the default): the share is of the tokens generated (6) plus those the
    running and rotated-out requests still owe (3 x 14), not of those still waiting."""
    s = rotation_setup(policy="rotasched:stalls=0.2")       # 0.2 x 48 = 9.6 stalls allowed
    assert s.policy.tokens(s) == 6 + 3 * 14
    s.num_stalls = 9
    assert s.schedule(0.3).rotated_out == ["r1"]
    s = rotation_setup(policy="rotasched:stalls=0.2")
    s.num_stalls = 10
    assert not s.schedule(0.3).rotated_out


def test_the_budgets_count_recent_history_only(monkeypatch):
    """The tokens, rotations and stalls the budgets are shares of are halved together whenever
    the tokens reach sched.WINDOW, so a server's calm past does not pay for stalls now."""
    monkeypatch.setattr(sched, "WINDOW", 16, raising=False)
    s = rotation_setup(policy="rotasched:stalls=0.2,of=generated")
    s.abort("new")
    s.num_generated, s.num_rotated, s.num_stalls = 1000, 40, 2   # a long, calm past
    for k in range(10):
        step_once(s, 0.1 + 0.01 * k)                              # 3 tokens a step
    assert s.num_generated < 16 and s.num_rotated == s.num_stalls == 0
    s.num_stalls = 3                                              # three stalls just now
    s.add(Request("new2", 20, 4, 0.2))
    assert not s.schedule(0.3).rotated_out                        # 3 >= 0.2 x (< 16)
    monkeypatch.setattr(sched, "WINDOW", 10**9, raising=False)  # the whole past counted:
    s = rotation_setup(policy="rotasched:stalls=0.2,of=generated")
    s.num_generated, s.num_stalls = 1000, 5                       # 5 < 0.2 x 1000
    assert s.schedule(0.3).rotated_out == ["r1"]


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


@pytest.mark.parametrize("pick", ["lag", "last"])
def test_reactive_preemption_victim(pick):
    """A running request that needs a block preempts the last admitted (pick=last, vLLM's) or
    the longest-running decode (pick=lag, the tail of the VLT order)."""
    s = make_sched(f"rotasched:pick={pick}", dev=6, host=64, bs=4, max_num_seqs=8,
                   max_num_batched_tokens=64, ttft_slo=1.0, tbt_slo=0.1)
    for i in range(3):
        s.add(Request(f"r{i}", 7, 16, 0.0))       # 2 blocks each: the pool is full
    step_once(s, 0.0)
    step_once(s, 0.05)                            # every one needs its third block now
    s.requests["r1"].t_admitted = -5.0            # r1 has run longest
    plan = step_once(s, 0.1)
    assert plan.rotated_out == (["r2"] if pick == "last" else ["r1"]) and not plan.proactive


def test_rotation_is_all_or_nothing():
    """Victims that cannot make room for the candidate are not rotated out at all."""
    s = rotation_setup(prompt=30)          # 8 blocks: 4 free + 1 clean block per victim = 7
    plan = s.schedule(0.9)
    assert not plan.rotated_out and not plan.admitted and s.bm.num_free == 4


def test_rotation_respects_host_room_and_transfer_budget():
    s = rotation_setup(xfer_budget=1)      # a 2-block victim could not come back in one step
    assert not s.schedule(0.9).rotated_out
    s = rotation_setup()
    s.bm.host.allocate("someone", s.bm.host.num_free)  # no host room left for a victim
    assert not s.schedule(0.9).rotated_out


def test_a_request_is_rotated_out_at_most_rotations_times():
    s = rotation_setup(policy="rotasched:rotations=1")
    s.requests["r1"].rotations = 1             # r1 has had its one rotation: r0 goes instead
    plan = s.schedule(0.9)
    assert plan.rotated_out and "r1" not in plan.rotated_out
    s = rotation_setup(policy="rotasched:rotations=1")
    for r in s.running:
        r.rotations = 1
    assert not s.schedule(0.9).rotated_out     # nobody may go: the new request waits
    s = rotation_setup(policy="rotasched:rotations=0")  # 0 = no limit
    s.requests["r1"].rotations = 9
    assert s.schedule(0.9).rotated_out == ["r1"]


@pytest.mark.parametrize("back", ["fifo", "free", "rotate"])
def test_a_parked_request_comes_back_into_free_room_or_by_rotation(back):
    """back=fifo/free: a rotary request never displaces anyone (free: nor holds the queue
    behind it; fifo: it holds only the rotary queue, tested below); back=rotate: it may
    displace running requests, and a candidate that cannot start holds the rest back (strict
    LVF order; a new request holds back no one with backfill, the default)."""
    s = rotation_setup(policy=f"rotasched:back={back}")
    assert step_once(s, 0.6).rotated_out == ["r1"]         # for "new"
    r1, p = s.requests["r1"], s.policy
    assert p.may_rotate_for(s, r1, 0.7) == (back == "rotate")
    assert p.strict(r1) == (back != "free") and p.strict(s.requests["new"]) == (not p.backfill)
    s.abort("new")                                          # room again: r1 simply comes back
    plan = step_once(s, 0.7)
    assert plan.rotated_in == ["r1"] and not plan.rotated_out


def test_back_fifo_returns_rotated_out_requests_oldest_first_ahead_of_new_ones():
    """The oldest rotary request comes back first although the younger has been out longer
    (lag order would be round robin); while it does not fit it holds the younger one back,
    and a new request that fits is admitted from its own queue."""
    s = make_sched("rotasched", dev=10, host=64, bs=4, max_num_seqs=8,
                   max_num_batched_tokens=64, ttft_slo=1.0, tbt_slo=0.1)
    old, young = Request("old", 34, 4, 0.0), Request("young", 2, 4, 1.0)
    new = Request("new", 2, 4, 2.0)
    for r in (old, young, new):
        s.add(r)
    s.waiting.clear()
    for r, out_since in ((old, 2.5), (young, 1.5)):
        r.status, r.t_last_token, r.num_computed = Status.ROTARY, out_since, r.num_prompt
        s.rotary.append(r)
    s.waiting.append(new)
    for back, first in (("fifo", "old"), ("free", "young")):
        s.policy = make_policy(f"rotasched:back={back}", 1.0, 0.1)
        queues = s.policy.queues(s, StepPlan(0, 3.0), 3.0)
        assert queues[0][0].rid == first
    s.policy = make_policy("rotasched", 1.0, 0.1)           # back=fifo, the default
    assert [[r.rid for r in q] for q in s.policy.queues(s, StepPlan(0, 3.0), 3.0)] == [
        ["old", "young"], ["new"]]
    assert s.policy.strict(old) and not s.policy.may_rotate_for(s, old, 3.0)


def test_time_slice_protects_recently_admitted_requests():
    s = rotation_setup(policy="rotasched:quantum=10")
    assert not s.schedule(0.9).rotated_out      # nobody has run 10 s
    s = rotation_setup(policy="rotasched:quantum=2")
    assert s.schedule(0.9).rotated_out == ["r1"]  # r1 has run 5.9 s


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

def test_released_swaps_longest_running_decodes_under_the_watermark():
    s = preemption_setup("rotasched-released:prealloc=0")  # exact block counts, no spares
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

@pytest.mark.parametrize("policy", ["fcfs", "priority", "fcfs-swap", "rotasched",
                                    "rotasched:quantum=0.1,alpha_on=waiting", "rotasched-released"])
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
    with pytest.raises(ValueError, match="alpha_on must be"):
        make_policy("rotasched:alpha_on=both")
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
    p = make_policy("rotasched:alpha=1,quantum=0.5,alpha_on=waiting")
    assert (p.alpha, p.quantum, p.duplex, p.alpha_on) == (1.0, 0.5, True, "waiting")
    assert make_policy("rotasched").quantum == 0.0          # the paper has no time slice
    assert make_policy("rotasched-released:per-layer").duplex is False
    with pytest.raises(ValueError, match="cannot read 'gamma=1'"):
        make_policy("rotasched:gamma=1")


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
