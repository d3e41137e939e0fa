"""Request lifecycle and scheduling: one mechanism; policies that rank requests and pick victims.

Pure Python, no tensors: the engine, the simulator and the property tests all drive it.

    WAITING --admit--> RUNNING --rotate out--> ROTARY --rotate in--> RUNNING --> FINISHED
    RUNNING --preempt (recompute)--> WAITING;         any state --abort--> ABORTED

schedule(now) builds one step:
  1. run   the running requests: decodes first, then prefill chunks, each in admission order.
           One that cannot get a block waits a step if in-flight copies will free enough;
           otherwise the policy's victim is preempted (rotated out, or recomputed later).
  2. admit waiting and rotary requests in the policy's order while they fit. A rotating policy
           may rotate running requests out for a candidate: all the victims it needs, or none.
  3. write back full, dirty blocks to their host mirrors with the transfer budget left.
The executor runs the returned StepPlan and calls update(plan, sampled tokens, now).

Device blocks usable this step are the free ones plus, for a victim, the blocks its swap-out
frees at once (BlockManager.swap_out_effect); blocks still read by in-flight copies (fenced)
come back when the copies land. With swap_in_overlap (DuplexKV on a GPU) a request rotated in at
step N computes from step N + 1, so its swap-in runs under step N's forward (kv.DuplexCopier).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from kv import BlockManager, Pairs, Placement


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
    ttft_slo: float | None = None           # per-request SLOs; None: the engine's
    tbt_slo: float | None = None
    stop_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    output: list[int] = field(default_factory=list)
    num_computed: int = 0                   # tokens whose KV is in the cache
    seq: int = 0                            # order of arrival at the scheduler (ties)
    t_queued: float = 0.0                   # when it last entered the waiting or rotary queue
    t_admitted: float = 0.0                 # when it last became RUNNING
    t_last_token: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens_since_admit: int = 0
    finish_reason: str | None = None
    rotations: int = 0
    recomputes: int = 0
    hashes: list[int] = field(default_factory=list)  # of its full blocks (prefix caching): from
    num_cached: int = 0                     # its tokens, or given; prompt tokens found cached

    @property
    def num_tokens(self) -> int:
        return self.num_prompt + len(self.output)

    @property
    def in_decode(self) -> bool:
        return bool(self.output) and self.num_computed >= self.num_tokens - 1

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without building the whole sequence."""
        p = self.num_prompt
        if start >= p:
            return self.output[start - p:end - p]
        return (self.prompt or [])[start:end] + self.output[:max(0, end - p)]


def block_hash(parent: int, tokens: list[int]) -> int:
    """A full block's identity for prefix caching: its tokens and, through its parent's hash,
    every token before them. A cryptographic hash, so a prompt cannot be crafted to collide
    with another user's prefix and read its KV."""
    data = parent.to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


class Room(NamedTuple):
    """What a step has left once some requests are rotated out."""
    room: int      # device blocks free for use this step
    budget: int    # tokens
    host: int      # host blocks the rotations take
    moves: int     # blocks copied


@dataclass(slots=True)
class StepPlan:
    epoch: int
    now: float
    chunks: dict[Request, int] = field(default_factory=dict)  # tokens to compute, per request
    swap_out: Pairs = field(default_factory=list)   # device -> host: rotations, write-backs
    written_back: int = 0                           # of swap_out, write-backs (the rest rotate)
    swap_in: Pairs = field(default_factory=list)    # host -> device
    prefix_in: int = 0                              # of swap_in, cached prefixes (the rest rotate)
    admitted: list[str] = field(default_factory=list)    # on device for the first time
    resumed: list[str] = field(default_factory=list)     # back after a recompute-preemption
    rotated_in: list[str] = field(default_factory=list)  # swapped back in
    rotated_out: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)   # by recompute
    proactive: list[str] = field(default_factory=list)   # rotated out before any shortfall
    rotated_for: dict[str, str] = field(default_factory=dict)  # victim -> the candidate
    landed: int = -1                                # copies of epochs <= this had landed

    @property
    def num_tokens(self) -> int:
        return sum(self.chunks.values())

    @property
    def blocks_moved(self) -> int:
        return len(self.swap_out) + len(self.swap_in)

    def decisions(self) -> dict:
        """What this step decided, as the schedule log records it (schedlog.py compares these)."""
        return {"tokens": {r.rid: n for r, n in self.chunks.items()}, "admitted": self.admitted,
                "resumed": self.resumed, "rotated_in": self.rotated_in,
                "rotated_out": self.rotated_out, "preempted": self.preempted,
                "swap_out": len(self.swap_out), "swap_in": len(self.swap_in)}


# ---------------------------------------------------------------- policies

