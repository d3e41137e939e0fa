"""DuplexKV ordering, checked on a CPU with deferred streams (tests/deferred.py).

Copies run as late as their declared waits allow and in the worst interleaving we can pick, so
a missing wait shows as wrong bytes or as compute touching a block a copy still uses."""
import random

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from deferred import DeferredStreams
from kv import IN, OUT, BlockManager, DuplexCopier, KVPools

SHAPE = (2, 2, 4, 1, 4)  # layers, K/V, block_size, kv heads, head dim


def rig(dev=8, host=8, duplex=True, prefer=IN):
    bm = BlockManager(dev, host, SHAPE[2], duplex=duplex)
    pools = KVPools(dev, host, SHAPE, torch.float32, "cpu")
    streams = DeferredStreams(prefer=prefer)
    return bm, pools, DuplexCopier(pools, duplex=duplex, streams=streams), streams


def write(pools, bm, rid):
    """Compute writes fresh KV into every device block of rid; returns what it wrote."""
    blocks = bm.block_table(rid)
    pools.device[blocks] = torch.randn(len(blocks), *SHAPE)
    return pools.device[blocks].clone()


def step(bm, copier, out=(), into=()):
    """One engine step's copies: plan, close the epoch, submit (compute waits for its inputs)."""
    bm.copies_done(copier.completed_epoch())
    copier.submit(bm.next_epoch(), list(out), list(into))


def drain(streams, first):
    """Run the `first` stream as far as its waits allow before the other: the worst order."""
    streams.run_ahead(first)
    streams.synchronize()


def test_swap_in_waits_for_an_older_swap_out_across_an_idle_epoch():
    """Hazard 1: a swap-in two epochs after its swap-out, with an epoch of no copies between."""
    bm, pools, copier, streams = rig()
    bm.append("a", 8)
    want = write(pools, bm, "a")
    step(bm, copier, out=bm.swap_out("a"))      # epoch 0: a's blocks go to host
    step(bm, copier)                             # epoch 1: nothing to copy
    step(bm, copier, into=bm.swap_in("a"))       # epoch 2: a comes back
    drain(streams, first=IN)
    assert torch.equal(pools.device[bm.block_table("a")], want)


def test_v0_swap_in_waits_for_the_same_steps_swap_out():
    """Hazard 2: without DuplexKV's fences a victim's blocks are free at once, so the same step
    can swap another request into them: the swap-in must wait for the victim's swap-out."""
    bm, pools, copier, streams = rig(dev=2, host=8, duplex=False)
    bm.append("b", 8)
    want_b = write(pools, bm, "b")
    step(bm, copier, out=bm.swap_out("b"))
    copier.synchronize()                         # b parked on host, its blocks free
    bm.append("a", 8)
    want_a = write(pools, bm, "a")
    out = bm.swap_out("a")                       # same step: a out, b into a's blocks
    step(bm, copier, out=out, into=bm.swap_in("b"))
    drain(streams, first=IN)
    assert torch.equal(pools.device[bm.block_table("b")], want_b)
    step(bm, copier, out=bm.swap_out("b"))
    copier.synchronize()
    step(bm, copier, into=bm.swap_in("a"))
    copier.synchronize()
    assert torch.equal(pools.device[bm.block_table("a")], want_a), "a's KV was overwritten"


