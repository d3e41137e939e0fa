"""Tensor parallelism over torch.distributed (gloo on CPUs, NCCL on GPUs), after gpt-fast's tp.py.

Each of N ranks holds 1/N of every layer: attention heads by KV-head groups (Q/K/V column-
parallel, the output projection row-parallel), the MLP's gate/up column-parallel and down row-
parallel, with an all-reduce after each row-parallel product; the embedding and LM head are
split by vocabulary (the embedding's partial lookups are all-reduced, the logits gathered on
rank 0). Sizes need not divide evenly (SmolLM2's 3 KV heads go 2 + 1 on two ranks); a rank needs
at least one KV head.

The scheduler runs once, on rank 0, in the engine: every step it broadcasts the plan (the copies
and the chunks to compute). Each rank's KV pools hold its heads of the same block ids, its
DuplexCopier moves its own shard, and its forward waits only for its own swap-ins. Ranks 1..N-1
are processes the engine spawns; collectives time out, and a dead rank is a clear error.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from kv import Runner
from model import Llama, ModelConfig, rope_inv_freq
from weights.loader import load_model



def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items, as even as possible (first ranks take the rest)."""
    sizes = [n // world + (r < n % world) for r in range(world)]
    return sum(sizes[:rank]), sum(sizes[:rank + 1])


# ---------------------------------------------------------------- sharding a model

def all_reduce_output(module: nn.Module, inputs, output: Tensor) -> Tensor:
    dist.all_reduce(output)
    return output


class VocabEmbedding(nn.Module):
    """This rank's rows of the embedding; tokens outside them look up zeros, then all-reduce."""

    def __init__(self, weight: Tensor, start: int):
        super().__init__()
        self.weight, self.start = nn.Parameter(weight, requires_grad=False), start

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = self.weight[local.clamp(0, self.weight.shape[0] - 1)] * mine[:, None]
        dist.all_reduce(out)
        return out


def shard(model: Llama, rank: int, world: int) -> Llama:
    """Keep rank's part of every weight, in place."""
    cfg = model.cfg
    if cfg.num_kv_heads < world:
        raise ValueError(f"tensor_parallel_size {world} exceeds num_key_value_heads "
                         f"({cfg.num_kv_heads}): each rank needs a KV head (KV heads are not "
                         "replicated)")
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    k0, k1 = split(cfg.num_kv_heads, world, rank)          # this rank's KV heads
    i0, i1 = split(cfg.intermediate_size, world, rank)
    v0, v1 = split(cfg.vocab_size, world, rank)
    q_rows = torch.arange(k0 * g * d, k1 * g * d)
    kv_rows = torch.arange(k0 * d, k1 * d)
    H, KV = cfg.num_heads * d, cfg.num_kv_heads * d
    for layer in model.layers:
        a, f = layer.attn, layer.ffn
        rows = torch.cat([q_rows, H + kv_rows, H + KV + kv_rows])
        keep(a.wqkv, a.wqkv.weight[rows])                     # column-parallel
        keep(a.wo, a.wo.weight[:, q_rows])                     # row-parallel: all-reduce after
        a.h, a.kvh = (k1 - k0) * g, k1 - k0
        inter = cfg.intermediate_size
        keep(f.w13, torch.cat([f.w13.weight[i0:i1], f.w13.weight[inter + i0:inter + i1]]))
        keep(f.w2, f.w2.weight[:, i0:i1])
        f.inter = i1 - i0
        a.wo.register_forward_hook(all_reduce_output)
        f.w2.register_forward_hook(all_reduce_output)
    model.embed = VocabEmbedding(model.embed.weight[v0:v1].clone(), v0)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    else:
        keep(model.lm_head, model.lm_head.weight[v0:v1])
    return model


def keep(linear: nn.Linear, weight: Tensor) -> None:
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)


# ---------------------------------------------------------------- ranks

def gather_logits(logits: Tensor | None, vocab: int, world: int) -> Tensor | None:
    """Rank 0 gets [S, vocab] from every rank's [S, vocab share] (padded to one size)."""
    if logits is None:
        return None
    width = split(vocab, world, 0)[1]
    padded = torch.nn.functional.pad(logits, (0, width - logits.shape[1]))
    parts = [torch.empty_like(padded) for _ in range(world)] if dist.get_rank() == 0 else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return torch.cat([p[:, :split(vocab, world, r)[1] - split(vocab, world, r)[0]]
                      for r, p in enumerate(parts)], dim=1)


def init(rank: int, world: int, address: str, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("SUPERINFER_TP_TIMEOUT", 60)))
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world,
                            timeout=timeout)


