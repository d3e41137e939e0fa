"""Request lifecycle and scheduling policies: RotaSched and the vLLM baselines, one mechanism.

Pure Python, no tensors: the engine, the simulator and the property tests all drive it.
    WAITING --admit--> RUNNING --rotate out--> ROTARY --rotate in--> RUNNING --> FINISHED
    RUNNING --recompute-preempt--> WAITING;  any state --abort--> ABORTED
Each step, schedule(now) returns a StepPlan (tokens to compute per request, block copies);
the executor runs it and calls update(plan, sampled tokens, now).
The mechanism (continuous batching, chunked prefill, token budget, block allocation,
preemption, transfer budget, admission control) is shared; a policy only ranks requests,
says how it preempts, and may rotate proactively.
"""
from __future__ import annotations

import bisect
import json
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kv import BlockManager, Pairs


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    ROTARY = "rotary"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(slots=True, eq=False)
class Request:
    rid: str
    num_prompt: int
    max_tokens: int
    arrival: float
    prompt: list[int] | None = None         # token ids (the simulator runs without them)
    priority: int = 0                       # lower runs first (vLLM's convention)
    ttft_slo: float | None = None           # per-request SLOs; None -> the scheduler's
    tbt_slo: float | None = None
    stop_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0                   # tokens whose KV is in the cache
    t_queued: float = 0.0                   # when it last entered the waiting or rotary queue
    t_admitted: float = 0.0                 # when it last became RUNNING
    t_last_token: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens_since_admit: int = 0
    finish_reason: str | None = None
    rotations: int = 0
    recomputes: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + len(self.output)

    @property
    def in_decode(self) -> bool:
        return self.num_computed >= self.num_tokens - 1 and bool(self.output)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without building the whole sequence."""
        p = self.num_prompt
        if start >= p:
            return self.output[start - p:end - p]
        return (self.prompt or [])[start:end] + self.output[:max(0, end - p)]


@dataclass(slots=True)
class StepPlan:
    epoch: int
    now: float
    chunks: list[tuple[Request, int]]       # (request, tokens to compute); decodes first
    swap_out: Pairs                         # device -> host (rotations and eager write-backs)
    swap_in: Pairs                          # host -> device
    admitted: list[str] = field(default_factory=list)
    rotated_out: list[str] = field(default_factory=list)
    rotated_in: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)   # by recompute

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def blocks_moved(self) -> int:
        return len(self.swap_out) + len(self.swap_in)

    def log_record(self, step: int) -> dict:
        return {"step": step, "now": round(self.now, 9), "tokens": {r.rid: n for r, n in self.chunks},
                "admitted": self.admitted, "rotated_out": self.rotated_out, "rotated_in": self.rotated_in,
                "preempted": self.preempted, "swap_out": len(self.swap_out), "swap_in": len(self.swap_in)}


# ---------------------------------------------------------------- policies

class Policy:
    """FCFS (vLLM v1): arrival order; preempt the newest running request by recompute."""
    name = "fcfs"
    preempt = "recompute"      # or "swap"
    duplex = False             # DuplexKV: eager write-back + merged block-first copies
    resume_rotary_first = False

    def key(self, r: Request, now: float) -> tuple:
        """Smaller runs first; the largest running key is the first victim."""
        return (r.arrival, r.rid)

    def rotate(self, s: "Scheduler", now: float) -> None:
        """Proactive rotation before the reactive mechanism runs (none by default)."""


class FcfsSwap(Policy):
    """vLLM v0 swap mode: FCFS, swap-preempt, swapped requests resume before new prefills."""
    name, preempt, resume_rotary_first = "fcfs-swap", "swap", True


class PriorityPolicy(Policy):
    """vLLM priority scheduling: (priority, arrival); a preempted request keeps its place."""
    name = "priority"

    def key(self, r, now):
        return (r.priority, r.arrival, r.rid)


class RotaSched(Policy):
    """Largest-Virtual-Lag-First rotation with DuplexKV (the paper's RotaSched)."""
    name, preempt, duplex = "rotasched", "swap", True

    def __init__(self, alpha: float = 3.0, beta_f: float = 0.5, beta_b: float = 0.0, duplex: bool = True,
                 quantum: float | None = None):
        for n, v in (("alpha", alpha), ("beta_f", beta_f), ("beta_b", beta_b), ("quantum", quantum or 0)):
            if v < 0:
                raise ValueError(f"{n} must be >= 0, got {v}")
        self.alpha, self.beta_f, self.beta_b = alpha, beta_f, beta_b
        self.duplex = duplex    # False: the ablation with vLLM v0's per-layer per-block copies
        self.quantum = quantum  # seconds a request runs before it may be rotated out; None: 5 x S_TBT
        self.ttft_slo, self.tbt_slo = 5.0, 0.1   # set by the scheduler

    def vlt(self, r: Request, now: float) -> float:
        """Virtual lag time: how far behind its SLO a request is (running ones are negative)."""
        if r.status is Status.RUNNING:
            return -(now - r.t_admitted)
        if r.status is Status.ROTARY:
            return self.alpha * max(0.0, now - r.t_last_token - self.beta_b * (r.tbt_slo or self.tbt_slo))
        return max(0.0, now - r.arrival - self.beta_f * (r.ttft_slo or self.ttft_slo))

    def key(self, r, now):
        return (-self.vlt(r, now), r.arrival, r.rid)

    def rotate(self, s: "Scheduler", now: float) -> None:
        need, free = 0, s.bm.device.num_free
        for r in s.waiting + s.rotary:
            need += s.footprint(r)
            if need > free:
                break
        else:
            return  # everyone fits: behave as FCFS
        order = s.queue_order(now) + sorted(s.running, key=lambda r: self.key(r, now))
        # victims: running decodes that made progress and ran a full time slice since admission
        # (no rotation livelock; each rotation costs its victim a token gap, so slices are not
        # shorter than a few TBT SLOs), longest-running first, small enough to come back within
        # one step's transfer budget
        quantum = self.tbt_slo * 5 if self.quantum is None else self.quantum
        victims = [r for r in reversed(order) if r.status is Status.RUNNING and self.vlt(r, now) < 0
                   and r.in_decode and r.tokens_since_admit > 0 and now - r.t_admitted >= quantum
                   and s.bm.num_blocks(r.rid) <= s.xfer_budget]
        free, seats, moves = s.bm.device.num_free, s.max_num_seqs - len(s.running), 0
        for r in [r for r in order if r.status is not Status.RUNNING]:
            if r.status is Status.WAITING and s.hold_new(r):
                continue
            if self.vlt(r, now) < 0:
                break
            need = s.footprint(r)
            moves += s.bm.num_blocks(r.rid) if r.status is Status.ROTARY else 0
            while (free < need or seats < 1) and victims:
                host_need, copies = s.bm.swap_out_cost(victims[0].rid)
                if host_need > s.bm.host.num_free or copies + moves > s.xfer_left:
                    break
                before = s.bm.device.num_free + len(s.bm.fenced)
                s.rotate_out(victims.pop(0), now)
                free += s.bm.device.num_free + len(s.bm.fenced) - before
                seats += 1
            if free < need or seats < 1 or moves > s.xfer_left:
                break
            free, seats = free - need, seats - 1


class RotaSchedReleased(RotaSched):
    """The released code's simpler variant: alpha=1, beta=0, queues ordered by time spent in them."""
    name = "rotasched-released"

    def __init__(self, alpha: float = 1.0, beta_f: float = 0.0, beta_b: float = 0.0, duplex: bool = True,
                 quantum: float | None = None):
        super().__init__(alpha, beta_f, beta_b, duplex, quantum)

    def vlt(self, r, now):
        if r.status is Status.RUNNING:
            return -(now - r.t_admitted)
        return self.alpha * max(0.0, now - r.t_queued)


POLICIES = {p.name: p for p in (Policy, FcfsSwap, PriorityPolicy, RotaSched, RotaSchedReleased)}


def make_policy(name: str, **params) -> Policy:
    """A policy by name; a name may carry RotaSched parameters, e.g. 'rotasched:alpha=1,quantum=0.5'
    ('per-layer' stands for duplex=False, the ablation with vLLM v0's copies)."""
    name, _, spec = name.partition(":")
    for item in filter(None, spec.split(",")):
        k, eq, v = item.partition("=")
        if item == "per-layer":
            params["duplex"] = False
        elif not eq or k not in ("alpha", "beta_f", "beta_b", "quantum"):
            raise ValueError(f"policy: cannot read {item!r} in {name}:{spec} (alpha=, beta_f=, beta_b=, quantum=, "
                             "per-layer)")
        else:
            params[k] = float(v)
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    cls = POLICIES[name]
    if params and not issubclass(cls, RotaSched):
        raise ValueError(f"policy {name!r} takes no parameters, got {sorted(params)}")
    return cls(**params)


# ---------------------------------------------------------------- the mechanism

class Scheduler:
    def __init__(self, bm: BlockManager, policy: Policy | str = "rotasched", *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, xfer_budget: int = 2400, ttft_slo: float = 5.0,
                 tbt_slo: float = 0.1, host_admit_limit: float = 0.9, log_path: str | None = None):
        checks = {"max_num_seqs": max_num_seqs >= 1, "max_num_batched_tokens": max_num_batched_tokens >= max_num_seqs,
                  "xfer_budget": xfer_budget >= 0, "ttft_slo": ttft_slo > 0, "tbt_slo": tbt_slo > 0,
                  "host_admit_limit": 0 < host_admit_limit <= 1}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: invalid value {locals()[name]!r}"
                                 + (" (must be >= max_num_seqs)" if name == "max_num_batched_tokens" else ""))
        self.bm = bm
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        if isinstance(self.policy, RotaSched):
            self.policy.ttft_slo, self.policy.tbt_slo = ttft_slo, tbt_slo
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.xfer_budget, self.ttft_slo, self.tbt_slo = xfer_budget, ttft_slo, tbt_slo
        self.host_admit_limit = host_admit_limit
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.rotary: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.log = open(log_path, "w") if log_path else None
        self._plan: StepPlan | None = None
        self._order: list[Request] | None = None
        self.xfer_left = xfer_budget

    # ------------------------------------------------------------ requests in and out
    def add(self, r: Request) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it can never run."""
        if r.rid in self.requests:
            raise ValueError(f"request id {r.rid!r} is already in use")
        if r.num_prompt < 1 or r.max_tokens < 1:
            raise ValueError(f"request {r.rid}: needs a non-empty prompt and max_tokens >= 1")
        need = self.bm.blocks_for(r.num_prompt + r.max_tokens)
        if need > self.bm.device.capacity:
            raise ValueError(f"request {r.rid}: {r.num_prompt} prompt + {r.max_tokens} output tokens need {need} "
                             f"KV blocks, more than the whole device pool ({self.bm.device.capacity} blocks)")
        r.status, r.t_queued = Status.WAITING, r.arrival
        self.requests[r.rid] = r
        self.waiting.append(r)

    def abort(self, rid: str) -> Request:
        r = self.requests.get(rid)
        if r is None:
            raise KeyError(f"unknown request {rid!r}")
        if r.status in (Status.FINISHED, Status.ABORTED):
            return r
        self._finish(r, Status.ABORTED, "abort")
        return r

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.rotary)

    def _finish(self, r: Request, status: Status, reason: str) -> None:
        for q in (self.waiting, self.running, self.rotary):
            if r in q:
                q.remove(r)
        if r.rid in self.bm.seqs:
            self.bm.free(r.rid)
        r.status, r.finish_reason = status, reason

    # ------------------------------------------------------------ mechanism pieces policies use
    def footprint(self, r: Request) -> int:
        """Device blocks r needs to run its next step with all of its tokens in the cache."""
        return self.bm.blocks_for(r.num_tokens + (1 if r.output else 0))

    def hold_new(self, r: Request) -> bool:
        """Admission control: hold new requests back while host KV is nearly full."""
        h = self.bm.host
        return (self.policy.preempt == "swap" and r.num_computed == 0 and h.capacity > 0
                and len(h.owner) > self.host_admit_limit * h.capacity)

    def rotate_out(self, r: Request, now: float) -> None:
        _, copies = self.bm.swap_out_cost(r.rid)
        self._plan.swap_out += self.bm.swap_out(r.rid)
        self.xfer_left -= copies
        self.running.remove(r)
        self.rotary.append(r)
        r.status, r.t_queued, r.rotations = Status.ROTARY, now, r.rotations + 1
        self._plan.rotated_out.append(r.rid)
        self._enqueue(r, now)

    def recompute(self, r: Request, now: float) -> None:
        self.bm.free(r.rid)
        self.running.remove(r)
        self.waiting.append(r)
        r.status, r.num_computed, r.t_queued, r.recomputes = Status.WAITING, 0, now, r.recomputes + 1
        self._plan.preempted.append(r.rid)
        self._enqueue(r, now)

    def _enqueue(self, r: Request, now: float) -> None:
        if self._order is not None:
            bisect.insort(self._order, r, key=lambda q: self.policy.key(q, now))

    def preempt(self, r: Request, now: float) -> None:
        host_need, copies = self.bm.swap_out_cost(r.rid)
        if (self.policy.preempt == "swap" and host_need <= self.bm.host.num_free and copies <= self.xfer_left
                and self.bm.num_blocks(r.rid) <= self.xfer_budget):  # it must be able to come back
            self.rotate_out(r, now)
        else:  # no host room or transfer budget left: fall back to recompute, never stall
            self.recompute(r, now)

    # ------------------------------------------------------------ one step
    def queue_order(self, now: float) -> list[Request]:
        """Waiting and rotary requests, most urgent first (sorted once per step)."""
        if self._order is None:
            self._order = sorted(self.waiting + self.rotary, key=lambda r: self.policy.key(r, now))
        return self._order

    def schedule(self, now: float) -> StepPlan:
        plan = self._plan = StepPlan(self.bm.epoch, now, [], [], [])
        self.xfer_left, self._order = self.xfer_budget, None
        key = lambda r: self.policy.key(r, now)
        self.policy.rotate(self, now)
        budget = self.max_num_batched_tokens
        scheduled: set[str] = set()
        # 1. running requests, decodes first, then prefill chunks; preempt the worst on a block shortfall
        queue = deque(sorted(self.running, key=lambda r: (not r.in_decode, key(r))))
        while queue and budget > 0:
            r = queue.popleft()
            n = min(r.num_tokens - r.num_computed, budget)
            while self.bm.new_blocks_needed(r.rid, n) > self.bm.device.num_free:
                if self.bm.new_blocks_needed(r.rid, n) <= self.bm.device.num_free + len(self.bm.fenced):
                    n = 0  # room frees up when in-flight copies land: wait a step
                    break
                victims = [v for v in self.running if v.rid not in scheduled and v is not r]
                victim = max(victims, key=key) if victims else r
                if victim is not r and key(victim) < key(r):
                    victim = r  # never evict a more urgent request for a less urgent one
                if victim in queue:
                    queue.remove(victim)
                self.preempt(victim, now)
                if victim is r:
                    n = 0
                    break
            if n > 0:
                self._run(r, n)
                scheduled.add(r.rid)
                budget -= n
        # 2. admit rotary and waiting requests in policy order while they fit
        order = self.queue_order(now)
        if self.policy.resume_rotary_first:
            order = [r for r in order if r.status is Status.ROTARY] + [r for r in order if r.status is Status.WAITING]
        for r in order:
            if r.status not in (Status.WAITING, Status.ROTARY) or r.rid in plan.rotated_out:
                continue  # admitted already, or rotated out this very step
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if r.status is Status.WAITING and self.policy.resume_rotary_first and self.rotary:
                break  # vLLM v0: no new prefill while swapped requests wait
            if r.status is Status.WAITING and self.hold_new(r):
                continue
            if r.status is Status.ROTARY:
                moves = self.bm.num_blocks(r.rid)
                n = min(r.num_tokens - r.num_computed, budget)
                need = self.bm.blocks_for(r.num_computed + n)
                if need > self.bm.device.num_free or moves > self.xfer_left:
                    break
                plan.swap_in += self.bm.swap_in(r.rid)
                self.xfer_left -= moves
                self.rotary.remove(r)
                plan.rotated_in.append(r.rid)
            else:
                n = min(r.num_tokens - r.num_computed, budget)
                if self.bm.new_blocks_needed(r.rid, n) > self.bm.device.num_free:
                    break
                self.waiting.remove(r)
                plan.admitted.append(r.rid)
            self.running.append(r)
            r.status, r.t_admitted, r.tokens_since_admit = Status.RUNNING, now, 0
            self._run(r, n)
            budget -= n
        # 3. eager write-back of full blocks with the transfer budget left (DuplexKV)
        if self.bm.duplex:
            reserve = int((1 - self.host_admit_limit) * self.bm.host.capacity)
            for r in self.running:
                if self.xfer_left <= 0:
                    break
                pairs = self.bm.writeback(r.rid, r.num_computed, self.xfer_left, reserve)
                plan.swap_out += pairs
                self.xfer_left -= len(pairs)
        self.bm.next_epoch()
        if self.log:
            self.log.write(json.dumps(plan.log_record(self.steps)) + "\n")
        self.steps += 1
        self._check(plan)
        return plan

    def _run(self, r: Request, n: int) -> None:
        assert self.bm.seqs[r.rid].num_tokens == r.num_computed if r.rid in self.bm.seqs else r.num_computed == 0
        self.bm.append(r.rid, n)
        self._plan.chunks.append((r, n))

    def _check(self, plan: StepPlan) -> None:
        assert plan.num_tokens <= self.max_num_batched_tokens, "token budget exceeded"
        assert len(plan.chunks) <= self.max_num_seqs and len(self.running) <= self.max_num_seqs, "batch too large"
        assert plan.blocks_moved <= self.xfer_budget, "transfer budget exceeded"
        for r, n in plan.chunks:
            assert r.status is Status.RUNNING and n > 0 and r.num_computed + n <= r.num_tokens

    def update(self, plan: StepPlan, sampled: dict[str, int], now: float) -> list[Request]:
        """Apply a step's results: KV computed, one token sampled for each request that finished its
        chunk at the end of its tokens. Returns the requests that finished."""
        finished = []
        for r, n in plan.chunks:
            if r.status is not Status.RUNNING:
                continue  # aborted while the step ran
            r.num_computed += n
            if r.num_computed < r.num_tokens:
                continue  # a prefill chunk: no token yet
            tok = sampled[r.rid]
            r.output.append(tok)
            r.token_times.append(now)
            r.t_last_token = now
            r.tokens_since_admit += 1
            if tok in r.stop_ids:
                reason = "stop"
            elif len(r.output) >= r.max_tokens:
                reason = "length"
            else:
                continue
            self._finish(r, Status.FINISHED, reason)
            finished.append(r)
        return finished

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.log = None
