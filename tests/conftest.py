import atexit
import itertools
import os
import shutil
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.manual_seed(0)
# the converted embedded model (weights/loader.py gguf_cache): made once for the session, in a
# folder of its own so that a run never reads what another left, and removed after it
os.environ.setdefault("SUPERINFER_CACHE", tempfile.mkdtemp(prefix="superinfer-test-cache-"))
atexit.register(shutil.rmtree, os.environ["SUPERINFER_CACHE"], True)


def hf_config_dict(vocab=97, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, tied=False,
                   rope=None, theta=10000.0, max_pos=256):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5,
           "rope_theta": theta, "max_position_embeddings": max_pos, "tie_word_embeddings": tied,
           "bos_token_id": 1, "eos_token_id": 2}
    if rope:
        cfg["rope_scaling"] = rope
    return cfg


def tiny_pair(seed=0, **kw):
    """(our model, HF LlamaForCausalLM) on the same random fp32 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from weights.loader import build_model, config_from_hf
    cfg_dict = hf_config_dict(**kw)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**cfg_dict)).float().eval()
    with torch.no_grad():  # HF inits norms to ones; randomise them so a wrong norm shows
        for n, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" not in n else 0.3) + (1.0 if "norm" in n else 0.0))
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    ours = build_model(config_from_hf(cfg_dict), state, "cpu", torch.float32, "test")
    return ours, hf


def share_weights(model, dtype=None):
    """Another Llama over the same weight tensors (no copy), or converted to dtype (one copy)."""
    from model import Llama, rope_inv_freq
    with torch.device("meta"):
        other = Llama(model.cfg)
    state = {k: v if dtype is None else v.to(dtype) for k, v in model.state_dict().items()}
    other.load_state_dict(state, assign=True)
    other.inv_freq = rope_inv_freq(model.cfg)
    if model.cfg.tie_word_embeddings:
        other.lm_head.weight = other.embed.weight
    return other.eval()


def virtual_clock(dt=0.05):
    ticks = itertools.count()
    return lambda: next(ticks) * dt


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 (ours, fp32) and its tokenizer, loaded once."""
    from weights.loader import load_model
    return load_model(None, "cpu", torch.float32)


@pytest.fixture(scope="module")
def smollm_hf():
    """HF transformers' LlamaForCausalLM on the embedded SmolLM2's weights: the reference
    (per module, so that its 0.5 GB is freed when a module is done with it)."""
    from weights.loader import embedded_gguf_path, hf_reference, read_gguf
    hf = hf_reference(*read_gguf(embedded_gguf_path()))
    hf.generation_config.eos_token_id = None  # compare full lengths, past any end of turn
    return hf