def rank_device(cfg, rank: int) -> torch.device:
    cuda = (cfg.device or "").startswith("cuda")
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def load_shard(model_cfg: ModelConfig, state: dict, rank: int, world: int, device) -> Llama:
    """Rank's shard of the model whose full weights rank 0 shared (in shared memory)."""
    with torch.device("meta"):
        model = Llama(model_cfg)
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(model_cfg)
    if model_cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return shard(model, rank, world).to(device).eval()


def worker(rank: int, world: int, address: str, cfg, model_cfg, state: dict, pools: tuple) -> None:
    """Ranks 1..N-1: shard the model, then run every plan rank 0 broadcasts until told to stop."""
    device = rank_device(cfg, rank)
    init(rank, world, address, device)
    model = load_shard(model_cfg, state, rank, world, device)
    del state
    runner = Runner(model, cfg, *pools)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is None:
            break
        kind, args = msg[0]
        if kind == "digest":
            dist.gather_object(digest(runner, args), None, dst=0)
            continue
        gather_logits(runner.execute(*args), model_cfg.vocab_size, world)
        dist.all_reduce(torch.tensor([runner.completed_epoch()]), op=dist.ReduceOp.MIN)
    dist.destroy_process_group()


def digest(runner: Runner, blocks: list[int]) -> str:
    """A hash of this rank's KV bytes in the given device blocks (for tests)."""
    runner.synchronize()
    data = runner.pools.device[blocks].cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


class TPRunner:
    """Rank 0's side: its own shard, the spawned ranks 1..N-1, and each step's plan broadcast."""

    def __init__(self, cfg, model: Llama | None = None):
        self.world, self.tokenizer = cfg.tensor_parallel_size, None
        if model is None:
            model, self.tokenizer = load_model(cfg.model, cfg.device, cfg.dtype)
        self.model_cfg = model.cfg
        self.state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        # from the plain weights (state_dict unpacks weights a CPU run has packed)
        self.model = load_shard(self.model_cfg, self.state, 0, self.world, rank_device(cfg, 0))
        self.procs, self.dead = [], None
        self.landed = -1

    def start(self, cfg, num_device_blocks: int, num_host_blocks: int, duplex: bool) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        pools = (num_device_blocks, num_host_blocks, duplex)
        ctx = mp.get_context("spawn")
        for rank in range(1, self.world):
            p = ctx.Process(target=worker, args=(rank, self.world, address, cfg, self.model_cfg,
                                                 self.state, pools), daemon=True)
            p.start()
            self.procs.append(p)
        init(0, self.world, address, rank_device(cfg, 0))
        self.state = None  # the workers have their shards
        self.runner = Runner(self.model, cfg, *pools)
        self.pools, self.copier = self.runner.pools, self.runner.copier

    def execute(self, epoch: int, swap_out, swap_in, seqs):
        """Every rank runs the plan on its shard; rank 0 gets the whole logits."""
        if self.dead is None:
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    self.dead = f"tensor-parallel rank {rank} exited (code {p.exitcode})"
        if self.dead:
            raise RuntimeError(self.dead)
        try:
            dist.broadcast_object_list([("step", (epoch, swap_out, swap_in, seqs))], src=0)
            logits = gather_logits(self.runner.execute(epoch, swap_out, swap_in, seqs),
                                   self.model_cfg.vocab_size, self.world)
            landed = torch.tensor([self.runner.completed_epoch()])
            dist.all_reduce(landed, op=dist.ReduceOp.MIN)  # fences lift once all ranks' copies land
            self.landed = int(landed)
            return logits
        except (RuntimeError, dist.DistBackendError) as e:
            self.dead = f"tensor-parallel collective failed (a rank died or timed out): {e}"
            raise RuntimeError(self.dead) from e

    def completed_epoch(self) -> int:
        return min(self.runner.completed_epoch(), self.landed)

    def digests(self, blocks: list[int]) -> list[str]:
        """Each rank's hash of its shard of these device blocks (rank 0 first)."""
        dist.broadcast_object_list([("digest", blocks)], src=0)
        out = [None] * self.world
        dist.gather_object(digest(self.runner, blocks), out, dst=0)
        return out

    def synchronize(self) -> None:
        self.runner.synchronize()

    def close(self) -> None:
        if not self.procs:
            return
        if self.dead is None:
            try:
                dist.broadcast_object_list([None], src=0)
            except RuntimeError:
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        self.procs = []
        if dist.is_initialized():
            dist.destroy_process_group()
