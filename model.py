"""Eager Llama-family model over a flat batch of tokens with a paged, block-first KV cache.

Read top-down: the config, rotary embeddings, the batch, the modules, the model. The model owns
weights and the forward pass and knows nothing of scheduling. KV lives in one pool shaped
(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim) (see kv.py), so a block is one
contiguous chunk; attention reads each layer's strided view of it. Loading is in
weights/loader.py; what is done only for speed on a CPU is in cpu/speed.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cpu import speed  # the CPU speed work: packed weights, cache-sized groups


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the field."""


INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "max_position_embeddings")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        for name in INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ModelLoadError(f"config field {name} must be a positive integer, "
                                     f"got {value!r}")
        if self.head_dim == 0 and self.num_heads:
            self.head_dim = self.hidden_size // self.num_heads
        for name in INT_FIELDS:  # head_dim 0 meant "derive it"; now every size must be positive
            if getattr(self, name) == 0:
                raise ModelLoadError(f"config field {name} must be positive, got 0")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ModelLoadError(f"config field {name} must be a positive number, "
                                     f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, "
                                 f"got {self.head_dim}")


# ---------------------------------------------------------------- rotary embeddings

def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    d = cfg.head_dim
    # on the CPU even while a model is built on the meta device: a buffer, not a weight
    steps = torch.arange(0, d, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (cfg.rope_theta ** (steps / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D], sin's first half negated (Llama.forward). HF Llama's
    x * cos + cat(-x2, x1) * sin, the halves rotated (not interleaved), in one op fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


# ---------------------------------------------------------------- the batch

class Seq(NamedTuple):
    """One sequence's part of a step."""
    tokens: list[int]        # new token ids
    start: int               # position of the first one
    block_table: list[int]   # physical blocks holding the sequence's KV
    wants_logits: bool       # sample after this chunk


class Prefill(NamedTuple):
    """A chunk of several tokens, attended to with its own SDPA call."""
    row: int                 # first row of the chunk in the flat batch
    length: int              # tokens in the chunk
    context: int             # tokens of KV the chunk attends to, its own included
    block_table: Tensor      # [ceil(context / block_size)]
    mask: Tensor | None      # [length, context]; None when the chunk starts the sequence


class Decodes(NamedTuple):
    """Single-token queries of similar context length, attended to in one batched call."""
    row: int                 # first row of the group in the flat batch
    length: int              # sequences in the group
    block_tables: Tensor     # [length, width], padded with each sequence's own first block
    mask: Tensor             # [length, 1, 1, width * block_size]: the slots holding context

    def split(self, most: int) -> list["Decodes"]:
        """This group in as few slices of at most `most` sequences as it takes, their sizes
        differing by one at most (a small last slice would leave a thread idle in its SDPA)."""
        n = -(-self.length // most)
        cut = [self.length * i // n for i in range(n + 1)]
        return [Decodes(self.row + a, b - a, self.block_tables[a:b], self.mask[a:b])
                for a, b in zip(cut, cut[1:])]


@dataclass(slots=True)
class Batch:
    """One flat step: single-token decodes first, shortest context first, in a few groups (one
    attention call each), then chunks. slot_blocks/slot_offsets say where each new token's K/V
    is written."""
    input_ids: Tensor            # [T]
    positions: Tensor            # [T]
    slot_blocks: Tensor          # [T]
    slot_offsets: Tensor         # [T]
    decodes: list[Decodes]
    prefills: list[Prefill]
    logits_indices: Tensor       # [S] rows whose next-token logits are wanted, in seqs' order


# Decode attention runs over groups of sequences, each gathered from the paged pool and padded
# to its widest. GROUP_COST_BLOCKS: what a group's fixed cost (one K and one V gather and one
# SDPA call a layer) is worth in padding blocks; more groups pad less but pay it more often.
# Re-tune it by changing it and timing decode: python -m tools.bench_speed --profile.
GROUP_COST_BLOCKS = 16


def decode_groups(widths: list[int], cost: int) -> list[int]:
    """Where to cut decodes sorted by width (blocks of context) into groups, each padded to its
    widest: the cut that minimises padded blocks + cost per group; returns each group's end.
    Dynamic programming over the distinct widths, so a few dozen candidates at most."""
    ends = [i + 1 for i in range(len(widths)) if i + 1 == len(widths) or widths[i + 1] != widths[i]]
    best, cut = [0] + [math.inf] * len(ends), [0] * (len(ends) + 1)
    for j, end in enumerate(ends, 1):
        for i in range(j):
            start = ends[i - 1] if i else 0
            c = best[i] + (end - start) * widths[end - 1] + cost
            if c < best[j]:
                best[j], cut[j] = c, i
    out, j = [], len(ends)
    while j:
        out, j = [ends[j - 1]] + out, cut[j]
    return out


def make_batch(seqs: list[Seq], block_size: int, device: torch.device | str = "cpu") -> Batch:
    """Lay seqs out flat, decodes first; logits rows come back in the order of `seqs`."""
    single = lambda i: len(seqs[i].tokens) == 1  # decodes first, shortest context first
    order = sorted(range(len(seqs)), key=lambda i: (not single(i), seqs[i].start * single(i)))
    ids, pos, blocks, offs, last_row, prefills, dec_tables = [], [], [], [], {}, [], []
    for i in order:
        toks, start, table, _ = seqs[i]
        n, row = len(toks), len(ids)
        span = range(start, start + n)
        ids += toks
        pos += span
        blocks += [table[p // block_size] for p in span]
        offs += [p % block_size for p in span]
        if n == 1:
            dec_tables.append(table[:start // block_size + 1])
        else:  # query j of the chunk sits at position start + j and sees keys 0 .. start + j
            ctx = start + n
            mask = None if not start else torch.ones(n, ctx, dtype=torch.bool,
                                                     device=device).tril(start)
            table_t = torch.tensor(table[:-(-ctx // block_size)], device=device)
            prefills.append(Prefill(row, n, ctx, table_t, mask))
        last_row[i] = row + n - 1
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return Batch(t(ids), t(pos), t(blocks), t(offs),
                 decode_batches(dec_tables, pos, block_size, device), prefills,
                 t([last_row[i] for i, s in enumerate(seqs) if s.wants_logits]))


def decode_batches(tables: list[list[int]], pos: list[int], block_size: int,
                   device) -> list[Decodes]:
    """The decodes (rows 0.. of the batch, sorted by width) in groups (decode_groups)."""
    groups, start = [], 0
    for end in decode_groups([len(tb) for tb in tables], GROUP_COST_BLOCKS):
        width = len(tables[end - 1])
        padded = [tb + tb[:1] * (width - len(tb)) for tb in tables[start:end]]
        lens = torch.tensor(pos[start:end], device=device) + 1
        mask = torch.arange(width * block_size, device=device) < lens[:, None]
        groups.append(Decodes(start, end - start, torch.tensor(padded, device=device),
                              mask[:, None, None, :]))
        start = end
    return groups


# ---------------------------------------------------------------- the modules

class Linear(nn.Linear):
    """nn.Linear, bias-free in this model. On the CPU, speed.pack_weights may replace its weight
    with a copy packed for oneDNN (the only copy kept); state_dict() still gives the plain one."""
    plain_dtype: torch.dtype | None = None   # the weight's dtype before it was packed

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.is_mkldnn:
            return speed.packed_linear(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight.is_mkldnn:
            destination[prefix + "weight"] = speed.unpack(self.weight, self.plain_dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=False)
        self.wo = Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, b: Batch,
                scratch: Tensor) -> Tensor:
        T = x.shape[0]
        qk, v = self.wqkv(x).split([(self.h + self.kvh) * self.d, self.kvh * self.d], -1)
        qk = apply_rope(qk.view(T, self.h + self.kvh, self.d), cos, sin)  # q and k in one go
        q, k = qk[:, :self.h], qk[:, self.h:]                        # [T, H, Dh], [T, KVH, Dh]
        # kv_cache: [num_blocks, 2, bs, KVH, Dh], this layer's strided view of the pool
        kv_cache[b.slot_blocks, 0, b.slot_offsets] = k
        kv_cache[b.slot_blocks, 1, b.slot_offsets] = v.view(T, self.kvh, self.d)
        out = torch.empty_like(q)
        for g in b.decodes:
            rows = slice(g.row, g.row + g.length)
            out[rows] = self.decode(q[rows], self.gather(kv_cache, g.block_tables, scratch), g)
        for p in b.prefills:
            rows = slice(p.row, p.row + p.length)
            out[rows] = self.prefill(q[rows], self.gather(kv_cache, p.block_table, scratch), p)
        return self.wo(out.view(T, self.h * self.d))

    @staticmethod
    def gather(kv_cache: Tensor, blocks: Tensor, scratch: Tensor) -> tuple[Tensor, Tensor]:
        """K and V of the blocks in `blocks` (any shape, flattened), each [n, bs, KVH, Dh],
        copied into scratch (Llama.scratch). index_select copies whole blocks, a few contiguous
        copies instead of one per token."""
        blocks = blocks.flatten()
        n = blocks.numel()
        k, v = scratch[:2 * n * kv_cache[0, 0].numel()].view(2, n, *kv_cache.shape[2:])
        torch.index_select(kv_cache[:, 0], 0, blocks, out=k)
        torch.index_select(kv_cache[:, 1], 0, blocks, out=v)
        return k, v

    def decode(self, q: Tensor, kv: tuple[Tensor, Tensor], g: Decodes) -> Tensor:
        """A group of single-token queries in one call. GQA without repeating K/V: the H / KVH
        query heads that share a KV head are that head's queries ([D, KVH, G, Dh] against K/V
        [D, KVH, S, Dh] gathered from the blocks); SDPA's enable_gqa would expand K/V first."""
        D = q.shape[0]
        k, v = (x.view(D, -1, self.kvh, self.d).transpose(1, 2) for x in kv)
        o = F.scaled_dot_product_attention(q.view(D, self.kvh, self.h // self.kvh, self.d), k, v,
                                           attn_mask=g.mask)
        return o.reshape(D, self.h, self.d)

    def prefill(self, q: Tensor, kv: tuple[Tensor, Tensor], p: Prefill) -> Tensor:
        """One chunk: [1, H, n, Dh] queries over its [1, KVH, context, Dh] keys, causal within.
        SDPA takes its CPU flash kernel only for 4-d inputs (3-d ones fall back to the unfused
        math path, which materialises the scores), hence the batch dimension of one."""
        k, v = (x.flatten(0, 1)[:p.context].transpose(0, 1) for x in kv)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                           attn_mask=p.mask, is_causal=p.mask is None,
                                           enable_gqa=True)
        return o[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = Linear(cfg.hidden_size, 2 * self.inter, bias=False)  # gate and up, fused
        self.w2 = Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, kv_cache, b, scratch):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, b, scratch)
        return x + self.ffn(self.ffn_norm(x))


# ---------------------------------------------------------------- the model

class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # zeros, not nn.Embedding's random init: the weights come from a checkpoint, and a
        # model built on the meta device (weights/loader.py) then needs no meta normal_
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                  _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._scratch: Tensor | None = None
        self.packed = False  # CPU weights packed for oneDNN (cpu/speed.py), at the first step

    @torch.inference_mode()
    def forward(self, b: Batch, kv_pool: Tensor) -> Tensor:
        """Run one flat step, writing new K/V into kv_pool; returns logits [S, vocab] (fp32)."""
        x = self.embed(b.input_ids)                                  # x: [T, hidden]
        if kv_pool.device.type == "cpu":  # kv_pool[0, 0]: one block's K and V of one layer
            if not self.packed:
                speed.pack_weights(self)
                self.packed = True
            b.decodes = speed.split_for_cache(b.decodes, kv_pool[0, 0].nbytes)
        freqs = b.positions[:, None].to(self.inv_freq.dtype) * self.inv_freq
        c, s = freqs.cos(), freqs.sin()                              # [T, Dh / 2] each
        cos, sin = (torch.cat(h, -1)[:, None, :].to(x.dtype) for h in ((c, c), (-s, s)))
        scratch = self.scratch(b, kv_pool)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i], b, scratch)
        x = self.norm(x[b.logits_indices])
        return self.lm_head(x).float()

    def scratch(self, b: Batch, kv_pool: Tensor) -> Tensor:
        """Room for the K and V one attention call gathers, kept from step to step and layer to
        layer: a fresh tensor per gather of a large size is page-faulted in anew by the CPU
        allocator, a cost that grows with the context and exceeds the copy itself."""
        blocks = max([g.block_tables.numel() for g in b.decodes]
                     + [p.block_table.numel() for p in b.prefills], default=0)
        need = max(1, 2 * blocks * kv_pool[0, 0, 0].numel())
        s = self._scratch
        if s is None or s.numel() < need or (s.dtype, s.device) != (kv_pool.dtype, kv_pool.device):
            s = self._scratch = kv_pool.new_empty(need)
        return s

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One KV block: every layer's K and V for block_size tokens (this rank's KV heads)."""
        c = self.cfg
        return (c.num_layers, 2, block_size, self.layers[0].attn.kvh, c.head_dim)