class Policy:
    """FCFS as vLLM v1: arrival order; on a block shortfall the last-admitted running request is
    preempted by recompute (it goes back to the front of the queue) and nobody is admitted.

    This base declares everything the Scheduler asks of a policy: the class attributes say what
    the policy can do, the methods decide who goes first, who makes room and who may pass."""
    name = "fcfs"
    swaps = False                # preempt by swapping KV to host (else by recompute)
    duplex = False               # DuplexKV: eager write-back, merged copies, overlapped swap-in
    capped = True                # B_xfer bounds every block it moves in a step (else uncapped)
    one_partial_prefill = False  # at most one unfinished prefill per step (their vLLM V1's rule)
    prealloc_tokens = 0          # slots taken ahead whenever a request needs a new block
    PARAMS: dict[str, type] = {}  # what 'name:key=value' may set: the paper's parameters only

    def __init__(self, ttft_slo: float = 5.0, tbt_slo: float = 0.1):
        self.ttft_slo, self.tbt_slo = ttft_slo, tbt_slo  # for requests that name none

    def rank(self, r: Request, now: float) -> tuple:
        """Smaller is more urgent."""
        return (r.arrival, r.seq)

    def queues(self, s: Scheduler, plan: StepPlan, now: float) -> list[list[Request]]:
        """Requests to admit, most urgent first, one list after another."""
        if plan.preempted or plan.rotated_out:
            return []  # vLLM v1: no admissions in a step that preempted
        return [sorted(s.waiting + s.rotary, key=lambda r: self.rank(r, now))]

    def victim(self, s: Scheduler, r: Request, now: float) -> Request:
        """The running request to preempt when r cannot get a block (r itself when none)."""
        return s.running[-1]

    def before_run(self, s: Scheduler, plan: StepPlan, now: float) -> None:
        """Proactive work before the running requests are scheduled (none by default)."""

    def may_rotate_for(self, s: Scheduler, c: Request, now: float) -> bool:
        """May running requests be rotated out so that candidate c fits this step?"""
        return False

    def victims(self, s: Scheduler, plan: StepPlan, now: float) -> list[Request]:
        """The running requests that may be rotated out for a candidate, first choice first."""
        return []

    def may_pass(self, s: Scheduler, c: Request, now: float) -> bool:
        """Once a candidate of this list could not start, may c, behind it, start in free room?
        No by default: the queue is strict, as vLLM's are."""
        return False

    def stalled(self, r: Request, now: float) -> bool:
        """Is rotated-out r's token gap, now, one the policy counts as a stall?"""
        return False


class PriorityPolicy(Policy):
    """vLLM v1 priority: (priority, arrival); the victim is the lowest-priority running request,
    even one already scheduled this step (it is taken back out)."""
    name = "priority"

    def rank(self, r, now):
        return (r.priority, r.arrival, r.seq)

    def victim(self, s, r, now):
        return max(s.running, key=lambda v: self.rank(v, now))


class FcfsSwap(Policy):
    """vLLM v0 with chunked prefill and swap preemption: running requests first, then swapped
    ones (only in a step that preempted nobody), then new prefills; each queue FCFS and strict.
    Copies go one block-layer at a time, uncapped, and compute waits for them."""
    name, swaps, capped = "fcfs-swap", True, False

    def queues(self, s, plan, now):
        rotary = sorted(s.rotary, key=lambda r: self.rank(r, now))
        waiting = sorted(s.waiting, key=lambda r: self.rank(r, now))
        return [waiting] if plan.preempted or plan.rotated_out else [rotary, waiting]


