"""sched.py on a simulated clock: invariants, liveness, head-of-line blocking, VLT, victims, errors."""
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kv import BlockManager
from sched import POLICIES, Request, RotaSched, RotaSchedReleased, Scheduler, Status, make_policy
from sim import simulate


def make_sched(policy, dev=64, host=256, bs=4, **kw):
    p = make_policy(policy) if isinstance(policy, str) else policy
    bm = BlockManager(dev, host, bs, duplex=p.duplex)
    return Scheduler(bm, p, **kw)


def check_step(s: Scheduler, plan):
    s.bm.check()
    assert plan.num_tokens <= s.max_num_batched_tokens
    assert len(plan.chunks) <= s.max_num_seqs
    assert plan.blocks_moved <= s.xfer_budget
    for r in s.running:
        assert r.status is Status.RUNNING and not s.bm.seqs[r.rid].on_host
        assert len(s.bm.seqs[r.rid].dev) >= s.bm.blocks_for(r.num_computed)
    for r in s.rotary:
        assert r.status is Status.ROTARY and s.bm.seqs[r.rid].on_host
    for r in s.waiting:
        assert r.status is Status.WAITING and r.num_computed == 0 and r.rid not in s.bm.seqs
    in_flight_src = {src for src, _ in plan.swap_out} if s.bm.duplex else set()
    assert not in_flight_src & {dst for _, dst in plan.swap_in}, "swap-in onto an in-flight swap-out source"


workload = st.lists(st.tuples(st.floats(0, 2), st.integers(1, 40), st.integers(1, 20), st.integers(0, 2)),
                    min_size=1, max_size=25)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(sorted(POLICIES)), reqs=workload, dev=st.integers(16, 48), host=st.integers(0, 80),
       bs=st.integers(1, 8), seqs=st.integers(1, 8), extra_tokens=st.integers(0, 64), xfer=st.integers(0, 40),
       step=st.floats(0.001, 0.2))
def test_invariants_and_liveness(policy, reqs, dev, host, bs, seqs, extra_tokens, xfer, step):
    s = make_sched(policy, dev, host, bs, max_num_seqs=seqs, max_num_batched_tokens=seqs + extra_tokens,
                   xfer_budget=xfer, ttft_slo=0.5, tbt_slo=0.05)
    requests = [Request(f"r{i}", p, o, t, priority=pr) for i, (t, p, o, pr) in enumerate(reqs)]
    total = sum(r.num_prompt + r.max_tokens for r in requests)
    # bound: every token computed at most (1 + recomputes) times; each step computes >= 1 token or moves blocks
    done, rejected = simulate(s, requests, lambda plan: step, on_step=lambda plan, now: check_step(s, plan),
                              max_steps=20 * total + 100)
    assert len(done) + len(rejected) == len(requests)
    for r, err in rejected:
        assert s.bm.blocks_for(r.num_prompt + r.max_tokens) > dev and "device pool" in err
    for r in done:
        assert r.status is Status.FINISHED and len(r.output) == r.max_tokens
        assert r.token_times == sorted(r.token_times)
    s.bm.copies_done()
    assert s.bm.device.num_free == dev and s.bm.host.num_free == host, "blocks leaked"


def hol_workload():
    """8 long decodes fill the pool; 8 short requests arrive just after."""
    longs = [Request(f"long{i}", 16, 400, 0.0) for i in range(8)]
    shorts = [Request(f"short{i}", 8, 4, 1.0 + 0.1 * i) for i in range(8)]
    return longs + shorts


