"""kv.py: block accounting invariants, bitwise swap round trips, duplex safety, errors."""
import random
from collections import OrderedDict, deque

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kv import (BlockManager, DuplexCopier, KVError, KVPools, blocks_for_budget, copy_merged,
                copy_per_layer, merge_runs)


class Accounting(RuleBasedStateMachine):
    """Random appends, write-backs, rotations and frees; fences released at random times."""

    @initialize(dev=st.integers(1, 24), host=st.integers(0, 24), bs=st.integers(1, 5), duplex=st.booleans())
    def setup(self, dev, host, bs, duplex):
        self.bm = BlockManager(dev, host, bs, duplex=duplex)
        self.next_id = 0
        # device blocks read by copies not yet confirmed done (only duplex copies run beside compute;
        # without duplex, compute waits for every copy and blocks are reusable at once)
        self.in_flight_sources = set()

    def running(self):
        return [r for r, s in self.bm.seqs.items() if not s.on_host]

    def parked(self):
        return [r for r, s in self.bm.seqs.items() if s.on_host]

    @rule(n=st.integers(1, 12))
    def add(self, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        if self.bm.new_blocks_needed(rid, n) <= self.bm.device.num_free:
            new = self.bm.append(rid, n)
            assert not set(new) & self.in_flight_sources, "allocated a block that a copy still reads"

    @rule(data=st.data(), n=st.integers(1, 6))
    def grow(self, data, n):
        run = self.running()
        if run:
            rid = data.draw(st.sampled_from(run))
            if self.bm.new_blocks_needed(rid, n) <= self.bm.device.num_free:
                new = self.bm.append(rid, n)
                assert not set(new) & self.in_flight_sources

    @rule(data=st.data(), limit=st.integers(0, 4), reserve=st.integers(0, 3))
    def writeback(self, data, limit, reserve):
        run = self.running()
        if run:
            rid = data.draw(st.sampled_from(run))
            pairs = self.bm.writeback(rid, self.bm.seqs[rid].num_tokens, limit, reserve)
            assert len(pairs) <= limit and (self.bm.duplex or not pairs)
            self.in_flight_sources |= {s for s, _ in pairs}

    @rule(data=st.data())
    def swap_out(self, data):
        run = self.running()
        if run:
            rid = data.draw(st.sampled_from(run))
            drop = data.draw(st.integers(0, self.bm.seq(rid).num_tokens - 1))
            e = self.bm.swap_out_effect(rid, drop)  # what shrinking then swapping out will do
            if e.host_need <= self.bm.host.num_free:
                free_before, host_before = self.bm.num_free, self.bm.host.num_free
                self.bm.shrink(rid, drop)
                before = list(self.bm.block_table(rid))
                pairs = self.bm.swap_out(rid)
                assert len(pairs) == e.copies and {s for s, _ in pairs} <= set(before)
                assert self.bm.num_free - free_before == e.room, "room predicted wrongly"
                assert host_before - self.bm.host.num_free == e.host_need
                if self.bm.duplex:
                    self.in_flight_sources |= {s for s, _ in pairs}

    @rule(data=st.data())
    def swap_in(self, data):
        parked = self.parked()
        if parked:
            rid = data.draw(st.sampled_from(parked))
            if self.bm.blocks_for(self.bm.seqs[rid].num_tokens) <= self.bm.device.num_free:
                pairs = self.bm.swap_in(rid)
                assert not {d for _, d in pairs} & self.in_flight_sources, "swap-in aliases an in-flight source"

    @rule(data=st.data())
    def free(self, data):
        if self.bm.seqs:
            self.bm.free(data.draw(st.sampled_from(sorted(self.bm.seqs))))

    @rule()
    def copies_complete(self):
        self.bm.next_epoch()
        self.bm.copies_done()
        self.in_flight_sources.clear()

    @invariant()
    def consistent(self):
        if hasattr(self, "bm"):
            self.bm.check()

    def teardown(self):
        if hasattr(self, "bm"):
            for rid in list(self.bm.seqs):
                self.bm.free(rid)
            self.bm.copies_done()
            assert self.bm.device.num_free == self.bm.device.capacity, "device blocks leaked"
            assert self.bm.host.num_free == self.bm.host.capacity, "host blocks leaked"


TestAccounting = Accounting.TestCase
TestAccounting.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@settings(max_examples=40, deadline=None)
@given(bs=st.integers(1, 8), layers=st.integers(1, 4), kvh=st.integers(1, 3), hd=st.sampled_from([2, 4, 8]),
       lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), duplex=st.booleans(), seed=st.integers(0, 999))
