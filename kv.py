"""Two-tier paged KV cache: block accounting, the tensor pools, and the DuplexKV copier.

BlockManager is pure Python (no tensors), so the scheduler, the simulator and the property tests
share it. A request's blocks live on one tier: its device block table while RUNNING, its host
blocks while ROTARY. With `duplex=True` (DuplexKV) copies run beside compute: a request keeps
host copies of its full device blocks, written back eagerly in the background, so rotating out
copies only the blocks that are still dirty; and a device block that is the source of a copy
still in flight is *fenced* (freed, but not handed out until the copy is known to be done), so
a swap-in destination never aliases an in-flight swap-out source. With `duplex=False` (vLLM v0)
compute waits for every copy, so freed blocks are reusable at once and nothing is mirrored.

The copier reaches streams and events only through a Streams object: CudaStreams on a GPU,
SyncStreams on a CPU (copies happen at once), or a test's deferred streams that run copies
late, in any order the declared waits allow. A Runner is one process's pools, copier and model:
it launches a step's copies both ways, then the forward over the pools.
"""
from __future__ import annotations

import math
import mmap
import os
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from model import Llama, Seq, make_batch

Pairs = list[tuple[int, int]]  # (source block, destination block)


class KVError(ValueError):
    """Misuse of the block accounting: unknown request, double free, a budget that cannot fit."""


