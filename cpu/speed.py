"""What model.py does only for speed on a CPU, behind one seam a reader of the model can skip.

Two things, neither of which changes a result beyond floating-point rounding:

- Packed weights. pack_weights() reorders each Linear's weight once into oneDNN's blocked layout
  and keeps only that copy (what torch.compile's CPU backend does; F.linear re-reads the plain
  layout on every call). packed_linear() multiplies by it. oneDNN keeps state per input shape,
  so rows are padded to a few counts (padded_rows). On a CPU without bf16 instructions a bf16
  GEMM is emulated, several times slower than fp32, so there bf16 weights are packed widened to
  fp32 (the same values) and multiplied in fp32: products summed in fp32 and rounded to bf16,
  as a native bf16 GEMM does.
- Cache-sized decode groups. split_for_cache() cuts a group of decodes (model.Decodes) so that
  the K and V it gathers a layer stay in the CPU's cache while SDPA reads them.

Re-tune the constants by changing them and timing decode: python -m tools.bench_speed --profile.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

PACK_WEIGHTS = torch.backends.mkldnn.is_available()
PACKABLE = (torch.float32, torch.bfloat16)
WIDEN_BF16 = not torch.ops.mkldnn._is_mkldnn_bf16_supported()

# GATHER_BYTES: the most K and V a decode group gathers a layer, so that SDPA reads the copy
# from cache (larger: fewer, longer SDPA calls whose inputs spill to memory). GATHER_MIN: the
# fewest sequences a group holds, so that their KV heads keep every thread busy in one call.
GATHER_BYTES, GATHER_MIN = 4 << 20, 2


def pack_weights(model: nn.Module) -> None:
    """Pack every packable Linear of model in place (once; packed ones are left as they are):
    model.Linear, which can run packed, says so with its plain_dtype attribute. A weight shared
    with another module (a tied lm_head) gets a packed copy of its own and the other module
    keeps the plain one."""
    if not PACK_WEIGHTS:
        return
    for lin in model.modules():
        w = getattr(lin, "weight", None)
        if not hasattr(lin, "plain_dtype") or w is None or w.is_mkldnn or not w.is_cpu \
                or w.dtype not in PACKABLE or lin.bias is not None:
            continue
        wide = w.float() if w.dtype == torch.bfloat16 and WIDEN_BF16 else w
        packed = torch.ops.mkldnn._reorder_linear_weight(wide.detach(), 32)
        lin.plain_dtype = w.dtype
        lin.weight = nn.Parameter(packed, requires_grad=False)


def unpack(packed: Tensor, dtype: torch.dtype) -> Tensor:
    """The plain weight a packed one was made from (state_dict() gives this)."""
    return packed.to_dense().to(dtype)


def padded_rows(m: int) -> int:
    """m rounded up to three significant bits (1..8, 10, 12, 14, 16, 20, 24, ...): at most 4 row
    counts an octave, padding under a quarter of m."""
    step = 1 << max(0, m.bit_length() - 3)
    return -(-m // step) * step


def packed_linear(x: Tensor, packed: Tensor) -> Tensor:
    """x @ W.T for a packed W: x's rows padded to padded_rows, in the packed dtype."""
    if (rows := padded_rows(m := x.shape[0])) == m and packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    y = nn.functional.pad(x.to(packed.dtype), (0, 0, 0, rows - m))
    return torch.ops.mkldnn._linear_pointwise(y, packed, None, "none", [], "")[:m].to(x.dtype)


def split_for_cache(decodes: list, kv_block_bytes: int) -> list:
    """Each decode group in slices whose K and V (kv_block_bytes a block, a layer) fit within
    GATHER_BYTES, GATHER_MIN sequences a slice at least."""
    return [s for g in decodes for s in g.split(
        max(GATHER_MIN, GATHER_BYTES // (g.block_tables.shape[1] * kv_block_bytes)))]
