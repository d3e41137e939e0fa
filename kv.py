"""Two-tier paged KV cache: block accounting, the tensor pools, and the DuplexKV copier.

BlockManager is pure Python (no tensors), so the scheduler, the simulator and the property tests
share it. A request's blocks live on one tier: its device block table while RUNNING, its host
blocks while ROTARY. With `duplex=True` (DuplexKV) copies run beside compute: a request keeps
host copies of its full device blocks, written back eagerly in the background, so rotating out
copies only the blocks that are still dirty; and a device block that is the source of a copy
still in flight is *fenced* (freed, but not handed out until the copy is known to be done), so a
swap-in destination never aliases an in-flight swap-out source. With `duplex=False` (vLLM v0)
compute waits for every copy, so freed blocks are reusable at once and nothing is mirrored.

Run `python kv.py --bench` for the copy benchmark (per-layer per-block vs merged vs duplex).
"""
from __future__ import annotations

import argparse
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

Pairs = list[tuple[int, int]]  # (source block, destination block)


class KVError(ValueError):
    """Misuse of the block accounting: unknown request, double free, a budget that cannot fit."""


class BlockPool:
    """One tier's blocks: a free list and who owns each used block."""

    def __init__(self, name: str, capacity: int):
        if capacity < 0:
            raise KVError(f"{name} pool: capacity must be >= 0, got {capacity}")
        self.name, self.capacity = name, capacity
        self.free: deque[int] = deque(range(capacity))
        self.owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, rid: str, n: int) -> list[int]:
        if n > len(self.free):
            raise KVError(f"{self.name} pool: {rid} asks for {n} blocks, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.owner[b] = rid
        return blocks

    def release(self, rid: str, blocks: list[int], keep: set[int] = frozenset()) -> None:
        """Take blocks from rid; those in `keep` are left off the free list (the caller fences them)."""
        for b in blocks:
            if self.owner.get(b) != rid:
                raise KVError(f"{self.name} pool: block {b} freed by {rid} but owned by {self.owner.get(b)}")
            del self.owner[b]
            if b not in keep:
                self.free.append(b)


@dataclass(slots=True)
class SeqKV:
    dev: list[int]       # device block table (empty while parked on host)
    host: list[int]      # host blocks mirroring logical blocks [0, len(host))
    num_tokens: int = 0  # tokens that have a KV slot
    clean: int = 0       # logical blocks [0, clean) equal their host copy
    on_host: bool = False


class BlockManager:
    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int, duplex: bool = True):
        if block_size <= 0:
            raise KVError(f"block_size must be positive, got {block_size}")
        self.block_size, self.duplex = block_size, duplex
        self.device = BlockPool("device", num_device_blocks)
        self.host = BlockPool("host", num_host_blocks)
        self.seqs: dict[str, SeqKV] = {}
        self.epoch = 0                   # copies planned now belong to this epoch
        self.busy: dict[int, int] = {}   # device block -> epoch of the last copy reading it
        self.fenced: set[int] = set()    # freed device blocks whose outgoing copy may be in flight

    # ------------------------------------------------------------ queries
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def seq(self, rid: str) -> SeqKV:
        if rid not in self.seqs:
            raise KVError(f"unknown request {rid!r}")
        return self.seqs[rid]

    def num_blocks(self, rid: str) -> int:
        s = self.seqs.get(rid)
        return self.blocks_for(s.num_tokens) if s else 0

    def new_blocks_needed(self, rid: str, n: int) -> int:
        """Device blocks to allocate before rid's KV can grow by n tokens."""
        s = self.seqs.get(rid)
        have = len(s.dev) if s else 0
        return max(0, self.blocks_for((s.num_tokens if s else 0) + n) - have)

    def swap_out_cost(self, rid: str) -> tuple[int, int]:
        """(host blocks to allocate, blocks to copy) to park rid on host."""
        s = self.seq(rid)
        n = len(s.dev)
        return max(0, n - len(s.host)), n - s.clean

    def block_table(self, rid: str) -> list[int]:
        return self.seq(rid).dev

    # ------------------------------------------------------------ growth and write-back
    def append(self, rid: str, n: int) -> list[int]:
        """Give rid KV slots for n more tokens on device; returns the newly allocated blocks."""
        s = self.seqs.setdefault(rid, SeqKV([], []))
        assert not s.on_host, f"{rid} is parked on host"
        need = self.blocks_for(s.num_tokens + n) - len(s.dev)
        new = self.device.allocate(rid, need) if need > 0 else []
        s.dev += new
        s.clean = min(s.clean, s.num_tokens // self.block_size)  # the block the next token lands in
        s.num_tokens += n
        return new

    def writeback(self, rid: str, computed_tokens: int, limit: int, reserve: int = 0) -> Pairs:
        """Plan copies of rid's full, dirty device blocks to their host mirror (at most `limit`
        blocks, leaving `reserve` host blocks free for rotations)."""
        s = self.seq(rid)
        full = min(computed_tokens, s.num_tokens) // self.block_size
        if not self.duplex or s.on_host or full <= s.clean:
            return []
        room = max(0, self.host.num_free - reserve)
        upto = s.clean
        while upto < full and upto - s.clean < limit and (upto < len(s.host) or room > 0):
            if upto >= len(s.host):
                s.host += self.host.allocate(rid, 1)
                room -= 1
            upto += 1
        pairs = [(s.dev[i], s.host[i]) for i in range(s.clean, upto)]
        self._mark_busy(pairs)
        s.clean = upto
        return pairs

    # ------------------------------------------------------------ rotation
    def swap_out(self, rid: str) -> Pairs:
        """Park rid on host: copy its dirty blocks, free (or fence) its device blocks."""
        s = self.seq(rid)
        assert not s.on_host, f"{rid} is already on host"
        need, _ = self.swap_out_cost(rid)
        s.host += self.host.allocate(rid, need)
        pairs = [(s.dev[i], s.host[i]) for i in range(s.clean, len(s.dev))]
        self._mark_busy(pairs)
        self._free_device(rid, s.dev)
        s.dev, s.clean, s.on_host = [], len(s.host), True
        return pairs

    def swap_in(self, rid: str) -> Pairs:
        """Bring rid back to device: every block is copied; the host copy stays as its mirror."""
        s = self.seq(rid)
        assert s.on_host, f"{rid} is not on host"
        n = self.blocks_for(s.num_tokens)
        s.dev = self.device.allocate(rid, n)
        pairs = list(zip(s.host[:n], s.dev))
        s.on_host, s.clean = False, n
        if not self.duplex:  # vLLM v0: host blocks are freed once swapped back in
            self.host.release(rid, s.host)
            s.host, s.clean = [], 0
        return pairs

    def free(self, rid: str) -> None:
        """Drop every block of rid on both tiers (finish, abort or recompute-preemption)."""
        s = self.seqs.pop(rid, None)
        if s is None:
            raise KVError(f"free of unknown request {rid!r} (never allocated, or freed twice)")
        self._free_device(rid, s.dev)
        self.host.release(rid, s.host)

    # ------------------------------------------------------------ copy fences
    def _mark_busy(self, pairs: Pairs) -> None:
        if not self.duplex:
            return  # compute waits for these copies, so their sources are reusable at once
        for src, _ in pairs:
            self.busy[src] = self.epoch

    def _free_device(self, rid: str, blocks: list[int]) -> None:
        held = {b for b in blocks if b in self.busy}
        self.device.release(rid, blocks, keep=held)
        self.fenced |= held

    def next_epoch(self) -> int:
        """Close the current epoch of planned copies; returns the one just closed."""
        self.epoch += 1
        return self.epoch - 1

    def copies_done(self, epoch: int | None = None) -> None:
        """Every copy planned in epochs <= epoch (all, if None) has completed."""
        done = [b for b, e in self.busy.items() if epoch is None or e <= epoch]
        for b in done:
            del self.busy[b]
            if b in self.fenced:
                self.fenced.discard(b)
                self.device.free.append(b)

    # ------------------------------------------------------------ invariants
    def check(self) -> None:
        for pool in (self.device, self.host):
            free = set(pool.free)
            assert len(free) == len(pool.free), f"{pool.name}: a block is free twice"
            assert not free & set(pool.owner), f"{pool.name}: a block is both free and owned"
        assert not self.fenced & set(self.device.free) and not self.fenced & set(self.device.owner)
        assert self.device.num_free + len(self.device.owner) + len(self.fenced) == self.device.capacity
        assert self.host.num_free + len(self.host.owner) == self.host.capacity
        for rid, s in self.seqs.items():
            assert all(self.device.owner[b] == rid for b in s.dev), rid
            assert all(self.host.owner[b] == rid for b in s.host), rid
            n = self.blocks_for(s.num_tokens)
            if s.on_host:
                assert not s.dev and len(s.host) >= n, f"{rid}: parked but not all blocks on host"
            else:
                assert len(s.dev) >= n, f"{rid}: running without device blocks for its tokens"
                assert s.clean <= min(len(s.host), len(s.dev)), rid
        owned = sum(len(s.dev) for s in self.seqs.values())
        assert owned == len(self.device.owner)
        assert sum(len(s.host) for s in self.seqs.values()) == len(self.host.owner)


# ---------------------------------------------------------------- tensors

def block_bytes(block_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in block_shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


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
    n = budget // block_bytes(block_shape, dtype)
    if n <= 0:
        raise KVError(f"a KV budget of {budget} bytes holds no block of {block_bytes(block_shape, dtype)} bytes")
    return n


class KVPools:
    """Device pool and host pool, both (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str):
        device = torch.device(device)
        for name, n in (("num_device_blocks", num_device_blocks), ("num_host_blocks", num_host_blocks)):
            if n < 0:
                raise KVError(f"{name} must be >= 0, got {n}")
        # zeros, not empty: attention reads padded block slots (masked), and 0 * NaN would poison them
        self.device = torch.zeros((num_device_blocks, *block_shape), dtype=dtype, device=device)
        self.host = torch.zeros((num_host_blocks, *block_shape), dtype=dtype,
                                pin_memory=device.type == "cuda")

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided per-layer K and V views of the device pool: (num_blocks, block_size, kv_heads, head_dim)."""
        return self.device[:, i, 0], self.device[:, i, 1]


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


class DuplexCopier:
    """Moves blocks device->host and host->device, on two CUDA streams when there is a GPU.

    submit() launches one epoch's write-backs/swap-outs and swap-ins together; the compute stream
    waits (wait_inputs) only for this epoch's swap-ins; completed_epoch() tells the block manager
    which outgoing copies have finished so it can unfence their source blocks. Without CUDA the
    same calls copy synchronously. duplex=False is vLLM v0's path: per-layer per-block copies
    that the compute stream waits for in both directions.
    """

    def __init__(self, pools: KVPools, duplex: bool = True):
        self.pools, self.duplex = pools, duplex
        self.cuda = pools.device.is_cuda
        if self.cuda:
            self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self.in_flight: deque[tuple[int, object]] = deque()  # (epoch, event after its outgoing copies)
        self.last_in_event = None
        self.done_epoch = -1
        self.copies = self.blocks_moved = 0

    def _copy(self, src, dst, pairs: Pairs) -> None:
        self.copies += (copy_merged if self.duplex else copy_per_layer)(src, dst, pairs)
        self.blocks_moved += len(pairs)

    def submit(self, epoch: int, out_pairs: Pairs, in_pairs: Pairs) -> None:
        if not self.cuda:
            self._copy(self.pools.device, self.pools.host, out_pairs)
            self._copy(self.pools.host, self.pools.device, in_pairs)
            self.done_epoch = epoch
            return
        compute = torch.cuda.current_stream()
        prior_out = self.in_flight[-1][1] if self.in_flight else None
        if out_pairs:
            with torch.cuda.stream(self.out_stream):
                self.out_stream.wait_stream(compute)  # blocks written by earlier forwards
                self._copy(self.pools.device, self.pools.host, out_pairs)
                ev = torch.cuda.Event()
                ev.record(self.out_stream)
            self.in_flight.append((epoch, ev))
        else:
            self.in_flight.append((epoch, None))
        self.last_in_event = None
        if in_pairs:
            with torch.cuda.stream(self.in_stream):
                self.in_stream.wait_stream(compute)   # destinations may have been read by earlier steps
                if prior_out is not None:             # host sources written by earlier swap-outs
                    self.in_stream.wait_event(prior_out)
                self._copy(self.pools.host, self.pools.device, in_pairs)
                self.last_in_event = torch.cuda.Event()
                self.last_in_event.record(self.in_stream)

    def wait_inputs(self) -> None:
        """Make the compute stream wait for this epoch's swap-ins (and, without duplex, swap-outs)."""
        if not self.cuda:
            return
        if self.last_in_event is not None:
            torch.cuda.current_stream().wait_event(self.last_in_event)
        if not self.duplex and self.in_flight and self.in_flight[-1][1] is not None:
            torch.cuda.current_stream().wait_event(self.in_flight[-1][1])

    def completed_epoch(self) -> int:
        while self.in_flight and (self.in_flight[0][1] is None or self.in_flight[0][1].query()):
            self.done_epoch = self.in_flight.popleft()[0]
        return self.done_epoch

    def synchronize(self) -> None:
        if self.cuda:
            self.out_stream.synchronize()
            self.in_stream.synchronize()
        self.completed_epoch()


# ---------------------------------------------------------------- copy benchmark

def _timeit(fn, sync, repeat=5) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def bench_copies(total_mib: int = 256, block_size: int = 16, layers: int = 30, kv_heads: int = 3,
                 head_dim: int = 64, dtype=torch.float32, device: str | None = None) -> dict:
    """Move the same blocks every way and report GB/s next to a plain contiguous copy of the bytes."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = (layers, 2, block_size, kv_heads, head_dim)
    bb = block_bytes(shape, dtype)
    n = max(1, total_mib * 2**20 // bb)
    pools = KVPools(2 * n, 2 * n, shape, dtype, device)
    pools.device.normal_()
    pools.host.normal_()
    out_pairs = list(zip(range(n), range(n)))          # device blocks [0, n) -> host [0, n)
    in_pairs = list(zip(range(n, 2 * n), range(n, 2 * n)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    flat_dev, flat_host = pools.device[:n].view(-1), pools.host[:n].view(-1)
    nbytes = n * bb
    res = {"device": str(device), "blocks": n, "block_bytes": bb, "bytes_per_layer_copy": bb // (2 * layers),
           "mib": nbytes / 2**20}
    res["plain_d2h"] = nbytes / _timeit(lambda: flat_host.copy_(flat_dev, non_blocking=True), sync) / 1e9
    res["per_layer_d2h"] = nbytes / _timeit(lambda: copy_per_layer(pools.device, pools.host, out_pairs), sync) / 1e9
    res["merged_d2h"] = nbytes / _timeit(lambda: copy_merged(pools.device, pools.host, out_pairs), sync) / 1e9
    res["merged_h2d"] = nbytes / _timeit(lambda: copy_merged(pools.host, pools.device, in_pairs), sync) / 1e9
    copier = DuplexCopier(pools)
    res["duplex_total"] = 2 * nbytes / _timeit(lambda: copier.submit(0, out_pairs, in_pairs), lambda: copier.synchronize()) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description="DuplexKV copy benchmark: per-layer per-block vs merged "
                                             "block-first vs both directions at once")
    ap.add_argument("--bench", action="store_true", help="run the copy benchmark")
    ap.add_argument("--mib", type=int, default=256, help="KV bytes moved each way (MiB)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if not args.bench:
        ap.print_help()
        return
    r = bench_copies(args.mib, args.block_size, device=args.device)
    plain = r["plain_d2h"]
    print(f"Copy benchmark on {r['device']}: {r['blocks']} blocks x {r['block_bytes'] / 2**10:.0f} KiB "
          f"({r['mib']:.0f} MiB), SmolLM2-135M KV shape, {r['bytes_per_layer_copy'] / 2**10:.0f} KiB per layer copy")
    print(f"{'path':<34}{'GB/s':>8}{'vs plain':>10}")
    for key, label in (("plain_d2h", "plain contiguous copy"), ("per_layer_d2h", "per-layer per-block (vLLM v0)"),
                       ("merged_d2h", "merged block-first, d->h"), ("merged_h2d", "merged block-first, h->d"),
                       ("duplex_total", "duplex, both directions (total)")):
        print(f"{label:<34}{r[key]:8.2f}{r[key] / plain:9.2f}x")
    print(f"merged / per-layer: {r['merged_d2h'] / r['per_layer_d2h']:.1f}x")


if __name__ == "__main__":
    main()