def test_compute_waits_for_a_swap_in_whose_request_was_aborted():
    """Hazard 5: a request is aborted while its swap-in is in flight; its device blocks go to a
    new request whose forward must not race the late copy, and its host blocks to a new
    write-back that must not overwrite them before the swap-in has read them."""
    bm, pools, copier, streams = rig(dev=2, host=2)
    bm.append("b", 8)
    write(pools, bm, "b")
    step(bm, copier, out=bm.swap_out("b"))
    copier.synchronize()
    bm.copies_done(copier.completed_epoch())
    step(bm, copier, into=bm.swap_in("b"))       # b's swap-in is queued, not yet run
    bm.free("b")                                 # ... and b is aborted
    bm.append("c", 8)                            # c gets b's device and host blocks
    step(bm, copier)
    streams.check_compute("device", bm.block_table("c"), "w")
    want_c = write(pools, bm, "c")
    step(bm, copier, out=bm.writeback("c", 8, limit=2))
    drain(streams, first=OUT)
    assert torch.equal(pools.device[bm.block_table("c")], want_c)
    assert torch.equal(pools.host[bm.seq("c").host_blocks], want_c)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streams_live_on_the_pools_device():
    """Hazard 3: streams and events belong to the pools' device, not the current one."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    pools = KVPools(4, 4, SHAPE, torch.float16, dev)
    copier = DuplexCopier(pools)
    assert all(s.device == dev for s in copier.streams.streams.values())


def test_v0_host_blocks_freed_by_a_swap_in_are_not_reused_in_the_same_step():
    """Hazard 5 on the host side: vLLM v0 frees a request's host blocks when it is swapped in;
    the same step must not hand them to a swap-out while the swap-in may still read them."""
    bm, pools, copier, streams = rig(dev=6, host=4, duplex=False, prefer=OUT)
    for rid in ("b", "z"):
        bm.append(rid, 8)
        write(pools, bm, rid)
        step(bm, copier, out=bm.swap_out(rid))
    copier.synchronize()                         # b and z fill the host pool
    bm.append("a", 8)
    write(pools, bm, "a")
    want_b = pools.host[bm.seq("b").host_blocks].clone()
    into = bm.swap_in("b")
    out = bm.swap_out("a") if bm.swap_out_effect("a").host_need <= bm.host.num_free else []
    step(bm, copier, out=out, into=into)
    drain(streams, first=OUT)
    assert torch.equal(pools.device[bm.block_table("b")], want_b)


class Rotations(RuleBasedStateMachine):
    """Many steps of growth, write-backs, rotations, aborts and finishes, with the copy streams
    run late and interleaved at random. Whenever a request computes, its device blocks must hold
    exactly the bytes its earlier steps wrote; no new block may still be read by a queued copy."""

    @initialize(duplex=st.booleans(), overlap=st.booleans(), seed=st.integers(0, 2**16),
                prefer=st.sampled_from([IN, OUT, None]))
    def setup(self, duplex, overlap, seed, prefer):
        self.duplex = duplex
        self.rng = random.Random(seed)
        self.bm = BlockManager(10, 14, SHAPE[2], duplex=duplex)
        self.pools = KVPools(10, 14, SHAPE, torch.float32, "cpu")
        self.streams = DeferredStreams(self.rng, prefer)
        self.copier = DuplexCopier(self.pools, duplex=duplex, streams=self.streams, overlap=overlap)
        self.want: dict[str, torch.Tensor] = {}   # rid -> expected KV of its logical blocks
        self.next_id = 0

    def compute(self, rid, n):
        """rid's forward: read every block it has (check), then write the blocks of n new tokens."""
        bm, bs = self.bm, SHAPE[2]
        table = bm.block_table(rid)
        old = bm.seq(rid).num_tokens - n
        if old:
            self.streams.check_compute("device", table, "r")
            have = self.pools.device[table[:bm.blocks_for(old)]]
            assert torch.equal(have, self.want[rid][:len(have)]), f"{rid}: KV bytes changed"
        new = table[old // bs:bm.blocks_for(old + n)]
        self.streams.check_compute("device", new, "w")
        data = torch.randn(len(new), *SHAPE)
        self.pools.device[new] = data
        self.want[rid] = torch.cat([self.want.get(rid, data[:0])[:old // bs], data])

    def fresh(self, blocks):
        if self.duplex:  # fences: no block handed out may still be read by a queued copy
            pending = {b for t, b, m in self.streams.pending() if t == "device" and m == "r"}
            assert not pending & set(blocks), "a fenced block was handed out early"

    @rule(data=st.data())
    def step(self, data):
        bm = self.bm
        bm.copies_done(self.copier.completed_epoch())
        running = [r for r, s in bm.seqs.items() if not s.on_host]
        parked = [r for r, s in bm.seqs.items() if s.on_host]
        out, into, computes, joined = [], [], [], set()
        for rid in running:
            action = data.draw(st.sampled_from(["grow", "grow", "out", "finish", "idle"]))
            if action == "grow":
                n = data.draw(st.integers(1, 5))
                if bm.new_blocks_needed(rid, n) <= bm.num_free:
                    self.fresh(bm.append(rid, n))
                    computes.append((rid, n))
            elif action == "out" and bm.swap_out_effect(rid).host_need <= bm.host.num_free:
                out += bm.swap_out(rid)
            elif action == "finish":
                bm.free(rid)
                del self.want[rid]
        for rid in parked:
            if data.draw(st.booleans()) and bm.num_blocks(rid) <= bm.num_free:
                pairs = bm.swap_in(rid)
                self.fresh([d for _, d in pairs])
                into += pairs
                joined.add(rid)
        if data.draw(st.booleans()):
            rid, n = f"r{self.next_id}", data.draw(st.integers(1, 12))
            self.next_id += 1
            if bm.new_blocks_needed(rid, n) <= bm.num_free:
                self.fresh(bm.append(rid, n))
                computes.append((rid, n))
        step_tokens = dict(computes)
        for rid, s in bm.seqs.items():  # write back what earlier steps computed
            if not s.on_host and rid not in joined:
                done = s.num_tokens - step_tokens.get(rid, 0)
                out += bm.writeback(rid, done, limit=data.draw(st.integers(0, 3)))
        self.copier.submit(bm.next_epoch(), out, into)
        if not self.copier.overlap:  # a swapped-in request computes in the same step
            computes += [(rid, 0) for rid in joined]
        for rid, n in computes:
            if n:
                self.compute(rid, n)
            else:
                self.streams.check_compute("device", bm.block_table(rid), "r")
        self.streams.advance()

    @rule(data=st.data())
    def abort(self, data):
        if self.bm.seqs:
            rid = data.draw(st.sampled_from(sorted(self.bm.seqs)))
            self.bm.free(rid)
            del self.want[rid]

    @invariant()
    def consistent(self):
        if hasattr(self, "bm"):
            self.bm.check()

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        self.copier.synchronize()
        bm = self.bm
        bm.copies_done(self.copier.completed_epoch())
        for rid in list(bm.seqs):
            if bm.seq(rid).on_host:
                if bm.num_blocks(rid) > bm.num_free:
                    continue
                self.copier.submit(bm.next_epoch(), [], bm.swap_in(rid))
                self.copier.synchronize()
            got = self.pools.device[bm.block_table(rid)[:bm.num_blocks(rid)]]
            assert torch.equal(got, self.want[rid]), f"{rid}: KV bytes changed after rotations"


TestRotations = Rotations.TestCase
TestRotations.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_a_delayed_out_stream_cannot_corrupt_a_swap_in(overlap):
    """Real streams, with the out stream held back by a long kernel: a swap-in of the same
    request two epochs later (an idle epoch between) must still read what the swap-out wrote."""
    shape = (4, 2, 16, 2, 64)
    bm = BlockManager(8, 8, 16)
    pools = KVPools(8, 8, shape, torch.float32, "cuda")
    copier = DuplexCopier(pools, overlap=overlap)
    bm.append("a", 64)
    pools.device[bm.block_table("a")] = torch.randn(4, *shape, device="cuda")
    want = pools.device[bm.block_table("a")].clone()
    with torch.cuda.stream(copier.streams.streams[OUT]):
        torch.cuda._sleep(500_000_000)  # ~0.3 s of spinning before the swap-out can run
    step(bm, copier, out=bm.swap_out("a"))
    step(bm, copier)
    bm.copies_done(copier.completed_epoch())   # a's old blocks may still be fenced: others serve
    step(bm, copier, into=bm.swap_in("a"))
    torch.cuda.synchronize()
    assert torch.equal(pools.device[bm.block_table("a")], want)