@pytest.mark.parametrize("policy", ["fcfs", "fcfs-swap", "rotasched", "rotasched-released"])
def test_head_of_line_blocking(policy):
    # each long needs up to (16 + 400) / 4 = 104 blocks; 8 of them fill 128 blocks within ~1 s
    slo = 3.0
    s = make_sched(policy, dev=128, host=2048, bs=4, max_num_seqs=16, max_num_batched_tokens=64,
                   ttft_slo=slo, tbt_slo=0.05)  # RotaSched time slice: 5 x S_TBT
    done, _ = simulate(s, hol_workload(), lambda plan: 0.02)
    ttft = {r.rid: r.token_times[0] - r.arrival for r in done}
    shorts = [ttft[f"short{i}"] for i in range(8)]
    if policy.startswith("fcfs"):  # the shorts queue behind the longs, which hold the pool for ~20 s
        assert min(shorts) > 5 * slo, shorts
    else:                          # rotation lets every short request in within its TTFT SLO
        assert max(shorts) <= slo, shorts
        assert sum(r.rotations for r in done) > 0


def test_vlt_hand_worked():
    p = RotaSched(alpha=3, beta_f=0.5, beta_b=0)
    p.ttft_slo, p.tbt_slo = 5.0, 0.1
    w = Request("w", 4, 4, arrival=10.0)
    assert p.vlt(w, 11.0) == 0.0            # within beta_f * S_TTFT = 2.5 s: no lag yet
    assert p.vlt(w, 14.0) == pytest.approx(1.5)
    w.ttft_slo = 1.0                        # per-request SLO: lag starts after 0.5 s
    assert p.vlt(w, 14.0) == pytest.approx(3.5)
    rot = Request("rot", 4, 4, 0.0, status=Status.ROTARY, t_last_token=20.0)
    assert p.vlt(rot, 20.5) == pytest.approx(1.5)  # alpha * (0.5 - 0 * S_TBT)
    run = Request("run", 4, 4, 0.0, status=Status.RUNNING, t_admitted=18.0)
    assert p.vlt(run, 20.5) == pytest.approx(-2.5)
    order = sorted([w, rot, run], key=lambda r: p.key(r, 20.5))
    assert [r.rid for r in order] == ["w", "rot", "run"]  # w: 20.5 - 10 - 0.5 = 10 > 1.5
    rel = RotaSchedReleased()
    rot.t_queued = 19.0
    assert rel.vlt(rot, 20.5) == pytest.approx(1.5)      # alpha = 1, time in queue


def test_lvf_ties_broken_by_arrival():
    p = RotaSched()
    a, b = Request("b", 4, 4, arrival=1.0), Request("a", 4, 4, arrival=2.0)
    assert [r.rid for r in sorted([b, a], key=lambda r: p.key(r, 1.5))] == ["b", "a"]