class RotaSchedLVF(Policy):
    """Largest-Virtual-Lag-First, as we read the paper's abstract, with DuplexKV; nothing of ours.

    Virtual lag (seconds behind an SLO-derived bound), every step:
        waiting  ReLU(now - arrival    - beta_f * S_TTFT)
        rotary   alpha * ReLU(now - last token - beta_b * S_TBT)
        running  -(now - t_admitted)
    (Which term alpha weighs, and which beta goes with which SLO, is our reading: the abstract
    does not say.) If the free device blocks hold every queued request, it is FCFS. Otherwise
    queued requests go largest lag first (ties: arrival), and each may rotate running ones out,
    from the tail of the order: decodes before mid-prefill requests, the longest-running first.
    B_xfer caps the blocks moved in a step. A reactive preemption takes the tail's first too.
    The shared mechanism adds what any rotation needs: a victim has made progress since it came
    in (no livelock), can come back within one step's B_xfer, and is rotated out only if the
    candidate then fits and computes its first token this step (a rotation that admits nobody
    is pure cost)."""
    name, swaps, duplex = "rotasched-lvf", True, True
    PARAMS = {"alpha": float, "beta_f": float, "beta_b": float}

    def __init__(self, alpha: float = 3.0, beta_f: float = 0.5, beta_b: float = 0.0,
                 ttft_slo: float = 5.0, tbt_slo: float = 0.1):
        super().__init__(ttft_slo, tbt_slo)
        self.alpha, self.beta_f, self.beta_b = alpha, beta_f, beta_b

    def lag(self, r: Request, now: float) -> float:
        """Signed lag: negative while a queued request is within its bound."""
        if r.status is Status.RUNNING:
            return -(now - r.t_admitted)
        if r.status is Status.ROTARY:
            return self.alpha * (now - r.t_last_token - self.beta_b * self.tbt(r))
        return now - r.arrival - self.beta_f * self.ttft(r)

    def vlt(self, r: Request, now: float) -> float:
        lag = self.lag(r, now)
        return lag if r.status is Status.RUNNING else max(0.0, lag)

    def ttft(self, r: Request) -> float:
        return r.ttft_slo or self.ttft_slo

    def tbt(self, r: Request) -> float:
        return r.tbt_slo or self.tbt_slo

    def rank(self, r, now):
        return (-self.vlt(r, now), r.arrival, r.seq)

    def queues(self, s, plan, now):
        queued = s.waiting + s.rotary
        if s.fits_all(queued):
            return [sorted(queued, key=lambda r: (r.arrival, r.seq))]
        return self.by_urgency(s, now)

    def by_urgency(self, s: Scheduler, now: float) -> list[list[Request]]:
        """The queues when not everyone fits: one list, largest lag first."""
        return [sorted(s.waiting + s.rotary, key=lambda r: self.rank(r, now))]

    def may_rotate_for(self, s, c, now):
        return s.blocks_needed(c) > s.bm.num_free  # rotation frees KV room

    def victims(self, s, plan, now):
        ok = [v for v in s.running if v.tokens_since_admit and self.can_go(s, v, now)
              and s.bm.num_blocks(v.rid) <= s.cfg.xfer_budget]
        return sorted(ok, key=lambda v: (not v.in_decode, self.lag(v, now), v.seq))

    def can_go(self, s: Scheduler, v: Request, now: float) -> bool:
        """May v be rotated out at all (beyond the mechanism's rules)?"""
        return True

    def victim(self, s, r, now):
        others = [v for v in s.running if v is not r and v.tokens_since_admit > 0]
        return min(others, key=lambda v: (not self.can_go(s, v, now), not v.in_decode,
                                          self.lag(v, now), v.seq), default=r)


class RotaSched(RotaSchedLVF):
    """The default: LVF plus the additions of ours that the measured claim needs; each one
    below says what it buys (docs/claim.md: the measurement that kept it).

    - Rotated-out requests come back first, oldest first, into free room only, and never rotate
      others out: returning by lag splits a request's time out into many long gaps.
    - A request is rotated out for others at most ROTATIONS times: each rotation is one long
      token gap for it, so this bounds how many it sees.
    - The TBT tail as a budget: rotations stop while the recent stalls (rotated-out requests out
      longer than STALL TBT SLOs, each counted from the moment it leaves) reach STALLS of the
      tokens generated or owed. The TBT p99 is 1% of the gaps; STALLS leaves most of it to the
      long gaps the load makes anyway. Lower it for a tighter tail, raise it for more rotation.
    - New requests that can still meet their TTFT SLO go before those that cannot (each group
      by lag), until a late one has waited PATIENCE TTFT SLOs: more first tokens on time under
      overload, with the tail of the late ones bounded.
    - Behind a new request that cannot start, a short one (a prompt of at most BACKFILL of a
      step's token budget) that fits whole in free room and is not yet due may start: short
      prompts pass a long one in a burst, without making a decode step a full prefill step.
    - A new request waiting only for a seat or the token budget, its KV fitting, may rotate
      others out too: a full batch is time-sliced like a full pool (decode-heavy load with
      short prompts fills the seats before the KV).
    - A reactive preemption takes the last admitted request, as vLLM does: it holds the least
      KV, so it comes back soonest."""
    name = "rotasched"
    ROTATIONS = 1
    STALLS, STALL = 0.0075, 4.0
    PATIENCE = 8.0
    BACKFILL = 0.75

    def rank(self, r, now):
        late = not self.viable(r, now) and now - r.arrival < self.PATIENCE * self.ttft(r)
        return (late, -self.vlt(r, now), r.arrival, r.seq)

    def viable(self, c: Request, now: float) -> bool:
        """Can c still meet its TTFT SLO (True once it has its first token)?"""
        return c.status is not Status.WAITING or now - c.arrival < self.ttft(c)

    def by_urgency(self, s, now):
        return [sorted(s.rotary, key=lambda r: (r.arrival, r.seq)),
                sorted(s.waiting, key=lambda r: self.rank(r, now))]

    def may_rotate_for(self, s, c, now):
        return c.status is Status.WAITING  # for KV room, and for a seat or the token budget

    def can_go(self, s, v, now):
        return v.rotations < self.ROTATIONS

    def victims(self, s, plan, now):
        used = s.num_stalls + len(s.rotary)
        room = self.STALLS * self.tokens(s) - used
        return super().victims(s, plan, now)[:max(0, math.ceil(room))]

    def tokens(self, s: Scheduler) -> int:
        """What the stall budget is a share of: the tokens generated so far (recently: see
        WINDOW) and those the requests on the device or rotated out still owe."""
        return s.num_generated + sum(r.max_tokens - len(r.output) for r in s.running + s.rotary)

    def stalled(self, r, now):
        return now - r.t_last_token > self.STALL * self.tbt(r)

    def may_pass(self, s, c, now):
        return (c.status is Status.WAITING and self.lag(c, now) < 0
                and c.num_tokens <= self.BACKFILL * s.cfg.max_num_batched_tokens
                and s.blocks_needed(c) <= s.bm.num_free)

    def victim(self, s, r, now):
        """The last admitted, unless its cached prefix is still copying in: rotated out
        before it computes, it would wait for free room with its first token still owed."""
        return next((v for v in reversed(s.running) if v.rid not in s.loading), s.running[-1])