def test_swap_out_then_in_restores_bytes(bs, layers, kvh, hd, lens, duplex, seed):
    """Rotate requests out and back in (with write-backs in between) and compare every KV byte."""
    rng = random.Random(seed)
    shape = (layers, 2, bs, kvh, hd)
    need = sum(-(-n // bs) for n in lens)
    bm = BlockManager(need + 4, need + 4, bs, duplex=duplex)
    pools = KVPools(need + 4, need + 4, shape, torch.float32, "cpu")
    copier = DuplexCopier(pools, duplex=duplex)
    rng_ids = list(range(need + 4))
    rng.shuffle(rng_ids)
    bm.device.free = OrderedDict.fromkeys(rng_ids)  # scattered physical ids
    rids = [f"r{i}" for i in range(len(lens))]
    for rid, n in zip(rids, lens):
        first = rng.randint(1, n)
        for chunk in (first, n - first):
            if chunk:
                old = bm.seqs[rid].num_tokens if rid in bm.seqs else 0
                bm.append(rid, chunk)
                for b in bm.block_table(rid)[old // bs:]:
                    pools.device[b].normal_()  # "compute" writes the blocks its new tokens land in
                pairs = bm.writeback(rid, bm.seqs[rid].num_tokens, limit=3)
                copier.submit(bm.next_epoch(), pairs, [])
                bm.copies_done(copier.completed_epoch())
    snap = {rid: pools.device[bm.block_table(rid)].clone() for rid in rids}
    for rid in rids:
        pairs = bm.swap_out(rid)  # plan in the current epoch, then close it
        copier.submit(bm.next_epoch(), pairs, [])
        bm.copies_done(copier.completed_epoch())
    # others reuse part of the device pool meanwhile (a free block is written only once it is
    # handed out again); the blocks nobody took still hold their KV and come back without a copy
    other = bm.device.allocate("other", rng.randint(0, bm.device.num_free))
    pools.device[other].normal_()
    bm.device.release("other", other)
    for rid in reversed(rids):
        pairs = bm.swap_in(rid)
        copier.submit(bm.next_epoch(), [], pairs)
        bm.copies_done(copier.completed_epoch())
        got = pools.device[bm.block_table(rid)]
        assert torch.equal(got.view(torch.int32), snap[rid].view(torch.int32)), "KV bytes changed"
    bm.check()


def test_rotate_out_copies_only_dirty_blocks():
    bm = BlockManager(8, 8, 4)
    bm.append("a", 10)                                   # 3 blocks, last one partial
    assert len(bm.writeback("a", 10, limit=10)) == 2     # the two full blocks
    e = bm.swap_out_effect("a")
    assert (e.host_need, e.copies) == (1, 1)             # one more host block, one copy
    pairs = bm.swap_out("a")
    assert len(pairs) == 1
    bm.next_epoch()
    bm.copies_done()
    bm.swap_in("a")
    bm.append("a", 1)                                    # dirties only the partial block
    e = bm.swap_out_effect("a")
    assert (e.host_need, e.copies) == (0, 1)


def test_a_parked_request_takes_back_the_device_blocks_nobody_reused():
    bm = BlockManager(8, 8, 4)
    bm.append("a", 10)                                   # device blocks 0, 1, 2
    bm.swap_out("a")
    bm.next_epoch()
    bm.copies_done()
    assert bm.device.num_free == 8 and bm.swap_in_copies("a") == 0
    assert bm.swap_in("a") == [] and bm.block_table("a") == [0, 1, 2]  # nothing to copy
    bm.swap_out("a")
    bm.next_epoch()
    bm.copies_done()
    bm.append("b", 24)            # the 6 oldest free blocks: 3..7, then 2 (a freed its tail first)
    bm.free("b")                                         # block 2 was written by b meanwhile
    assert bm.swap_in_copies("a") == 1
    pairs = bm.swap_in("a")                              # into the oldest free block: 2 again
    assert pairs == [(bm.seqs["a"].host_blocks[2], 2)] and bm.block_table("a") == [0, 1, 2]
    bm.check()


def test_a_finished_request_leaves_nothing_to_take_back():
    """Its kept blocks are forgotten, so a later request of the same id copies everything."""
    bm = BlockManager(8, 8, 4)
    bm.append("a", 8)
    bm.swap_out("a")
    bm.next_epoch()
    bm.copies_done()
    bm.free("a")
    assert not bm.device.kept
    bm.append("a", 8)
    bm.writeback("a", 8, limit=8)
    bm.check()


def test_preallocation_takes_spare_blocks_and_parks_only_the_used_ones():
    bm = BlockManager(16, 16, 4, prealloc=4)
    bm.append("a", 5)                                    # 2 blocks needed, 4 more taken
    assert len(bm.block_table("a")) == 6 and bm.new_blocks_needed("a", 15) == 0
    assert len(bm.swap_out("a")) == 2                    # the spare blocks hold nothing
    bm.next_epoch()
    bm.copies_done()
    assert bm.device.num_free == 16
    bm.swap_in("a")
    assert len(bm.block_table("a")) == 2
    bm.check()


def test_fenced_blocks_not_reused_until_copy_done():
    bm = BlockManager(2, 4, 4)
    bm.append("a", 8)
    out = bm.swap_out("a")
    assert {s for s, _ in out} == {0, 1}
    assert bm.device.num_free == 0 and bm.new_blocks_needed("b", 1) == 1  # nothing to hand out yet
    with pytest.raises(KVError, match="device pool"):
        bm.append("b", 1)
    bm.copies_done(bm.next_epoch())
    assert bm.device.num_free == 2
    bm.check()


def test_merge_runs():
    assert merge_runs([(3, 7), (1, 5), (2, 6), (9, 0)]) == [(1, 5, 3), (9, 0, 1)]
    assert merge_runs([(1, 1), (2, 3)]) == [(1, 1, 1), (2, 3, 1)]


def test_per_layer_and_merged_copy_agree():
    src = torch.randn(6, 3, 2, 4, 2, 8)
    a, b = torch.zeros_like(src), torch.zeros_like(src)
    pairs = [(0, 2), (1, 3), (5, 0)]
    assert copy_merged(src, a, pairs) == 2
    assert copy_per_layer(src, b, pairs) == 3 * 3 * 2
    assert torch.equal(a, b)


def test_bad_input_errors():
    bm = BlockManager(4, 4, 4)
    with pytest.raises(KVError, match="unknown request 'x'"):
        bm.free("x")
    bm.append("a", 4)
    bm.free("a")
    with pytest.raises(KVError, match="freed twice"):
        bm.free("a")
    with pytest.raises(KVError, match="unknown request"):
        bm.swap_out("nope")
    with pytest.raises(KVError, match="block_size"):
        BlockManager(4, 4, 0)
    with pytest.raises(KVError, match="capacity"):
        BlockManager(-1, 4, 4)
    with pytest.raises(KVError, match="holds no block"):
        blocks_for_budget(100, (30, 2, 16, 3, 64), torch.float32, torch.device("cpu"))
    with pytest.raises(KVError, match="fraction"):
        blocks_for_budget(1.5, (30, 2, 16, 3, 64), torch.float32, torch.device("cpu"))
    with pytest.raises(KVError, match="device pool"):
        bm.append("big", 17)
    assert "big" not in bm.seqs                 # a failed append leaves nothing behind
    bm.append("a", 4)
    with pytest.raises(KVError, match="device pool"):
        bm.append("a", 16)
    assert bm.seq("a").num_tokens == 4 and len(bm.block_table("a")) == 1


def test_budget_sizing():
    shape = (2, 2, 4, 1, 8)
    assert blocks_for_budget(10 * 2 * 2 * 4 * 8 * 4, shape, torch.float32, torch.device("cpu")) == 10
    assert blocks_for_budget(0.001, shape, torch.float32, torch.device("cpu")) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_duplex_round_trip():
    shape = (4, 2, 16, 2, 64)
    pools = KVPools(64, 64, shape, torch.float16, "cuda")
    assert pools.host.is_pinned()
    pools.device.normal_()
    copier = DuplexCopier(pools)
    snap = pools.device[:32].clone()
    copier.submit(0, list(zip(range(32), range(32))), [])
    copier.submit(1, [], list(zip(range(32), range(32, 64))))
    copier.synchronize()
    assert torch.equal(pools.device[32:64], snap)
    assert copier.completed_epoch() == 1
