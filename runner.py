"""Runner: executes a step's plan on one process's model and KV pools.

The engine decides (scheduler.py); a runner carries out: launch the epoch's block copies both
ways (kv.DuplexCopier), lay the chunks out as a flat batch, run the forward. With tensor
parallelism each rank has a runner over its shard (tp.py); the decisions stay on rank 0.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kv import DuplexCopier, KVPools, blocks_for_budget
from model import Llama, Seq, make_batch

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