class RotaSchedReleased(Policy):
    """The authors' released scheduler (SuperInfer, vllm/v1/core/scheduler.py schedule_early).
    It has no TTFT or TBT target, no virtual lag, no alpha or beta:
    - one FIFO queue of new and swapped-out requests, ordered by when they entered it;
    - proactive: when not every request fits, host KV usage is below 95% and fewer than B_xfer
      device blocks are free, swap out the longest-running decodes while the blocks they hold
      stay under B_xfer in total (B_xfer is a watermark and caps only these swap-outs; the
      setting swap_watermark gives it its own value, as their --proactive-swap-budget does);
    - reactive: the last-admitted running request is swapped out; no admissions in a step with a
      reactive preemption unless it also had proactive ones;
    - new requests wait while host KV usage is above 90%; one partial prefill at a time (their
      vLLM V1); every full block written back eagerly, uncapped; no time slice;
    - blocks for 64 tokens taken ahead whenever a request needs a new block (their
      KVCacheManager); a swapped-out request's device blocks keep its KV until reused and a
      swap-in copies only the others (their prefix cache; our block accounting does this for
      every DuplexKV policy).
    Where ours differs from their engine:
    - they run a request in the step that swaps it in; we run it one step later (its copy under
      the step's forward), so a request is not swapped out again before it has run;
    - they schedule step N + 1 while step N runs, so their decisions see the state one step
      old; ours see the state after step N;
    - their reactive preemption branches on scheduler_config.eviction_policy, which their
      SchedulerConfig does not define; ours swaps the victim out (recompute if it cannot go)."""
    name, swaps, duplex, capped = "rotasched-released", True, True, False
    one_partial_prefill = True
    prealloc_tokens = 64

    def rank(self, r, now):
        return (r.t_queued, r.seq)

    def queues(self, s, plan, now):
        reactive = plan.preempted or len(plan.rotated_out) > len(plan.proactive)
        if reactive and not plan.proactive:
            return []
        return [sorted(s.waiting + s.rotary, key=lambda r: self.rank(r, now))]

    def before_run(self, s, plan, now):
        bm = s.bm
        budget = s.cfg.xfer_budget if s.cfg.swap_watermark is None else s.cfg.swap_watermark
        if (s.fits_all(s.running + s.waiting + s.rotary) or bm.usage("host") >= 0.95
                or bm.num_free >= budget):
            return
        freed = 0
        for v in sorted(s.running, key=lambda v: (v.t_admitted, v.seq)):
            if v.num_tokens - v.num_computed != 1 or not v.tokens_since_admit:
                continue  # a decode, and (ours) one that has run since it was swapped in
            n = len(bm.block_table(v.rid))
            if freed + n >= budget or bm.swap_out_effect(v.rid).host_need > bm.host.num_free:
                break
            freed += n
            s.rotate_out(plan, v, proactive=True)


POLICIES = {p.name: p for p in (Policy, PriorityPolicy, FcfsSwap, RotaSchedLVF, RotaSched,
                                RotaSchedReleased)}