class BlockPool:
    """One tier's blocks. A used block has a reference count (requests that share a cached
    prefix share its blocks); free blocks are kept oldest first, so a freed block is handed out
    as late as possible, because it may still hold KV worth having:
    - a cached block: a full block of some prefix, found by its hash (`block_of`) until the
      block is handed out again; shared blocks are full, so they are never written;
    - a kept block: the KV of the request that parked it there (`kept`), which may take it back
      without a copy (its last block is not full, so it has no hash)."""

    def __init__(self, name: str, capacity: int, caching: bool = False):
        if capacity < 0:
            raise KVError(f"{name} pool: capacity must be >= 0, got {capacity}")
        self.name, self.capacity, self.caching = name, capacity, caching
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity))
        self.refs: dict[int, int] = {}               # used block -> requests holding it
        self.kept: dict[int, tuple[str, int]] = {}  # free block -> (rid, index) it still holds
        self.block_of: dict[int, int] = {}          # hash -> the block holding that prefix block
        self.hash_of: dict[int, int] = {}           # the same, block -> hash

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.refs)

    def allocate(self, rid: str, n: int) -> list[int]:
        """n blocks for rid, oldest free first: whatever they cached is forgotten."""
        if n > len(self.free):
            raise KVError(f"{self.name} pool: {rid} asks for {n} blocks, {len(self.free)} free")
        blocks = [self.free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self.refs[b] = 1
            self.kept.pop(b, None)
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.block_of[h]
        return blocks

    def share(self, b: int) -> None:
        """One more holder of cached block b, in use or free (a free one leaves the free list)."""
        if b in self.free:
            del self.free[b]
        self.kept.pop(b, None)  # free or fenced: the parked request finds it by its hash
        self.refs[b] = self.refs.get(b, 0) + 1

    def reclaim(self, rid: str, b: int, index: int) -> bool:
        """Take back free block b if it still holds rid's block `index`."""
        if self.kept.get(b) != (rid, index) or b not in self.free:
            return False
        del self.free[b], self.kept[b]
        self.refs[b] = 1
        return True

    def release(self, rid: str, blocks: list[int], keep: set[int] = frozenset()) -> list[int]:
        """rid lets go of blocks; returns those nobody holds now, which go to the free list
        (those in `keep` stay off it: the caller fences them). The last block goes first, so
        a prefix's tail is handed out before its head (a head serves more prompts)."""
        freed = []
        for b in reversed(blocks):
            if self.refs.get(b, 0) < 1:
                raise KVError(f"{self.name} pool: block {b} freed by {rid} but not in use")
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                freed.append(b)
                if b not in keep:
                    self.free[b] = None
        return freed

    def forget(self, rid: str, blocks: list[int]) -> None:
        for b in blocks:
            if self.kept.get(b, ("",))[0] == rid:
                del self.kept[b]

    def cache(self, b: int, h: int) -> None:
        """Block b holds the full prefix block whose hash is h (the first block to hold it
        stays the one found)."""
        if self.caching and h not in self.block_of and b not in self.hash_of:
            self.block_of[h], self.hash_of[b] = b, h

    def lookup(self, h: int) -> int | None:
        return self.block_of.get(h)


@dataclass(slots=True)
class SeqKV:
    block_table: list[int] = field(default_factory=list)  # device blocks (empty while on host)
    host_blocks: list[int] = field(default_factory=list)  # host mirrors of blocks [0, len)
    num_tokens: int = 0                                    # tokens that have a KV slot
    num_clean: int = 0        # logical blocks [0, num_clean) equal their host copy
    on_host: bool = False
    kept: list[int] = field(default_factory=list)         # device blocks it had when parked
    hashes: list[int] = field(default_factory=list)       # of its full blocks, as indexed


@dataclass(slots=True)
class Placement:
    """Where a request's first blocks come from when it starts or comes back to the device:
    block i from device[i] (a block that holds it: kept, or cached by its hash) or, where that
    is None, copied from host[i]; blocks after these are new. It costs `room` free device
    blocks (the new ones, and cached blocks taken off the free list; a block in use or fenced
    costs none) and `host_room` free host blocks (cached host blocks it takes as mirrors)."""
    device: list[int | None]
    host: list[int]
    room: int
    host_room: int = 0

    @property
    def copies(self) -> int:
        return self.device.count(None)


@dataclass(slots=True)
class SwapOutEffect:
    """What parking a request on host would do now: device blocks free at once, host blocks to
    allocate, blocks to copy."""
    room: int
    host_need: int
    copies: int


CACHING = ("off", "device", "both")  # prefix caching: none, the device tier, both tiers


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int,
                 duplex: bool = True, prealloc: int = 0, caching: str = "off"):
        if block_size <= 0:
            raise KVError(f"block_size must be positive, got {block_size}")
        if caching not in CACHING:
            raise KVError(f"prefix caching must be one of {', '.join(CACHING)}, got {caching!r}")
        self.block_size, self.duplex, self.prealloc = block_size, duplex, prealloc
        self.device = BlockPool("device", num_device_blocks, caching != "off")
        self.host = BlockPool("host", num_host_blocks, caching == "both")
        # blocks whose content a copy of this epoch is still writing: indexed when it closes,
        # so a request that takes them copies or reads them only after that copy (DuplexCopier)
        self.pending: list[tuple[BlockPool, int, int]] = []
        self.seqs: dict[str, SeqKV] = {}
        self.epoch = 0                   # copies planned now belong to this epoch
        self.busy: dict[int, int] = {}   # device block -> epoch of the last copy reading it
        self.fenced: set[int] = set()    # freed device blocks whose outgoing copy may be in flight
        self.host_fenced: list[int] = []  # v0: host blocks of this epoch's swap-ins, still read
        self.landed = -1                  # the latest epoch whose copies are known to be done

    # ------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Device blocks that can be handed out now."""
        return self.device.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def seq(self, rid: str) -> SeqKV:
        if rid not in self.seqs:
            raise KVError(f"unknown request {rid!r}")
        return self.seqs[rid]

    def block_table(self, rid: str) -> list[int]:
        return self.seq(rid).block_table

    def num_blocks(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return self.blocks_for(s.num_tokens) if s else 0

    def new_blocks_needed(self, rid: str, n: int) -> int:
        """Device blocks to allocate before rid's KV can grow by n tokens."""
        s = self.seqs.get(rid, SeqKV())
        return max(0, self.blocks_for(s.num_tokens + n) - len(s.block_table))

    def swap_out_effect(self, rid: str, drop_tokens: int = 0,
                        taken: set[int] = frozenset()) -> SwapOutEffect:
        """The effect of shrink(rid, drop_tokens) followed by swap_out(rid), without doing it.
        Blocks rid shares stay, and so do those in `taken` (a request starting takes them)."""
        s = self.seq(rid)
        keep = self.blocks_for(s.num_tokens - drop_tokens)
        clean = min(s.num_clean, keep)
        alone = {b for b in s.block_table if self.device.refs[b] == 1} - taken
        if self.duplex:  # dirty blocks, and blocks still read by copies, stay fenced for now
            alone -= {b for b in s.block_table if b in self.busy}
            alone -= set(s.block_table[clean:keep])
        return SwapOutEffect(len(alone), max(0, keep - len(s.host_blocks)), keep - clean)

    def usage(self, tier: str) -> float:
        pool = self.device if tier == "device" else self.host
        return pool.num_used / pool.capacity if pool.capacity else 1.0

    # ------------------------------------------------------------ growth and write-back
    def append(self, rid: str, n: int) -> list[int]:
        """Give rid KV slots for n more tokens on device; returns the newly allocated blocks."""
        s = self.seqs.get(rid, SeqKV())
        assert not s.on_host, f"{rid} is parked on host"
        need = self.blocks_for(s.num_tokens + n) - len(s.block_table)
        if need > 0:  # with preallocation a few more blocks than needed, as they are free
            need = max(need, min(need + self.prealloc, self.device.num_free))
        new = self.device.allocate(rid, need) if need > 0 else []  # raises before any change
        self.seqs[rid] = s
        s.block_table += new
        s.num_clean = min(s.num_clean, s.num_tokens // self.block_size)  # next token's block
        s.num_tokens += n
        return new

    def shrink(self, rid: str, n: int) -> None:
        """Take back the last n token slots (a step that will not run): free unneeded blocks."""
        s = self.seq(rid)
        assert not s.on_host and 0 <= n <= s.num_tokens, (rid, n, s.num_tokens)
        s.num_tokens -= n
        keep = self.blocks_for(s.num_tokens)
        self._free_device(rid, s.block_table[keep:])
        del s.block_table[keep:]
        s.num_clean = min(s.num_clean, keep)
        if not s.num_tokens and not s.host_blocks:
            del self.seqs[rid]

    def writeback(self, rid: str, computed_tokens: int, limit: int, reserve: int = 0) -> Pairs:
        """Plan copies of rid's full, dirty device blocks to their host mirror (at most `limit`
        blocks, leaving `reserve` host blocks free for rotations)."""
        s = self.seq(rid)
        full = min(computed_tokens, s.num_tokens) // self.block_size
        if not self.duplex or s.on_host or full <= s.num_clean:
            return []
        room = max(0, self.host.num_free - reserve)
        upto = s.num_clean
        while upto < full and upto - s.num_clean < limit and (upto < len(s.host_blocks) or room):
            if upto >= len(s.host_blocks):
                s.host_blocks += self.host.allocate(rid, 1)
                room -= 1
            upto += 1
        pairs = [(s.block_table[i], s.host_blocks[i]) for i in range(s.num_clean, upto)]
        self._mark_busy(pairs)
        self._index_later(self.host, s, range(s.num_clean, upto), s.host_blocks)
        s.num_clean = upto
        return pairs

    # ------------------------------------------------------------ rotation
    def swap_out(self, rid: str) -> Pairs:
        """Park rid on host: copy its dirty blocks, free (or fence) its device blocks. With
        DuplexKV the freed blocks keep rid's KV until they are handed out again."""
        s = self.seq(rid)
        assert not s.on_host, f"{rid} is already on host"
        s.host_blocks += self.host.allocate(rid, self.swap_out_effect(rid).host_need)
        n = self.blocks_for(s.num_tokens)
        pairs = [(s.block_table[i], s.host_blocks[i]) for i in range(s.num_clean, n)]
        self._mark_busy(pairs)
        self._index_later(self.host, s, range(s.num_clean, n), s.host_blocks)
        freed = set(self._free_device(rid, s.block_table))
        if self.duplex:
            s.kept = s.block_table[:n]
            self.device.kept.update((b, (rid, i)) for i, b in enumerate(s.kept) if b in freed)
        s.block_table, s.num_clean, s.on_host = [], n, True
        return pairs

    def swap_in_placement(self, rid: str) -> Placement:
        """Where parked rid's blocks would come from: those it left on the device and that are
        still there, blocks of its prefix cached on the device, and copies of the others."""
        s = self.seq(rid)
        device = []
        for i in range(self.blocks_for(s.num_tokens)):
            b = s.kept[i] if i < len(s.kept) else None
            if b is None or self.device.kept.get(b) != (rid, i) or b not in self.device.free:
                b = self.device.lookup(s.hashes[i]) if i < len(s.hashes) else None
            device.append(b)
        room = sum(1 for b in device if b is None or b in self.device.free)
        return Placement(device, s.host_blocks, room)

    def swap_in_copies(self, rid: str) -> int:
        """Blocks a swap-in of rid would copy."""
        return self.swap_in_placement(rid).copies

    def swap_in(self, rid: str) -> Pairs:
        """Bring rid back to device: blocks still on the device are taken as they are, the
        others copied; the host copy stays as its mirror."""
        s = self.seq(rid)
        assert s.on_host, f"{rid} is not on host"
        p = self.swap_in_placement(rid)
        for i, b in enumerate(p.device):
            if b is not None and not self.device.reclaim(rid, b, i):
                self._share(b)
        pairs = self._fill(rid, s, p)
        self.device.forget(rid, s.kept)
        s.on_host, s.num_clean, s.kept = False, len(p.device), []
        if not self.duplex:  # vLLM v0: host blocks are freed once swapped back in, and reused
            freed = self.host.release(rid, s.host_blocks, keep=set(s.host_blocks))  # after
            self.host_fenced += freed                                                # this epoch
            s.host_blocks, s.num_clean = [], 0
        return pairs

    def _fill(self, rid: str, s: SeqKV, p: Placement) -> Pairs:
        """s's block table from a placement whose device blocks are taken: new blocks where
        it has none, each a copy of its host block; returns those copies."""
        new = iter(self.device.allocate(rid, p.copies))
        s.block_table = [next(new) if b is None else b for b in p.device]
        copied = [i for i, b in enumerate(p.device) if b is None]
        self._index_later(self.device, s, copied, s.block_table)
        return [(p.host[i], s.block_table[i]) for i in copied]

    # ------------------------------------------------------------ prefix caching
    def prefix_placement(self, hashes: list[int], host_tier: bool = True) -> Placement:
        """Where a new request's cached prefix is: the longest run of its full blocks (hashes)
        each held on the device or in the longest run held on host (host_tier). It takes the
        host run as its mirrors and copies from it the blocks the device does not hold."""
        device = [self.device.lookup(h) for h in hashes]
        host = [self.host.lookup(h) if host_tier else None for h in hashes] + [None]
        host = host[:host.index(None)]
        n = max(len(host), device.index(None) if None in device else len(device))
        device = device[:n]
        room = sum(1 for b in device if b is None or b in self.device.free)
        return Placement(device, host, room, sum(1 for b in host if b in self.host.free))

    def start(self, rid: str, hashes: list[int], p: Placement) -> Pairs:
        """A new request takes its cached prefix (p, from prefix_placement(hashes)): returns
        the host -> device copies; it computes from the token after the prefix."""
        if rid in self.seqs:
            raise KVError(f"{rid} already holds blocks")
        if not p.device:
            return []
        for b in p.device:
            if b is not None:
                self._share(b)
        for b in p.host:
            if b in self.host_fenced:  # vLLM v0: its swap-in finished with it this epoch
                self.host_fenced.remove(b)
            self.host.share(b)
        s = self.seqs[rid] = SeqKV(host_blocks=list(p.host), num_clean=len(p.host),
                                   num_tokens=len(p.device) * self.block_size,
                                   hashes=hashes[:len(p.device)])
        return self._fill(rid, s, p)

    def cache(self, rid: str, hashes: list[int]) -> None:
        """rid's first len(hashes) blocks are full and computed: index the new ones."""
        s = self.seq(rid)
        for i in range(len(s.hashes), len(hashes)):
            s.hashes.append(hashes[i])
            self.device.cache(s.block_table[i], hashes[i])

    def _share(self, b: int) -> None:
        self.fenced.discard(b)  # still read by a copy out: it is fenced again if freed
        self.device.share(b)

    def _index_later(self, pool: BlockPool, s: SeqKV, indices, blocks: list[int]) -> None:
        self.pending += [(pool, blocks[i], s.hashes[i]) for i in indices if i < len(s.hashes)]

    def free(self, rid: str) -> None:
        """Drop every block of rid on both tiers (finish, abort or recompute-preemption)."""
        s = self.seqs.pop(rid, None)
        if s is None:
            raise KVError(f"free of unknown request {rid!r} (never allocated, or freed twice)")
        self.device.forget(rid, s.kept)
        self._free_device(rid, s.block_table)
        self.host.release(rid, s.host_blocks)

    # ------------------------------------------------------------ copy fences
    def _mark_busy(self, pairs: Pairs) -> None:
        if not self.duplex:
            return  # compute waits for these copies, so their sources are reusable at once
        for src, _ in pairs:
            self.busy[src] = self.epoch

    def _free_device(self, rid: str, blocks: list[int]) -> list[int]:
        """Let go of rid's device blocks; returns those nobody holds now (free, or fenced while
        a copy still reads them)."""
        held = {b for b in blocks if b in self.busy}
        freed = self.device.release(rid, blocks, keep=held)
        self.fenced.update(b for b in freed if b in held)
        return freed

    def next_epoch(self) -> int:
        """Close the current epoch of planned copies; returns the one just closed."""
        self.host.free.update(dict.fromkeys(self.host_fenced))  # v0: an epoch's copies land
        self.host_fenced = []                                    # before the next one
        for pool, b, h in self.pending:
            if b in pool.refs:
                pool.cache(b, h)
        self.pending = []
        self.epoch += 1
        return self.epoch - 1

    def copies_done(self, epoch: int | None = None) -> None:
        """Every copy planned in epochs <= epoch (all, if None) has completed."""
        self.landed = max(self.landed, self.epoch - 1 if epoch is None else epoch)
        if epoch is None:
            self.host.free.update(dict.fromkeys(self.host_fenced))
            self.host_fenced = []
        done = [b for b, e in self.busy.items() if epoch is None or e <= epoch]
        for b in done:
            del self.busy[b]
            if b in self.fenced:
                self.fenced.discard(b)
                self.device.free[b] = None

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        for pool in (self.device, self.host):
            free = set(pool.free)
            assert len(free) == len(pool.free), f"{pool.name}: a block is free twice"
            assert not free & set(pool.refs), f"{pool.name}: a block is both free and in use"
            assert all(pool.block_of[h] == b for b, h in pool.hash_of.items()), pool.name
            assert len(pool.block_of) == len(pool.hash_of), f"{pool.name}: hash index"
        fenced = self.fenced
        assert not fenced & set(self.device.free) and not fenced & set(self.device.refs)
        assert not set(self.device.kept) & set(self.device.refs), "a kept block is in use"
        assert self.device.num_free + self.device.num_used + len(fenced) == self.device.capacity
        host_used = self.host.num_used + len(self.host_fenced)
        assert self.host.num_free + host_used == self.host.capacity
        for rid, s in self.seqs.items():
            n = self.blocks_for(s.num_tokens)
            if s.on_host:
                assert not s.block_table and len(s.host_blocks) >= n, f"{rid}: parked, not on host"
            else:
                assert len(s.block_table) >= n, f"{rid}: running without blocks for its tokens"
                assert s.num_clean <= min(len(s.host_blocks), len(s.block_table)), rid
            assert len(s.hashes) <= s.num_tokens // self.block_size, f"{rid}: hash of a partial"
        # every reference is one request's block table or mirror: none lost, none made up
        held = Counter(b for s in self.seqs.values() for b in s.block_table)
        assert held == Counter(self.device.refs), "device reference counts"
        mirrors = Counter(b for s in self.seqs.values() for b in s.host_blocks)
        assert mirrors == Counter(self.host.refs), "host reference counts"


# ---------------------------------------------------------------- tensors

def block_bytes(block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.Size(block_shape).numel() * dtype.itemsize


def blocks_for_budget(budget: int | float, block_shape, dtype, device: torch.device) -> int:
    """Blocks that fit in `budget`: bytes (int) or a fraction (0, 1] of free device memory."""
    if isinstance(budget, float):
        if not 0 < budget <= 1:
            raise KVError(f"memory fraction must be in (0, 1], got {budget}")
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = int(free * budget)
    size = block_bytes(block_shape, dtype)
    if budget // size <= 0:
        raise KVError(f"a KV budget of {budget} bytes holds no block of {size} bytes")
    return budget // size


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """A CPU tensor of zeros in an anonymous memory mapping, which the OS fills with zeros page
    by page on first touch: the blocks a run never uses cost no memory (torch.zeros writes them
    all up front)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVPools:
    """Device and host pools, both (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str):
        device = torch.device(device)
        for name, n in (("num_device_blocks", num_device_blocks),
                        ("num_host_blocks", num_host_blocks)):
            if n < 0:
                raise KVError(f"{name} must be >= 0, got {n}")
        # zeros: attention reads unwritten slots of a sequence's last block (masked), and
        # 0 * NaN would poison them. The host pool is only read where a copy wrote first.
        shape = (num_device_blocks, *block_shape)
        self.device = (torch.zeros(shape, dtype=dtype, device=device) if device.type != "cpu"
                       else untouched_zeros(shape, dtype))
        self.host = torch.empty((num_host_blocks, *block_shape), dtype=dtype,
                                pin_memory=device.type == "cuda")


def merge_runs(pairs: Pairs) -> list[tuple[int, int, int]]:
    """(src, dst, n) runs where both source and destination ids are consecutive: one copy each."""
    runs: list[list[int]] = []
    for s, d in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def copy_merged(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs) -> int:
    """Block-first copy: one copy per run of consecutive blocks. Returns the number of copies."""
    runs = merge_runs(pairs)
    for s, d, n in runs:
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    return len(runs)


def copy_per_layer(src: torch.Tensor, dst: torch.Tensor, pairs: Pairs) -> int:
    """vLLM v0's swap pattern: one copy per block, per layer, for K and for V."""
    layers = src.shape[1]
    for s, d in pairs:
        for layer in range(layers):
            for kv in (0, 1):
                dst[d, layer, kv].copy_(src[s, layer, kv], non_blocking=True)
    return len(pairs) * layers * 2


# ---------------------------------------------------------------- streams

OUT, IN = "out", "in"   # device->host and host->device copy streams


class SyncStreams:
    """No streams (CPU): every copy runs when it is enqueued, so every event is complete."""

    def enqueue(self, stream: str, fn, touches=()) -> None:
        fn()

    def record(self, stream: str) -> object:
        return None

    def wait(self, stream: str, event) -> None:
        """Nothing to wait for: the copy ran when it was enqueued."""

    def wait_compute(self, stream: str) -> None:
        """Nothing to wait for: compute has finished when a copy is enqueued."""

    def compute_wait(self, event) -> None:
        """Nothing to wait for."""

    def done(self, event) -> bool:
        return True

    def synchronize(self) -> None:
        """Every copy has run."""


class CudaStreams:
    """The two copy streams, events and the compute stream of the pools' own device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.streams = {OUT: torch.cuda.Stream(device=device), IN: torch.cuda.Stream(device=device)}

    def enqueue(self, stream: str, fn, touches=()) -> None:
        with torch.cuda.stream(self.streams[stream]):
            fn()

    def record(self, stream: str):
        return self.streams[stream].record_event()

    def wait(self, stream: str, event) -> None:
        if event is not None:
            self.streams[stream].wait_event(event)

    def wait_compute(self, stream: str) -> None:
        self.streams[stream].wait_stream(torch.cuda.current_stream(self.device))

    def compute_wait(self, event) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event) -> bool:
        return event is None or event.query()

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.synchronize()


class DuplexCopier:
    """Moves one epoch's blocks device->host and host->device, both directions at once.

    Ordering, as waits between streams (the CPU runs every copy at once, so it needs none):
    - a copy waits for the compute enqueued before it: device sources were written, and device
      destinations read, by earlier forwards;
    - a copy waits for the other direction's copies of earlier epochs: a swap-in reads host
      blocks an older swap-out writes, and a write-back may reuse a host block that an older
      swap-in still reads (its request finished meanwhile);
    - with DuplexKV the sources of outgoing copies stay fenced in the block manager until they
      land, so the forward never waits for them: they run under it. A swapped-in request either
      computes in the same step (the forward waits for that epoch's swap-ins) or, with
      `overlap`, from the next one, so the forward of epoch N waits only for swap-ins of earlier
      epochs and epoch N's swap-ins run under it too;
    - without DuplexKV (vLLM v0) blocks are reused at once and a swapped-in request computes in
      the same step: swap-ins wait for the same epoch's swap-outs, and the forward for both.
    """

    def __init__(self, pools: KVPools, duplex: bool = True, streams=None, overlap: bool = True):
        self.pools, self.duplex, self.overlap = pools, duplex, duplex and overlap
        if streams is None:
            dev = pools.device.device
            streams = CudaStreams(dev) if dev.type == "cuda" else SyncStreams()
        self.streams = streams
        self.last = {OUT: None, IN: None}             # latest event on each stream
        self.epochs: deque[tuple[int, object]] = deque()  # (epoch, its last outgoing event)
        self.done_epoch = -1
        self.copies = self.blocks_moved = 0

    def submit(self, epoch: int, out_pairs: Pairs, in_pairs: Pairs) -> None:
        """Launch an epoch's copies and make compute wait for the ones its forward reads."""
        earlier = dict(self.last)
        if out_pairs:
            self._launch(OUT, earlier[IN], self.pools.device, self.pools.host, out_pairs)
        if in_pairs:
            same_step = None if self.duplex else self.last[OUT]
            self._launch(IN, earlier[OUT], self.pools.host, self.pools.device, in_pairs, same_step)
        for event in self.forward_waits(earlier):
            self.streams.compute_wait(event)
        self.epochs.append((epoch, self.last[OUT]))

    def forward_waits(self, earlier: dict) -> list:
        if self.overlap:     # requests swapped in now run next step: only earlier swap-ins
            return [earlier[IN]]
        if self.duplex:      # they run now: this step's swap-ins (fences guard the rest)
            return [self.last[IN]]
        return [self.last[OUT], self.last[IN]]  # v0: blocks are reused at once

    def _launch(self, stream: str, other_earlier, src, dst, pairs: Pairs, extra=None) -> None:
        s = self.streams
        s.wait_compute(stream)
        s.wait(stream, other_earlier)
        s.wait(stream, extra)
        tiers = ("device", "host") if stream == OUT else ("host", "device")
        touches = [(tiers[0], a, "r") for a, _ in pairs] + [(tiers[1], b, "w") for _, b in pairs]
        copy = copy_merged if self.duplex else copy_per_layer
        s.enqueue(stream, lambda: self._count(copy(src, dst, pairs)), touches)
        self.blocks_moved += len(pairs)
        self.last[stream] = s.record(stream)

    def _count(self, copies: int) -> None:
        self.copies += copies

    def completed_epoch(self) -> int:
        """The latest epoch whose outgoing copies (and all earlier ones) have landed."""
        while self.epochs and self.streams.done(self.epochs[0][1]):
            self.done_epoch = self.epochs.popleft()[0]
        return self.done_epoch

    def synchronize(self) -> None:
        self.streams.synchronize()
        self.completed_epoch()


# ---------------------------------------------------------------- one process's side of a step

CPU_POOL_BYTES = 256 * 2**20  # the default device pool on a CPU
GPU_POOL_FRACTION = 0.8       # of the GPU memory left free after the weights


def pool_sizes(model: Llama, cfg, device: torch.device) -> tuple[int, int]:
    """(device blocks, host blocks): the config's, or what memory allows."""
    shape = model.kv_block_shape(cfg.block_size)
    dtype = next(model.parameters()).dtype
    dev = cfg.num_device_blocks
    if dev is None:
        budget = GPU_POOL_FRACTION if device.type == "cuda" else CPU_POOL_BYTES
        dev = blocks_for_budget(budget, shape, dtype, device)
    host = cfg.num_host_blocks
    if host is None:  # twice the device pool, within a quarter of the free host memory
        host = min(2 * dev, blocks_for_budget(0.25, shape, dtype, torch.device("cpu")))
    return dev, host


class Runner:
    """One process's model, KV pools and copier (parallel/tp.py runs one per rank)."""

    def __init__(self, model: Llama, cfg, num_device_blocks: int, num_host_blocks: int,
                 duplex: bool, streams=None):
        self.model, self.block_size = model, cfg.block_size
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.pools = KVPools(num_device_blocks, num_host_blocks,
                             model.kv_block_shape(cfg.block_size), dtype, self.device)
        self.copier = DuplexCopier(self.pools, duplex, streams, bool(cfg.swap_in_overlap))

    def execute(self, epoch: int, swap_out, swap_in, seqs: list[Seq]) -> Tensor | None:
        """Copies of `epoch` (both directions at once), then the forward; logits or None."""
        self.copier.submit(epoch, swap_out, swap_in)
        if not seqs:
            return None
        return self.model(make_batch(seqs, self.block_size, self.device), self.pools.device)

    def completed_epoch(self) -> int:
        return self.copier.completed_epoch()

    def synchronize(self) -> None:
        self.copier.synchronize()

    def close(self) -> None:
        """Nothing to release in one process (TPRunner stops its ranks here)."""