def running_three(policy, dev):
    """Three running requests (arrived 0, 1, 2; priorities 2, 0, 1) that have decoded a token."""
    s = make_sched(policy, dev=dev, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i, pr in enumerate([2, 0, 1]):
        s.add(Request(f"r{i}", 8, 8, float(i), priority=pr))
    now = 3.0
    plan = s.schedule(now)
    s.update(plan, {r.rid: 0 for r, _ in plan.chunks}, now)
    s.bm.copies_done()
    return s


@pytest.mark.parametrize("policy,victim,how", [("fcfs", "r2", "preempted"), ("priority", "r0", "preempted"),
                                               ("fcfs-swap", "r2", "rotated_out")])
def test_victim_choice(policy, victim, how):
    s = running_three(policy, dev=6)  # 3 x 3 blocks needed after 8 tokens + 4 decodes; only 6
    for step in range(6):
        plan = s.schedule(4.0 + step)
        if plan.preempted or plan.rotated_out:
            assert getattr(plan, how) == [victim], (plan.preempted, plan.rotated_out)
            return
        s.update(plan, {r.rid: 0 for r, _ in plan.chunks}, 4.0 + step)
        s.bm.copies_done()
    pytest.fail("no preemption happened")


def rotation_setup():
    """Three running decodes fill a 7-block pool; r1 has run longest; a new request arrives."""
    s = make_sched("rotasched", dev=7, host=64, bs=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        s.add(Request(f"r{i}", 8, 16, 0.0))
    plan = s.schedule(0.0)
    s.update(plan, {r.rid: 0 for r, _ in plan.chunks}, 0.1)
    s.requests["r1"].t_admitted = -5.0  # past its time slice (5 x S_TBT); r0 and r2 are not
    s.add(Request("new", 8, 4, 0.2))
    return s, s.schedule(0.3)


def test_rotasched_rotates_longest_running_decode():
    s, plan = rotation_setup()
    assert plan.rotated_out == ["r1"]
    s.update(plan, {r.rid: 0 for r, _ in plan.chunks}, 0.4)
    assert s.bm.fenced  # r1's dirty blocks are being copied out: not reusable yet


def test_preempted_request_keeps_its_place():
    s = running_three("priority", dev=6)
    for step in range(6):
        plan = s.schedule(4.0 + step)
        s.update(plan, {r.rid: 0 for r, _ in plan.chunks}, 4.0 + step)
        s.bm.copies_done()
        if plan.preempted:
            break
    s.add(Request("later", 4, 4, 100.0, priority=2))
    order = sorted(s.waiting, key=lambda r: s.policy.key(r, 200.0))
    assert order[0].rid == "r0"  # arrived first among equals, so it goes before "later"


def test_schedule_log_is_deterministic(tmp_path):
    logs = []
    for k in range(2):
        path = tmp_path / f"log{k}.jsonl"
        s = make_sched("rotasched", dev=128, host=2048, bs=4, max_num_seqs=16, max_num_batched_tokens=64,
                       ttft_slo=3.0, tbt_slo=0.05, log_path=str(path))
        simulate(s, hol_workload(), lambda plan: 0.02)
        s.close()
        logs.append(path.read_text())
    assert logs[0] == logs[1]
    records = [json.loads(line) for line in logs[0].splitlines()]
    assert any(r["rotated_out"] for r in records) and all("tokens" in r for r in records)


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
    s, plan = rotation_setup()
    rotated = plan.rotated_out[0]
    s.bm.copies_done()
    for rid in list(s.requests):
        s.abort(rid)
    assert s.requests[rotated].status is Status.ABORTED and not s.has_unfinished()
    assert s.bm.device.num_free == 7 and s.bm.host.num_free == 64


@pytest.mark.parametrize("kw,name", [({"max_num_seqs": 0}, "max_num_seqs"), ({"xfer_budget": -1}, "xfer_budget"),
                                     ({"max_num_batched_tokens": 2, "max_num_seqs": 4}, "max_num_batched_tokens"),
                                     ({"ttft_slo": 0}, "ttft_slo"), ({"host_admit_limit": 1.5}, "host_admit_limit")])
def test_invalid_parameters(kw, name):
    with pytest.raises(ValueError, match=name):
        make_sched("fcfs", **kw)


def test_invalid_policy_params():
    with pytest.raises(ValueError, match="alpha"):
        RotaSched(alpha=-1)
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="takes no parameters"):
        make_policy("fcfs", alpha=2)


def test_duplicate_and_empty_requests():
    s = make_sched("fcfs")
    s.add(Request("a", 4, 4, 0.0))
    with pytest.raises(ValueError, match="already in use"):
        s.add(Request("a", 4, 4, 0.0))
    with pytest.raises(ValueError, match="non-empty prompt"):
        s.add(Request("b", 0, 4, 0.0))


def test_policy_spec_parameters():
    p = make_policy("rotasched:alpha=1,quantum=0.5")
    assert (p.alpha, p.quantum, p.duplex) == (1.0, 0.5, True)
    assert make_policy("rotasched-released:per-layer").duplex is False
    with pytest.raises(ValueError, match="cannot read 'gamma=1'"):
        make_policy("rotasched:gamma=1")
    with pytest.raises(ValueError, match="takes no parameters"):
        make_policy("fcfs:alpha=1")