def make_policy(spec: str, ttft_slo: float = 5.0, tbt_slo: float = 0.1) -> Policy:
    """A policy from its name; the LVF ones take the paper's parameters: 'rotasched:alpha=1'."""
    name, _, args = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"policy: unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    cls, params = POLICIES[name], {}
    for item in filter(None, args.split(",")):
        key, eq, value = item.partition("=")
        if not (eq and key in cls.PARAMS):
            takes = ", ".join(f"{k}=" for k in cls.PARAMS)
            raise ValueError(f"policy {spec!r}: cannot read {item!r} ({name} takes "
                             f"{takes or 'nothing'})")
        try:
            params[key] = float(value)
        except ValueError:
            params[key] = math.nan
        if not math.isfinite(params[key]) or params[key] < 0:
            raise ValueError(f"policy {spec!r}: {key} must be a finite number >= 0, got {value!r}")
    return cls(ttft_slo=ttft_slo, tbt_slo=tbt_slo, **params)


# ---------------------------------------------------------------- the mechanism

# RotaSched's stall budget is a share of the recent history: about the last WINDOW to
# 2 x WINDOW tokens. Over the whole history, a server that had run calm loads for hours would
# bank a budget that lets one overload stall many streams at once.
WINDOW = 4096


class Scheduler:
    """Continuous batching over two tiers of KV blocks; cfg is superinfer.EngineConfig."""

    def __init__(self, bm: BlockManager, policy: Policy, cfg):
        self.bm, self.policy, self.cfg = bm, policy, cfg
        # DuplexKV may overlap a swap-in with the step before the request runs (a setting)
        self.overlap = policy.duplex and bool(cfg.swap_in_overlap)
        self.waiting: list[Request] = []
        self.running: list[Request] = []     # in admission order
        self.rotary: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # tokens sampled and rotated-in requests the policy saw stalled: recent history only,
        # both halved whenever the tokens reach WINDOW (see update)
        self.num_generated = self.num_stalls = 0
        # prompt tokens of started requests, those found cached, and of those the ones on host;
        # the requests started last step whose cached prefix is still copying in from host
        self.cache_queries = self.cache_hits = self.cache_host_hits = 0
        self.loading: set[str] = set()
        self.log = open(cfg.log_path, "w") if cfg.log_path else None
        settings = {k: v for k, v in vars(cfg).items() if k != "log_path"}
        self._log(event="config", settings=settings, device_blocks=bm.device.capacity,
                  host_blocks=bm.host.capacity)
        self._seq = itertools.count()
        self._cap = cfg.xfer_budget if policy.capped else math.inf  # B_xfer, blocks a step
        self._budget = 0                     # tokens left in this step
        self._xfer = 0                       # blocks the transfer budget still allows this step

    @classmethod
    def create(cls, cfg, num_device_blocks: int, num_host_blocks: int) -> "Scheduler":
        """The policy cfg names, over a block manager of the given pool sizes."""
        policy = make_policy(cfg.policy, cfg.ttft_slo, cfg.tbt_slo)
        bm = BlockManager(num_device_blocks, num_host_blocks, cfg.block_size, policy.duplex,
                          -(-policy.prealloc_tokens // cfg.block_size), cfg.prefix_caching)
        return cls(bm, policy, cfg)

    # ------------------------------------------------------------ requests in and out
    def add(self, r: Request) -> None:
        """Queue a request; raises ValueError (and changes nothing) if it can never run."""
        if r.rid in self.requests:
            raise ValueError(f"request id {r.rid!r} is already in use")
        if r.num_prompt < 1 or r.max_tokens < 1:
            raise ValueError(f"request {r.rid}: needs a non-empty prompt and max_tokens >= 1")
        need = self.bm.blocks_for(r.num_prompt + r.max_tokens)
        if need > self.bm.device.capacity:
            raise ValueError(f"request {r.rid}: {r.num_prompt} prompt + {r.max_tokens} output "
                             f"tokens need {need} KV blocks, more than the whole device pool "
                             f"({self.bm.device.capacity} blocks)")
        r.status, r.t_queued, r.seq = Status.WAITING, r.arrival, next(self._seq)
        self.requests[r.rid] = r
        self.waiting.append(r)
        self._log(event="add", rid=r.rid, arrival=r.arrival, num_prompt=r.num_prompt,
                  max_tokens=r.max_tokens, priority=r.priority, ttft_slo=r.ttft_slo,
                  tbt_slo=r.tbt_slo, **self._identity(r))

    def finish(self, rid: str, reason: str) -> None:
        """End a request that the executor found complete (a stop string)."""
        self._finish(self.requests[rid], Status.FINISHED, reason)
        self._log(event="finish", rid=rid, reason=reason)

    def abort(self, rid: str, reason: str = "abort") -> Request:
        r = self.requests.get(rid)
        if r is None:
            raise KeyError(f"unknown request {rid!r}")
        if r.status not in (Status.FINISHED, Status.ABORTED):
            self._finish(r, Status.ABORTED, reason)
            self._log(event="abort", rid=rid, reason=reason)
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

    # ------------------------------------------------------------ one step
    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan(self.bm.epoch, now, landed=self.bm.landed)
        self._budget, self._xfer = self.cfg.max_num_batched_tokens, self._cap
        self.policy.before_run(self, plan, now)
        self._run(plan, now)
        self.loading.clear()
        for queue in self.policy.queues(self, plan, now):
            self._admit(plan, queue, now)
        self._write_back(plan)
        self.bm.next_epoch()
        self._check(plan)
        self.num_steps += 1
        return plan

    def _run(self, plan: StepPlan, now: float) -> None:
        """Step 1: decodes first, then prefill chunks, each in admission order."""
        for r in sorted(self.running, key=lambda r: not r.in_decode):
            if self._budget <= 0:
                return
            if r.status is not Status.RUNNING:
                continue  # preempted for an earlier request of this loop
            n = min(r.num_tokens - r.num_computed, self._budget)
            if self._make_room(plan, r, n, now):
                self._compute(plan, r, n)

    def _make_room(self, plan: StepPlan, r: Request, n: int, now: float) -> bool:
        """Free device blocks for r's next n tokens, preempting the policy's victims if needed."""
        need = self.bm.new_blocks_needed(r.rid, n)
        while need > self.bm.num_free:
            if need <= self.bm.num_free + len(self.bm.fenced):
                return False  # copies in flight will free the room: wait a step
            victim = self.policy.victim(self, r, now)
            self._preempt(plan, victim, now)
            if victim is r:
                return False
        return True

    def _admit(self, plan: StepPlan, queue: list[Request], now: float) -> None:
        """Step 2: start candidates in order, rotating the policy's victims out where it may.
        Once one cannot start, those behind it start only if the policy lets them pass it (in
        free room, rotating no one)."""
        passed = False
        for c in queue:
            full = self._budget <= 0 or self._partial_prefill(plan)
            if full or (passed and not self.bm.num_free):
                return
            if c.status is Status.WAITING and self._hold_new(c) or c.rid in plan.rotated_out:
                continue  # held by admission control, or its copy out is still in flight
            if passed:
                free = Room(self.bm.num_free, self._budget, 0, 0)
                ok = self.policy.may_pass(self, c, now) and self._fits(plan, c, free, 0)
                victims = [] if ok else None
            else:
                victims = self._victims_for(plan, c, now)
            if victims is None:
                passed = True
                continue
            for v in victims:
                self.rotate_out(plan, v, for_rid=c.rid, proactive=True)
            self._start(plan, c, now, host=not victims)

    def _victims_for(self, plan: StepPlan, c: Request, now: float) -> list[Request] | None:
        """The running requests to rotate out so that c fits this step ([] if it fits as is),
        or None if it cannot fit even with every victim the policy offers. All or none: a
        rotation that admits nobody is pure cost."""
        cost = Room(self.bm.num_free, self._budget, 0, 0)
        if self._fits(plan, c, cost, 0):
            return []
        if not self.policy.may_rotate_for(self, c, now):
            return None
        chosen: list[Request] = []
        taken = set(self.placement(c, host=False).device)  # blocks c takes stay on the device
        for v in self.policy.victims(self, plan, now):  # none started this step: they had no
            drop = plan.chunks.get(v, 0)                 # token since they came in
            e = self.bm.swap_out_effect(v.rid, drop, taken)
            more = Room(cost.room + e.room, cost.budget + drop, cost.host + e.host_need,
                        cost.moves + e.copies)
            if more.host > self.bm.host.num_free or more.moves > self._xfer:
                continue  # this victim cannot go: try the next
            cost = more
            chosen.append(v)
            if self._fits(plan, c, cost, len(chosen)):
                return chosen
        return None

    def _fits(self, plan: StepPlan, c: Request, cost: Room, victims: int) -> bool:
        """Would c fit this step with `cost`: the room, token budget, host blocks and moves that
        rotating `victims` requests out leaves? The one place where a step's room is counted."""
        p = self.placement(c, host=not victims)
        start = self._start_at(c, p)
        n = self._first_chunk(c, p, cost.budget)
        if c.status is Status.WAITING and victims and start + n < c.num_tokens:
            return False  # a rotation must buy the candidate its first token
        return (self._room_needed(p, start + n) <= cost.room
                and len(self.running) - victims < self.cfg.max_num_seqs
                and cost.host + p.host_room <= self.bm.host.num_free
                and cost.moves + p.copies <= self._xfer)

    def _first_chunk(self, c: Request, p: Placement, budget: int) -> int:
        """Tokens c computes in the step it is started: none where blocks are copied in and
        the copy overlaps compute (it joins at the next step, its copy under this step's
        forward)."""
        if self.overlap and p.copies:
            return 0
        return min(c.num_tokens - self._start_at(c, p), budget)

    def _start(self, plan: StepPlan, c: Request, now: float, host: bool = True) -> None:
        p = self.placement(c, host)
        n = self._first_chunk(c, p, self._budget)
        if c.status is Status.ROTARY:
            self.num_stalls += self.policy.stalled(c, now)
            pairs = self.bm.swap_in(c.rid)
            self.rotary.remove(c)
            plan.rotated_in.append(c.rid)
        else:
            pairs = self._take_prefix(c, p)
            plan.prefix_in += len(pairs)
            if pairs and not n:
                self.loading.add(c.rid)
            self.waiting.remove(c)
            (plan.resumed if c.recomputes else plan.admitted).append(c.rid)
        self._xfer -= len(pairs)
        plan.swap_in += pairs
        self.running.append(c)
        c.status, c.t_admitted, c.tokens_since_admit = Status.RUNNING, now, 0
        if n:
            self._compute(plan, c, n)

    # ------------------------------------------------------------ prefix caching
    def hashes(self, r: Request, n: int) -> list[int]:
        """The hashes of r's first n full blocks, computed from its tokens once (fewer where it
        has no more: the simulator's requests carry theirs)."""
        size = self.bm.block_size
        while r.prompt is not None and len(r.hashes) < n:
            i = len(r.hashes)
            tokens = r.token_slice(i * size, (i + 1) * size)
            r.hashes.append(block_hash(r.hashes[-1] if i else 0, tokens))
        return r.hashes[:n]

    def placement(self, c: Request, host: bool = True) -> Placement:
        """Where queued c's blocks would come from if it started now; a new request started by
        rotating others out takes no cached prefix from host (host=False): the victims' copies
        out may take the host blocks it would copy from, and its copy in would cost the step
        that buys its first token."""
        if c.status is Status.ROTARY:
            return self.bm.swap_in_placement(c.rid)
        if self.cfg.prefix_caching == "off":
            return Placement([], [], 0)
        # the last token is always computed: its logits give the next token
        hashes = self.hashes(c, (c.num_tokens - 1) // self.bm.block_size)
        return self.bm.prefix_placement(hashes, host)

    def blocks_needed(self, c: Request) -> int:
        """Free device blocks queued c needs to compute all its tokens."""
        return self._room_needed(self.placement(c), c.num_tokens)

    def _room_needed(self, p: Placement, tokens: int) -> int:
        return p.room + max(0, self.bm.blocks_for(tokens) - len(p.device))

    def _start_at(self, c: Request, p: Placement) -> int:
        """The token queued c computes from: where it stopped, or after its cached prefix."""
        return c.num_computed if c.status is Status.ROTARY else len(p.device) * self.bm.block_size

    def _take_prefix(self, c: Request, p: Placement) -> Pairs:
        """New c takes its cached prefix: the host -> device copies of the blocks on host."""
        pairs = self.bm.start(c.rid, self.hashes(c, len(p.device)), p)
        c.num_computed = self._start_at(c, p)
        if self.cfg.prefix_caching != "off":
            self.cache_queries += c.num_tokens
            self.cache_hits += c.num_computed
            self.cache_host_hits += len(pairs) * self.bm.block_size
        if not c.recomputes:
            c.num_cached = c.num_computed
        return pairs

    # ------------------------------------------------------------ mechanism pieces
    def _compute(self, plan: StepPlan, r: Request, n: int) -> None:
        have = self.bm.seqs[r.rid].num_tokens if r.rid in self.bm.seqs else 0
        assert have == r.num_computed, (r.rid, have, r.num_computed)
        self.bm.append(r.rid, n)
        plan.chunks[r] = n
        self._budget -= n

    def _unschedule(self, plan: StepPlan, r: Request) -> None:
        """Take r back out of this step: its tokens return to the budget, its new blocks free."""
        n = plan.chunks.pop(r, 0)
        if n:
            self.bm.shrink(r.rid, n)
            self._budget += n

    def _preempt(self, plan: StepPlan, r: Request, now: float) -> None:
        """Reactive preemption: rotate r out if the policy swaps and r can go, else recompute."""
        self._unschedule(plan, r)
        e = self.bm.swap_out_effect(r.rid)
        if (self.policy.swaps and e.host_need <= self.bm.host.num_free and e.copies <= self._xfer
                and self.bm.num_blocks(r.rid) <= self._cap):
            self.rotate_out(plan, r)  # it must be able to come back within one step's B_xfer
        else:  # no host room or transfer budget: recompute, never stall
            self.bm.free(r.rid)
            self.running.remove(r)
            self.waiting.append(r)
            r.status, r.num_computed, r.t_queued = Status.WAITING, 0, now
            r.recomputes += 1
            plan.preempted.append(r.rid)

    def rotate_out(self, plan: StepPlan, r: Request, for_rid: str | None = None,
                   proactive: bool = False) -> None:
        """Park r's KV on host. Reactive (a running request needs the room) unless proactive;
        for_rid names the candidate the room is for."""
        self._unschedule(plan, r)
        pairs = self.bm.swap_out(r.rid)
        self._xfer -= len(pairs)
        plan.swap_out += pairs
        self.running.remove(r)
        self.rotary.append(r)
        r.status, r.t_queued = Status.ROTARY, plan.now
        r.rotations += 1
        plan.rotated_out.append(r.rid)
        if proactive:
            plan.proactive.append(r.rid)
        if for_rid is not None:
            plan.rotated_for[r.rid] = for_rid

    def _hold_new(self, r: Request) -> bool:
        """Admission control: hold new requests back while host KV is nearly full."""
        return (self.policy.swaps and r.num_computed == 0 and self.bm.host.capacity > 0
                and self.bm.usage("host") > self.cfg.host_admit_limit)

    def _partial_prefill(self, plan: StepPlan) -> bool:
        """Some policies (the released one's vLLM V1) allow one unfinished prefill per step."""
        return self.policy.one_partial_prefill and any(
            r.num_computed + n < r.num_tokens for r, n in plan.chunks.items())

    def fits_all(self, requests: list[Request]) -> bool:
        """Could free device blocks hold what every one of these requests needs next?"""
        need = sum(self.bm.new_blocks_needed(r.rid, r.num_tokens - r.num_computed)
                   if r.status is Status.RUNNING else self.blocks_needed(r) for r in requests)
        return need <= self.bm.num_free

    def _write_back(self, plan: StepPlan) -> None:
        """Step 3 (DuplexKV): copy full blocks to their host mirrors, so a later rotation out
        copies only what is still dirty. Host room for rotations is kept in reserve."""
        if not self.policy.duplex:
            return
        capped = self._cap < math.inf
        reserve = int((1 - self.cfg.host_admit_limit) * self.bm.host.capacity) if capped else 0
        for r in self.running:
            if self._xfer <= 0:
                return
            # full blocks of what earlier steps computed (this step's tokens are not written yet)
            pairs = self.bm.writeback(r.rid, r.num_computed, self._xfer, reserve)
            plan.swap_out += pairs
            plan.written_back += len(pairs)
            self._xfer -= len(pairs)

    def _check(self, plan: StepPlan) -> None:
        cfg = self.cfg
        assert plan.num_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(self.running) <= cfg.max_num_seqs, "batch too large"
        assert plan.blocks_moved <= self._cap, "transfer budget exceeded"
        for r, n in plan.chunks.items():
            assert r.status is Status.RUNNING and n > 0 and r.num_computed + n <= r.num_tokens

    def update(self, plan: StepPlan, sampled: dict[str, int], now: float) -> list[Request]:
        """Apply a step's results: KV computed, one token sampled for each request that finished
        its chunk at the end of its tokens. Returns the requests that finished."""
        finished, stopped = [], []
        for r, n in plan.chunks.items():
            if r.status is not Status.RUNNING:
                continue  # aborted while the step ran
            r.num_computed += n
            full = r.num_computed // self.bm.block_size
            if self.cfg.prefix_caching != "off" and full > len(self.bm.seq(r.rid).hashes):
                self.bm.cache(r.rid, self.hashes(r, full))  # index the blocks this step filled
            if r.num_computed < r.num_tokens:
                continue  # a prefill chunk: no token yet
            tok = sampled[r.rid]
            r.output.append(tok)
            self.num_generated += 1
            r.token_times.append(now)
            r.t_last_token = now
            r.tokens_since_admit += 1
            if tok in r.stop_ids:
                self._finish(r, Status.FINISHED, "stop")
                stopped.append(r.rid)
            elif len(r.output) >= r.max_tokens:
                self._finish(r, Status.FINISHED, "length")
            else:
                continue
            finished.append(r)
        if self.num_generated >= WINDOW:  # a long-running server's calm hours must not pay
            self.num_generated, self.num_stalls = (  # for stalls under load
                self.num_generated // 2, self.num_stalls // 2)
        tokens = {r.rid: sampled[r.rid] for r in plan.chunks if r.rid in sampled}
        self._log(event="step", step=self.num_steps - 1, now=plan.now, done=now,
                  landed=plan.landed, **plan.decisions(), stopped=stopped,
                  **({"sampled": tokens} if self.cfg.prefix_caching != "off" else {}))
        return finished

    def _identity(self, r: Request) -> dict:
        """What a replay needs to find r's cached prefixes: its tokens (the step records carry
        the sampled ones) or the block hashes it was given."""
        if self.cfg.prefix_caching == "off":
            return {}
        return {"prompt": r.prompt} if r.prompt is not None else {"hashes": r.hashes}

    def _log(self, **record) -> None:
        if self.log:
            self.log.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.log:
            self.log.close()
            self.log = None
